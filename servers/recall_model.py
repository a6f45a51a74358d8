"""The tiny hybrid, trained to recall the needles of blackbox's own documents.

The planted model (servers/tiny_model.py) recalls 0%: nothing in it looks a name up. The recall grader, and the
single-endpoint mode whose only grader on a server without a reference is recall, need a model that answers
"what is the code of X ?" from its context near-perfectly without a cache, so that a wrong restored state shows
as lost recall, as it does on real models. This trains the planted model on the workload's own documents and
questions (`blackbox.workload`) on the CPU and caches the result like the model build:

- what carries the planted behaviour elsewhere stays: the GDN decays (`A_log`, `dt_bias`) are frozen, the MTP
  layer is the planted one, and of the embedding and `lm_head` only the rows of names and code words move;
- a distillation term (KL to the planted model at every position that is not an answer) keeps the stories the
  treatment writes in turn 1, and so the drafter's acceptance, close to the planted model's;
- a curriculum: short documents, half of them with their facts repeated (plain induction: the copy circuit
  forms there), then conversations at the tester's length (a document, a story like the model's, questions).

Seeded data, seeded initialisation and a fixed thread count: the same seed on the same torch build gives the same
bytes. The folder records what training reached (`recall.json`): greedy recall on held-out conversations at the
tester's length, which `build_recall_model` requires to be at least `MIN_RECALL`.
"""

from __future__ import annotations

import argparse
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

RECALL_VERSION = "1"
MIN_RECALL = 0.9
THREADS = 2  # part of the recipe: float sums, and so the bytes, depend on the thread count
# The trained weights of the default recipe, so that a fresh checkout (CI) need not spend the training's half
# hour: `python -m servers.recall_model --out DIR --retrain --write-asset` makes it again.
ASSET = Path(__file__).with_name("recall_weights.safetensors")


@dataclass(frozen=True)
class Training:
    """The recipe; changing a default changes the model, so bump RECALL_VERSION with it."""

    short_steps: int = 1500
    long_steps: int = 400
    short_batch: int = 16
    long_batch: int = 6
    short_tokens: int = 320  # sequences are padded to this many tokens (one shape: no allocator churn)
    long_tokens: int = 1152
    lr: float = 4e-3
    warmup: int = 30
    answer_weight: float = 3.0
    follow_f: float = 0.85  # stories walk the planted successor this often, as the model's own answers do
    eval_conversations: int = 64


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
                f"after {training.short_steps + training.long_steps} steps; see {staging}/recall.json"
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
        """(token ids, answer mask): a document, maybe a story, then questions each followed by its code."""
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
                    mask[s + len(pattern) + j] = 1
        for name, code in rng.sample(present, k=min(len(present), rng.randint(*questions))):
            q = self.ids([{"role": "user", "content": question_for(name)}], prompt=True)
            a = self.tok.encode(code, add_special_tokens=False)
            ids += q + a
            mask += [0] * len(q) + [1] * len(a)
        return ids, mask


def _train(planted: Path, out: Path, seed: int, t: Training) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(seed)
    torch.set_num_threads(THREADS)
    tok = PreTrainedTokenizerFast.from_pretrained(planted)
    data = _Data(tok, seed, t.follow_f)
    teacher = AutoModelForCausalLM.from_pretrained(planted, dtype=torch.float32).eval()
    student = AutoModelForCausalLM.from_pretrained(planted, dtype=torch.float32)
    rows = torch.zeros(student.config.vocab_size, 1)
    rows[[tok.convert_tokens_to_ids(w) for w in (*CODE_WORDS, *NAMES)]] = 1.0
    params = []
    for name, p in student.named_parameters():
        p.requires_grad = not name.endswith(("A_log", "dt_bias"))
        if p.requires_grad:
            params.append(p)
    student.lm_head.weight.register_hook(lambda g: g * rows)
    student.model.embed_tokens.weight.register_hook(lambda g: g * rows)
    opt = torch.optim.AdamW(params, lr=t.lr, weight_decay=0.0)
    rng = random.Random(f"recall-train:{seed}")
    steps = t.short_steps + t.long_steps
    started = time.monotonic()
    losses: list[float] = []
    for step in range(steps):
        short = step < t.short_steps
        for group in opt.param_groups:
            group["lr"] = t.lr * min(1.0, (step + 1) / t.warmup) * 0.5 * (1 + math.cos(math.pi * step / steps))
        if short:
            batch = _batch(data, rng, t.short_batch, t.short_tokens, (2, 10), 60, (2, 5), rng.random() < 0.5)
        else:
            batch = _batch(data, rng, t.long_batch, t.long_tokens, (20, 90), 600, (1, 4), False)
        ids, answer, valid = (torch.tensor(x) for x in batch)
        with torch.no_grad():
            target_logits = teacher(input_ids=ids).logits[:, :-1]
        logits = student(input_ids=ids).logits[:, :-1]
        answer, valid, labels = answer[:, 1:].float(), valid[:, 1:].float(), ids[:, 1:]
        ce = F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1), reduction="none")
        answer_loss = (ce.view_as(answer) * answer).sum() / answer.sum().clamp(min=1)
        rest = valid * (1 - answer)
        kl = (F.softmax(target_logits, -1) * (F.log_softmax(target_logits, -1) - F.log_softmax(logits, -1))).sum(-1)
        loss = t.answer_weight * answer_loss + (kl * rest).sum() / rest.sum()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        losses.append(float(answer_loss.detach()))
        if step % 100 == 0 or step == steps - 1:
            print(
                f"recall model: step {step}/{steps} answer loss {answer_loss.item():.3f}", file=sys.stderr, flush=True
            )
    trained_s = time.monotonic() - started
    recall = _heldout_recall(student.eval(), data, random.Random(f"recall-eval:{seed}"), t.eval_conversations)
    tensors = load_file(str(planted / "model.safetensors"))
    for name, value in student.state_dict().items():
        if name in tensors:
            tensors[name] = value.detach().to(tensors[name].dtype).contiguous()
    _copy_tokenizer_and_config(planted, out)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    report = {
        "seed": seed,
        "planted": planted.name,
        "training": asdict(t),
        "threads": THREADS,
        "torch": torch.__version__,
        "train_seconds": round(trained_s, 1),
        "final_answer_loss": round(sum(losses[-20:]) / len(losses[-20:]), 4),
        "heldout_recall": recall,
    }
    (out / "recall.json").write_text(json.dumps(report, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return report


def _batch(
    data: _Data,
    rng: random.Random,
    size: int,
    tokens: int,
    sentences: tuple[int, int],
    story: int,
    questions: tuple[int, int],
    repeat: bool,
) -> tuple[list[list[int]], list[list[int]], list[list[int]]]:
    ids: list[list[int]] = []
    answer: list[list[int]] = []
    valid: list[list[int]] = []
    while len(ids) < size:
        i, m = data.example(rng, sentences, story, questions, repeat)
        if len(i) > tokens:
            continue
        pad = tokens - len(i)
        ids.append(i + [0] * pad)
        answer.append(m + [0] * pad)
        valid.append([1] * len(i) + [0] * pad)
    return ids, answer, valid


def _heldout_recall(model: Any, data: _Data, rng: random.Random, n: int) -> float:
    """Greedy answers to one question after a document and a story at the tester's length (turn 2 of a
    conversation, computed cold): the fraction whose first tokens are the code."""
    import torch

    right = 0
    with torch.no_grad():
        for _ in range(n):
            text, needles = fact_document(rng, data.shape, rng.randint(60, 90))
            present = [x for x in needles if f"the code of {x[0]} is" in text]
            name, code = rng.choice(present)
            messages = [
                *turn1_messages(text),
                {"role": "assistant", "content": data.story(rng, 464)},
                {"role": "user", "content": question_for(name)},
            ]
            ids = data.ids(messages, prompt=True)
            want = data.tok.encode(code, add_special_tokens=False)
            for _ in want:
                ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
            right += ids[-len(want) :] == want
    return right / n


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m servers.recall_model", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="cache folder; the model is built inside it")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--retrain", action="store_true", help=f"train even if {ASSET.name} holds this recipe")
    parser.add_argument("--write-asset", action="store_true", help=f"store the trained weights as {ASSET.name}")
    args = parser.parse_args(argv)
    model = build_recall_model(args.out, args.seed, retrain=args.retrain)
    print(model)
    if args.write_asset:
        print(write_asset(model, args.seed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
