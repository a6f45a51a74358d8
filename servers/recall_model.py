"""The tiny hybrid, trained to recall the needles of blackbox's own documents.

The planted model (servers/tiny_model.py) recalls 0%: nothing in it looks a name up. The recall grader, and the
single-endpoint mode whose only grader on a server without a reference is recall, need a model that answers
"what is the code of X ?" from its context near-perfectly without a cache, so that a wrong restored state shows
as lost recall, as it does on real models. This trains the planted model on the workload's own documents and
questions (`blackbox.workload`) and caches the result like the model build:

- what carries the planted behaviour elsewhere stays: the GDN decays (`A_log`, `dt_bias`) are frozen, the MTP
  layer is the planted one, and of the embedding and `lm_head` only the rows of names and code words move;
- a distillation term (KL to the planted model at every position that is not an answer) keeps the stories the
  treatment writes in turn 1, and so the drafter's acceptance, close to the planted model's;
- a curriculum: short documents, half of them with their facts repeated (plain induction: the copy circuit
  forms there), medium ones, then conversations at the tester's length (a document, a story like the model's,
  questions); every example asks all its needles and the first code word's loss counts more.

The shipped weights (`ASSET`) are the artifact: the default recipe was trained on a GPU (`Training.device`,
an NVIDIA H200: 1860 steps in ~5 min). GPU float sums are not the CPU's, so retraining is seeded but not
bit-reproducible, and on the 2-core CPU the same recipe would take many hours (a much smaller CPU recipe reached
16% recall in 43 min). The folder records what training reached (`recall.json`): greedy recall on held-out
conversations at the tester's length, which `build_recall_model` requires to be at least `MIN_RECALL`.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from blackbox.vocabulary import CODE_WORDS, FILLER, NAMES
from blackbox.workload import Shape, fact_document, question_for, turn1_messages
from servers.tiny_model import VERSION as PLANTED_VERSION
from servers.tiny_model import build_tiny_model, successor

__all__ = ["ASSET", "MIN_RECALL", "RECALL_VERSION", "Training", "build_recall_model", "main", "recipe", "write_asset"]

RECALL_VERSION = "2"
MIN_RECALL = 0.9
THREADS = 2  # part of the recipe: float sums, and so the bytes, depend on the thread count
# The trained weights of the default recipe, so that a fresh checkout (CI) need not train: they were trained on
# a GPU (Training.device) and are the artifact; `python -m servers.recall_model --out DIR --retrain
# --write-asset` makes them again (on a GPU: minutes; on the 2-core CPU the same recipe would take many hours).
ASSET = Path(__file__).with_name("recall_weights.safetensors")
_PHASES = ("short", "medium", "long")


@dataclass(frozen=True)
class Training:
    """The recipe; changing a default changes the model, so bump RECALL_VERSION with it.

    Three phases, each a fixed shape (sequences padded to `*_tokens`): short documents (half of them with their
    facts repeated: plain induction, where the copy circuit forms), medium ones, then conversations at the
    tester's length (a document, a story like the model's, questions). Every example asks all of its needles
    (6x the signal for the first code word's lookup, the hard one), and the first code word's loss is weighted
    by `first_word_weight`. LR: warm-up, constant until `decay_from` of all steps, then cosine to zero."""

    short_steps: int = 890
    medium_steps: int = 460
    long_steps: int = 510
    short_batch: int = 128
    medium_batch: int = 64
    long_batch: int = 48
    short_tokens: int = 448  # sequences are padded to this many tokens (one shape per phase)
    medium_tokens: int = 1024
    long_tokens: int = 1792
    lr: float = 3e-3
    warmup: int = 50
    decay_from: float = 0.5
    answer_weight: float = 3.0
    first_word_weight: float = 3.0
    kl_weight: float = 2.0
    follow_f: float = 0.85  # stories walk the planted successor this often, as the model's own answers do
    eval_conversations: int = 200
    device: str = "cuda"  # where the weights were trained: GPU float sums differ from the CPU's (not bit-equal)

    @property
    def steps(self) -> int:
        return self.short_steps + self.medium_steps + self.long_steps

    def phase(self, step: int) -> str:
        if step < self.short_steps:
            return "short"
        return "medium" if step < self.short_steps + self.medium_steps else "long"

    def lr_at(self, step: int) -> float:
        warm = min(1.0, (step + 1) / self.warmup)
        start = int(self.decay_from * self.steps)
        if step < start:
            return self.lr * warm
        return self.lr * warm * 0.5 * (1 + math.cos(math.pi * (step - start) / max(1, self.steps - start)))


# per phase: (sentences, longest story in words, all needles asked, share of examples with repeated facts)
_PHASE_DATA: dict[str, tuple[tuple[int, int], int, float]] = {
    "short": ((2, 10), 60, 0.5),
    "medium": ((10, 40), 300, 0.0),
    "long": ((20, 90), 600, 0.0),
}
ALL = (6, 6)  # questions per example: every needle in the document


def build_recall_model(
    cache_dir: Path, seed: int = 0, training: Training | None = None, *, retrain: bool = False
) -> Path:
    """Build (or reuse) `cache_dir/tiny-qwen3next-recall-s{seed}-v{VERSION}.{RECALL_VERSION}` and return it.

    The weights come from `ASSET` when it was trained by this very recipe (same seed, steps, planted model and
    thread count), else from training here (`retrain`: always)."""
    training = training or Training()
    cache_dir = Path(cache_dir)
    target = cache_dir / f"tiny-qwen3next-recall-s{seed}-v{PLANTED_VERSION}.{RECALL_VERSION}"
    if (target / "recall.json").is_file():
        return target
    planted = build_tiny_model(cache_dir, seed)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=cache_dir))
    try:
        report = None if retrain else _from_asset(planted, staging, seed, training)
        report = report or _train(planted, staging, seed, training)
        if report["heldout_recall"] < MIN_RECALL:
            raise RuntimeError(
                f"the recall model reached {report['heldout_recall']:.0%} held-out recall (< {MIN_RECALL:.0%}) "
                f"after {training.steps} steps; see {staging}/recall.json"
            )
        for path in (staging, *staging.iterdir()):
            path.chmod(0o755 if path.is_dir() else 0o644)
        try:
            os.rename(staging, target)
        except OSError:
            if not (target / "recall.json").is_file():
                raise
    finally:
        if staging.exists() and not (staging / "recall.json").is_file():
            shutil.rmtree(staging)
    return target


def recipe(seed: int, training: Training) -> str:
    """What the weights are a function of; `ASSET` holds them only for the recipe it records."""
    fields = {
        "recall_version": RECALL_VERSION,
        "planted_version": PLANTED_VERSION,
        "seed": seed,
        "threads": THREADS,
        "training": asdict(training),
    }
    return json.dumps(fields, sort_keys=True)


def _from_asset(planted: Path, out: Path, seed: int, training: Training) -> dict[str, Any] | None:
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    if not ASSET.is_file():
        return None
    with safe_open(str(ASSET), "pt") as f:
        meta = f.metadata() or {}
    if meta.get("recipe") != recipe(seed, training):
        return None
    tensors = load_file(str(planted / "model.safetensors"))
    tensors.update(load_file(str(ASSET)))
    _copy_tokenizer_and_config(planted, out)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    report: dict[str, Any] = {**json.loads(meta["report"]), "weights_from": ASSET.name}
    (out / "recall.json").write_text(json.dumps(report, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return report


def write_asset(model: Path, seed: int = 0, training: Training | None = None) -> Path:
    """Store the tensors in which the trained `model` differs from the planted one as `ASSET`, with the recipe."""
    from safetensors.torch import load_file, save_file

    training = training or Training()
    planted = load_file(str(build_tiny_model(model.parent, seed) / "model.safetensors"))
    trained = load_file(str(model / "model.safetensors"))
    changed = {k: v.contiguous() for k, v in trained.items() if not v.equal(planted[k])}
    report = json.loads((model / "recall.json").read_text())
    save_file(changed, str(ASSET), metadata={"recipe": recipe(seed, training), "report": json.dumps(report)})
    return ASSET


def _copy_tokenizer_and_config(planted: Path, out: Path) -> None:
    for name in os.listdir(planted):
        if name != "model.safetensors":
            shutil.copy(planted / name, out / name)


class _Data:
    """Training and evaluation conversations in the workload's format, tokenized."""

    def __init__(self, tokenizer: Any, seed: int, follow_f: float) -> None:
        self.tok = tokenizer
        self.f = successor(seed)
        self.follow_f = follow_f
        self.shape = Shape()
        self.words = [tokenizer.convert_ids_to_tokens(i) for i in range(len(tokenizer))]
        self.first_word = min(tokenizer.convert_tokens_to_ids(w) for w in (*CODE_WORDS, *NAMES))

    def ids(self, messages: Sequence[Mapping[str, str]], *, prompt: bool = False) -> list[int]:
        out = self.tok.apply_chat_template(list(messages), tokenize=True, add_generation_prompt=prompt)
        return list(out if isinstance(out, list) else out["input_ids"])

    def story(self, rng: random.Random, n: int) -> str:
        """An answer like the planted model's: it follows the successor most of the time."""
        t = rng.randrange(self.first_word, len(self.words))
        out = []
        for _ in range(n):
            t = int(self.f[t]) if rng.random() < self.follow_f else rng.randrange(5, len(self.words))
            out.append(self.words[t])
        return " ".join(out)

    def example(
        self, rng: random.Random, sentences: tuple[int, int], story: int, questions: tuple[int, int], repeat: bool
    ) -> tuple[list[int], list[int]]:
        """(token ids, answer mask): a document, maybe a story, then questions each followed by its code.

        The mask is 2 at a code's first word (the lookup by name), 1 at its other words, 0 elsewhere."""
        text, needles = fact_document(rng, self.shape, rng.randint(*sentences))
        present = [n for n in needles if f"the code of {n[0]} is" in text]
        if repeat:
            text += " " + " ".join(
                f"{rng.choice(FILLER)} the code of {n} is {c} ." for n, c in rng.sample(present, k=len(present))
            )
        messages = list(turn1_messages(text))
        if rng.random() < 0.85:
            messages.append({"role": "assistant", "content": self.story(rng, rng.randint(0, story))})
        ids = self.ids(messages)
        mask = [0] * len(ids)
        for name, _ in present:  # a repeated fact's code is predictable from its first statement
            pattern = self.tok.encode(f"the code of {name} is", add_special_tokens=False)
            starts = [i for i in range(len(ids) - len(pattern)) if ids[i : i + len(pattern)] == pattern]
            for s in starts[1:]:
                for j in range(self.shape.code_words):
                    mask[s + len(pattern) + j] = 2 if j == 0 else 1
        for name, code in rng.sample(present, k=min(len(present), rng.randint(*questions))):
            q = self.ids([{"role": "user", "content": question_for(name)}], prompt=True)
            a = self.tok.encode(code, add_special_tokens=False)
            ids += q + a
            mask += [0] * len(q) + [2] + [1] * (len(a) - 1)
        return ids, mask


_WORKER: _Data | None = None


def _worker_init(planted: str, seed: int, follow_f: float) -> None:
    global _WORKER
    from transformers import PreTrainedTokenizerFast

    _WORKER = _Data(PreTrainedTokenizerFast.from_pretrained(planted), seed, follow_f)


def _worker_batch(job: tuple[int, int, Training]) -> tuple[Any, Any, Any]:
    step, seed, t = job
    assert _WORKER is not None
    return _step_batch(_WORKER, seed, t, step)


def _step_batch(data: _Data, seed: int, t: Training, step: int) -> tuple[Any, Any, Any]:
    """Step `step`'s batch: a function of (seed, step) alone, so worker processes give the same data."""
    import numpy as np

    phase = t.phase(step)
    sentences, story, repeat = _PHASE_DATA[phase]
    rng = random.Random(f"recall-train:{seed}:{step}")
    size, tokens = getattr(t, f"{phase}_batch"), getattr(t, f"{phase}_tokens")
    ids, answer, valid = _batch(data, rng, size, tokens, sentences, story, ALL, repeat)
    return np.array(ids, dtype=np.int64), np.array(answer, dtype=np.int64), np.array(valid, dtype=np.int64)


def _train(
    planted: Path,
    out: Path,
    seed: int,
    t: Training,
    *,
    workers: int = 0,
    max_seconds: float | None = None,
    probe_every: int = 500,
) -> dict[str, Any]:
    """Train, evaluate and write the model folder to `out`. `workers` processes make the batches (the same
    batches as in-process); `max_seconds` stops training early (the report says so: a safety net, not a recipe)."""
    import multiprocessing

    import torch
    import torch.nn.functional as F
    from safetensors.torch import load_file, save_file
    from transformers import PreTrainedTokenizerFast

    pool = None
    if workers > 0:  # forked before CUDA is touched
        pool = multiprocessing.get_context("fork").Pool(workers, _worker_init, (str(planted), seed, t.follow_f))
    device = torch.device(t.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("recall model: no CUDA device; training on the CPU (much slower)", file=sys.stderr, flush=True)
        device = torch.device("cpu")
    torch.manual_seed(seed)
    torch.set_num_threads(THREADS)
    tok = PreTrainedTokenizerFast.from_pretrained(planted)
    data = _Data(tok, seed, t.follow_f)
    teacher = _load(planted, device).eval()
    student = _load(planted, device)
    rows = torch.zeros(student.config.vocab_size, 1, device=device)
    rows[[tok.convert_tokens_to_ids(w) for w in (*CODE_WORDS, *NAMES)]] = 1.0
    params = []
    for name, p in student.named_parameters():
        p.requires_grad = not name.endswith(("A_log", "dt_bias"))
        if p.requires_grad:
            params.append(p)
    student.lm_head.weight.register_hook(lambda g: g * rows)
    student.model.embed_tokens.weight.register_hook(lambda g: g * rows)
    opt = torch.optim.AdamW(params, lr=t.lr, weight_decay=0.0)
    jobs = ((step, seed, t) for step in range(t.steps))
    batches = pool.imap(_worker_batch, jobs, chunksize=1) if pool else (_step_batch(data, seed, t, s) for s, *_ in jobs)
    started = time.monotonic()
    losses: list[Any] = []
    history: list[dict[str, Any]] = []
    phase_time: dict[str, list[float]] = {p: [] for p in _PHASES}
    stopped_at = None
    last = time.monotonic()
    for step in range(t.steps):
        if max_seconds is not None and time.monotonic() - started > max_seconds:
            stopped_at = step
            print(f"recall model: out of time at step {step}/{t.steps}", file=sys.stderr, flush=True)
            break
        phase = t.phase(step)
        for group in opt.param_groups:
            group["lr"] = t.lr_at(step)
        ids, answer, valid = (torch.from_numpy(x).to(device, non_blocking=True) for x in next(batches))
        with torch.no_grad():
            target_logits = teacher(input_ids=ids).logits[:, :-1]
        logits = student(input_ids=ids).logits[:, :-1]
        answer, valid, labels = answer[:, 1:], valid[:, 1:].float(), ids[:, 1:]
        first = (answer == 2).float()
        weight = first * t.first_word_weight + (answer == 1).float()
        ce = F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1), reduction="none")
        ce = ce.view_as(weight)
        answer_loss = (ce * weight).sum() / weight.sum().clamp(min=1)
        rest = valid * (answer == 0).float()
        kl = (F.softmax(target_logits, -1) * (F.log_softmax(target_logits, -1) - F.log_softmax(logits, -1))).sum(-1)
        kl_loss = (kl * rest).sum() / rest.sum()
        loss = t.answer_weight * answer_loss + t.kl_weight * kl_loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        losses.append(answer_loss.detach())
        losses = losses[-20:]
        if step % 100 == 0 or step == t.steps - 1:
            first_loss = (ce * first).sum() / first.sum().clamp(min=1)
            print(
                f"recall model: step {step}/{t.steps} {phase} lr {t.lr_at(step):.2e} answer loss "
                f"{answer_loss.item():.3f} first word {first_loss.item():.3f} kl {kl_loss.item():.4f} "
                f"({time.monotonic() - started:.0f} s)",
                file=sys.stderr,
                flush=True,
            )
        now = time.monotonic()
        phase_time[phase].append(now - last)
        last = now
        if probe_every and step > 0 and (step % probe_every == 0 or step + 1 == t.steps or t.phase(step + 1) != phase):
            probe = _evaluate(student.eval(), data, seed, 32, "probe")
            student.train()
            history.append({"step": step, **probe})
            print(f"recall model: step {step} probe {probe}", file=sys.stderr, flush=True)
            last = time.monotonic()
    if pool:
        pool.terminate()
    trained_s = time.monotonic() - started
    # what ships is the planted checkpoint's layout and dtypes: evaluate exactly the saved file
    tensors = _checkpoint_tensors(student.state_dict(), load_file(str(planted / "model.safetensors")))
    _copy_tokenizer_and_config(planted, out)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    del student, teacher, opt
    saved = _load(out, device).eval()
    final = _evaluate(saved, data, seed, t.eval_conversations, "eval")
    rng = random.Random(f"recall-stories:{seed}")
    final["story_follows_f"] = _story_follows(saved, data, random.Random(rng.random()), 8)
    planted_model = _load(planted, device).eval()
    final["planted_story_follows_f"] = _story_follows(planted_model, data, random.Random(rng.random()), 8)
    report = {
        "seed": seed,
        "planted": planted.name,
        "training": asdict(t),
        "threads": THREADS,
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "train_seconds": round(trained_s, 1),
        "seconds_per_step": {p: round(sum(v[2:]) / len(v[2:]), 4) for p, v in phase_time.items() if len(v) > 2},
        "stopped_at_step": stopped_at,
        "final_answer_loss": round(float(sum(losses) / len(losses)), 4),
        "heldout_recall": final["long_recall"],
        "heldout": final,
        "probes": history,
    }
    (out / "recall.json").write_text(json.dumps(report, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return report


def _checkpoint_tensors(state: Mapping[str, Any], planted: dict[str, Any]) -> dict[str, Any]:
    """`planted` (the checkpoint's tensors) with the trained `state` written into it, in the checkpoint's names,
    layouts and dtypes. transformers fuses the routed experts (`experts.gate_up_proj` = gate and up stacked,
    `experts.down_proj`) where the checkpoint holds one tensor per expert; the MTP layer is not in the model and
    stays the planted one."""
    out = dict(planted)

    def put(name: str, value: Any) -> None:
        out[name] = value.detach().to(planted[name].dtype).cpu().contiguous()

    for name, value in state.items():
        if name in planted:
            put(name, value)
        elif name.endswith(".experts.gate_up_proj"):
            for e in range(value.shape[0]):
                gate, up = value[e].chunk(2, 0)
                put(f"{name[: -len('gate_up_proj')]}{e}.gate_proj.weight", gate)
                put(f"{name[: -len('gate_up_proj')]}{e}.up_proj.weight", up)
        elif name.endswith(".experts.down_proj"):
            for e in range(value.shape[0]):
                put(f"{name[: -len('down_proj')]}{e}.down_proj.weight", value[e])
        else:
            raise KeyError(f"{name}: no tensor of that name in the planted checkpoint")
    return out


def _load(folder: Path, device: Any) -> Any:
    """A float32 copy of the checkpoint in `folder` on `device`."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to(device)


def _batch(
    data: _Data,
    rng: random.Random,
    size: int,
    tokens: int,
    sentences: tuple[int, int],
    story: int,
    questions: tuple[int, int],
    repeat: float,
) -> tuple[list[list[int]], list[list[int]], list[list[int]]]:
    """`size` examples padded to `tokens` (longer ones are drawn again); `repeat`: the share with facts repeated."""
    ids: list[list[int]] = []
    answer: list[list[int]] = []
    valid: list[list[int]] = []
    while len(ids) < size:
        i, m = data.example(rng, sentences, story, questions, rng.random() < repeat)
        if len(i) > tokens:
            continue
        pad = tokens - len(i)
        ids.append(i + [0] * pad)
        answer.append(m + [0] * pad)
        valid.append([1] * len(i) + [0] * pad)
    return ids, answer, valid


def _evaluate(model: Any, data: _Data, seed: int, n: int, stream: str) -> dict[str, float]:
    """Greedy recall (all code words) and first-word accuracy, at the tester's length and on short documents."""
    out: dict[str, float] = {}
    for kind, sentences, story in (("long", (60, 90), 464), ("short", (2, 10), 60)):
        rng = random.Random(f"recall-{stream}:{seed}" if kind == "long" else f"recall-{stream}-short:{seed}")
        right, first = _recall_stats(model, data, rng, n, sentences, story)
        out[f"{kind}_recall"], out[f"{kind}_first_word"] = right, first
    return out


def _story_follows(model: Any, data: _Data, rng: random.Random, n: int, tokens: int = 120) -> float:
    """How often greedy turn-1 stories (after a document at the tester's length) step to the planted successor:
    the planted model leaves it at some positions (context-dependent), the drafter proposes it."""
    import torch

    device = next(model.parameters()).device
    follows = total = 0
    with torch.no_grad():
        for _ in range(n):
            text, _ = fact_document(rng, data.shape, rng.randint(60, 90))
            ids = torch.tensor([data.ids(turn1_messages(text), prompt=True)], device=device)
            out = model.generate(ids, max_new_tokens=tokens, do_sample=False)[0, ids.shape[1] :].tolist()
            follows += sum(int(data.f[a]) == b for a, b in itertools.pairwise(out))
            total += len(out) - 1
    return round(follows / max(1, total), 4)


def _recall_stats(
    model: Any, data: _Data, rng: random.Random, n: int, sentences: tuple[int, int], story: int
) -> tuple[float, float]:
    """(all code words right, first code word right) over `n` conversations: document, story, one question."""
    import torch

    device = next(model.parameters()).device
    right = first = 0
    with torch.no_grad():
        for _ in range(n):
            text, needles = fact_document(rng, data.shape, rng.randint(*sentences))
            present = [x for x in needles if f"the code of {x[0]} is" in text]
            name, code = rng.choice(present)
            messages = [
                *turn1_messages(text),
                {"role": "assistant", "content": data.story(rng, story)},
                {"role": "user", "content": question_for(name)},
            ]
            ids = data.ids(messages, prompt=True)
            want = data.tok.encode(code, add_special_tokens=False)
            for _ in want:
                ids.append(int(model(input_ids=torch.tensor([ids], device=device)).logits[0, -1].argmax()))
            right += ids[-len(want) :] == want
            first += ids[-len(want)] == want[0]
    return right / n, first / n


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m servers.recall_model", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="cache folder; the model is built inside it")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--retrain", action="store_true", help=f"train even if {ASSET.name} holds this recipe")
    parser.add_argument("--write-asset", action="store_true", help=f"store the trained weights as {ASSET.name}")
    parser.add_argument(
        "--train-to", type=Path, help="train into this folder only (no threshold, no asset): what a GPU run does"
    )
    parser.add_argument("--training", default="{}", help="JSON: Training fields to change (with --train-to)")
    parser.add_argument("--workers", type=int, default=0, help="processes that make the batches (with --train-to)")
    parser.add_argument("--max-seconds", type=float, help="stop training after this long (with --train-to)")
    args = parser.parse_args(argv)
    if args.train_to:
        training = Training(**{**asdict(Training()), **json.loads(args.training)})
        args.train_to.mkdir(parents=True, exist_ok=True)
        planted = build_tiny_model(args.out, args.seed)
        report = _train(planted, args.train_to, args.seed, training, workers=args.workers, max_seconds=args.max_seconds)
        print(json.dumps({k: v for k, v in report.items() if k != "probes"}, sort_keys=True))
        return 0
    model = build_recall_model(args.out, args.seed, retrain=args.retrain)
    print(model)
    if args.write_asset:
        print(write_asset(model, args.seed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
