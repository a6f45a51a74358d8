"""A tiny hybrid Qwen3-Next checkpoint with one MTP layer, built deterministically from a seed.

The model is random but planted, so that it behaves like a language model where it matters to the tester:

- a random permutation `f` over the words is planted in the embeddings and `lm_head`, so the residual stream
  predicts next = f(current) and the MTP head (wired to propose f(next)) is accepted most of the time;
- the token mixers (two Gated DeltaNet layers, two attention layers) add a context-dependent push that moves
  the argmax off `f` at some positions, so outputs depend on the recurrent state and the KV cache;
- every GDN head forgets slowly (per-token decay 0.97-0.99), so a wrongly restored recurrent state changes
  later tokens instead of being washed out within a few tokens.

Tensor names and layouts are those of real Qwen3-Next checkpoints, so vLLM and transformers load the folder
as they would a hub model. Same seed, same bytes.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import math
import os
import shutil
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from blackbox.vocabulary import WORDS as BLACKBOX_WORDS

__all__ = [
    "GPU_GEOMETRY",
    "SPECIAL_TOKENS",
    "VARIANTS",
    "VERSION",
    "WORDS",
    "GdnGeometry",
    "build_tiny_model",
    "main",
    "successor",
]

VERSION = "2"

SPECIAL_TOKENS: tuple[str, ...] = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>", "<pad>")

VOCAB_SIZE = 4096
HIDDEN = 128
LAYER_TYPES = ("linear_attention", "full_attention", "linear_attention", "full_attention")
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 4, 2, 64
LINEAR_K_HEADS, LINEAR_V_HEADS, LINEAR_HEAD_DIM = 2, 2, 64
CONV_KERNEL = 4
NUM_EXPERTS, TOP_K, EXPERT_DIM, SHARED_EXPERT_DIM = 4, 2, 64, 64
MAX_POSITIONS = 8192

# Per-token decay of each GDN value head at a = 0, by GDN layer; a is kept near 0 (see _gdn_layer).
GDN_DECAYS = ((0.97, 0.985), (0.98, 0.99))


@dataclass(frozen=True)
class GdnGeometry:
    """The Gated DeltaNet shapes, which set the recurrent state size and so vLLM's hybrid block size."""

    k_heads: int
    v_heads: int
    head_dim: int

    @property
    def v_per_k(self) -> int:
        return self.v_heads // self.k_heads

    def decays(self, layer: int) -> tuple[float, ...]:
        """Per-value-head decays of GDN layer `layer`, spread evenly over the layer's planted range."""
        low, high = GDN_DECAYS[layer]
        if self.v_heads == len(GDN_DECAYS[layer]):
            return GDN_DECAYS[layer]
        return tuple(float(d) for d in np.linspace(low, high, self.v_heads))


CPU_GEOMETRY = GdnGeometry(LINEAR_K_HEADS, LINEAR_V_HEADS, LINEAR_HEAD_DIM)
# vLLM 0.26's CUDA path for Qwen3-Next (fix_query_key_value_ordering) reshapes the interleaved b/a projection
# into a view whose last stride is v_heads/k_heads: with equal head counts the decode kernel rejects it
# ("a/b must be contiguous in the last dim"). Real checkpoints have twice as many value heads as key heads,
# and so does this variant; head_dim 128 (as in real models) makes the state 16x larger than the CPU
# model's, so the hybrid block size is in the hundreds like a real model's instead of 48.
GPU_GEOMETRY = GdnGeometry(k_heads=2, v_heads=4, head_dim=128)
VARIANTS: dict[str, GdnGeometry] = {"cpu": CPU_GEOMETRY, "gpu": GPU_GEOMETRY}
GDN_DT_BIAS = -3.0
# Output RMS of each mixer, relative to the embedding's RMS of 1. Measured with the transformers reference in
# fp32 over seeds 0-2: greedy outputs follow f at 82-89% of positions, no loops over 800 tokens; served by vLLM
# (seed 0, 2 MTP tokens) acceptance was 0.85 and 0.71 per position. Below ~1.2 the model just walks f (outputs
# blind to state); above ~2 f is followed at half the positions.
GDN_PUSH = 1.5
ATTN_PUSH = 1.25
MLP_PUSH = 0.1
MTP_PUSH = 0.05
# Gemma-style norm weights (scale 1 + w) on q/k: sharper attention, so it picks a few past tokens.
QK_NORM_WEIGHT = 0.8
# Chat-template tokens get weak embeddings, so the first answer token is not always f("assistant").
TEMPLATE_EMBED_SCALE = 0.25
# Sharpens the next-token distribution (top-1 probability ~0.65 on average), so near-ties are rare.
LOGIT_SCALE = 3.0

_ROLE_WORDS = ("system", "user", "assistant", "tool")
_FUNCTION_WORDS = (
    "the a an of to in on at by for with from and or not no yes is are was were be been has have had "
    "this that these those it its what which who where when how why code codes key keys value values fact "
    "facts name names number numbers record records item items document section part note notes remember "
    "recall answer question ask tell says said equals means called known stored listed given first second "
    "third last next previous before after same other each every all some none true false table row column "
    "list entry entries id label tag city river star ship color unit level zone gate room door"
).split()
_CODE_LETTERS = "abcdefghjkmnpqrstvwxyz"
_SYLLABLE_ONSETS = "bdfgklmnprstvz"
_SYLLABLE_VOWELS = "aeiou"


def _word_list() -> tuple[str, ...]:
    """Roles, function words, numbers 0-99, codes like `k07`, then two-syllable pseudo-words to fill the vocab."""
    # blackbox's own document vocabulary first, so the tester's prompts contain no unknown words.
    fixed = list(dict.fromkeys([*_ROLE_WORDS, *BLACKBOX_WORDS, *_FUNCTION_WORDS, *(str(n) for n in range(100))]))
    fixed += [f"{letter}{n:02d}" for letter in _CODE_LETTERS for n in range(25)]
    syllables = [c + v for c, v in itertools.product(_SYLLABLE_ONSETS, _SYLLABLE_VOWELS)]
    pseudo = [a + b for a, b in itertools.product(syllables, repeat=2)]
    # A fixed shuffle (independent of the model seed) so the fill is not all "ba..." words.
    order = np.random.default_rng(20261129).permutation(len(pseudo))
    seen = set(fixed)
    words = list(fixed)
    for i in order:
        if len(words) == VOCAB_SIZE - len(SPECIAL_TOKENS):
            break
        if pseudo[i] not in seen:
            seen.add(pseudo[i])
            words.append(pseudo[i])
    return tuple(words)


WORDS: tuple[str, ...] = _word_list()
_FIRST_WORD_ID = len(SPECIAL_TOKENS)

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def successor(seed: int) -> np.ndarray:
    """The planted permutation f as token id -> token id (identity on special tokens): one cycle over all words."""
    rng = np.random.default_rng([seed, 1])
    cycle = rng.permutation(len(WORDS)) + _FIRST_WORD_ID
    f = np.arange(VOCAB_SIZE)
    f[cycle] = np.roll(cycle, -1)
    return f


def tiny_model_path(cache_dir: Path, seed: int = 0, variant: str = "cpu") -> Path:
    """Where `build_tiny_model` puts this model, built or not (an image that builds it names the same path)."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown tiny-model variant {variant!r}: use one of {', '.join(VARIANTS)}")
    infix = "" if variant == "cpu" else f"{variant}-"
    return Path(cache_dir) / f"tiny-qwen3next-{infix}s{seed}-v{VERSION}"


def build_tiny_model(cache_dir: Path, seed: int = 0, variant: str = "cpu") -> Path:
    """Build (or reuse) the model folder `cache_dir/tiny-qwen3next-s{seed}-v{VERSION}` and return its path.

    `variant` "gpu" builds `tiny-qwen3next-gpu-s{seed}-v{VERSION}` with GPU_GEOMETRY; "cpu" is the default model.
    """
    target = tiny_model_path(cache_dir, seed, variant)
    geometry = VARIANTS[variant]
    if _is_complete(target):
        return target
    cache_dir = target.parent
    cache_dir.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=cache_dir))
    try:
        _write_model(staging, seed, geometry)
        for path in (staging, *staging.iterdir()):
            path.chmod(0o755 if path.is_dir() else 0o644)
        try:
            os.rename(staging, target)
        except OSError:
            if not _is_complete(target):
                raise
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    return target


_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "special_tokens_map.json",
    "tokenizer.json",
    "tokenizer_config.json",
)


def _is_complete(folder: Path) -> bool:
    return all((folder / name).is_file() for name in _FILES)


def _write_model(folder: Path, seed: int, geometry: GdnGeometry) -> None:
    from safetensors.torch import save_file

    _write_json(folder / "config.json", _config(geometry))
    _write_json(folder / "generation_config.json", _generation_config())
    _write_json(folder / "special_tokens_map.json", _special_tokens_map())
    _write_json(folder / "tokenizer_config.json", _tokenizer_config())
    _write_json(folder / "tokenizer.json", json.loads(_tokenizer().to_str()))
    save_file(_tensors(seed, geometry), str(folder / "model.safetensors"), metadata={"format": "pt"})


def _write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


def _token_id(token: str) -> int:
    return SPECIAL_TOKENS.index(token)


def _config(geometry: GdnGeometry = CPU_GEOMETRY) -> dict[str, Any]:
    return {
        "architectures": ["Qwen3NextForCausalLM"],
        "model_type": "qwen3_next",
        "vocab_size": VOCAB_SIZE,
        "hidden_size": HIDDEN,
        "intermediate_size": 4 * EXPERT_DIM,
        "num_hidden_layers": len(LAYER_TYPES),
        "layer_types": list(LAYER_TYPES),
        "full_attention_interval": 2,
        "num_attention_heads": NUM_HEADS,
        "num_key_value_heads": NUM_KV_HEADS,
        "head_dim": HEAD_DIM,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "partial_rotary_factor": 0.25,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "max_position_embeddings": MAX_POSITIONS,
        "linear_conv_kernel_dim": CONV_KERNEL,
        "linear_key_head_dim": geometry.head_dim,
        "linear_value_head_dim": geometry.head_dim,
        "linear_num_key_heads": geometry.k_heads,
        "linear_num_value_heads": geometry.v_heads,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "num_experts": NUM_EXPERTS,
        "num_experts_per_tok": TOP_K,
        "moe_intermediate_size": EXPERT_DIM,
        "shared_expert_intermediate_size": SHARED_EXPERT_DIM,
        "norm_topk_prob": True,
        "output_router_logits": False,
        "router_aux_loss_coef": 0.001,
        "num_nextn_predict_layers": 1,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "initializer_range": 0.02,
        "tie_word_embeddings": False,
        "use_cache": True,
        "torch_dtype": "bfloat16",
        "bos_token_id": _token_id("<|endoftext|>"),
        "eos_token_id": _token_id("<|im_end|>"),
        "pad_token_id": _token_id("<|endoftext|>"),
    }


def _generation_config() -> dict[str, Any]:
    return {
        "bos_token_id": _token_id("<|endoftext|>"),
        "eos_token_id": [_token_id("<|im_end|>"), _token_id("<|endoftext|>")],
        "pad_token_id": _token_id("<|endoftext|>"),
    }


def _special_tokens_map() -> dict[str, Any]:
    return {
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "eos_token": "<|im_end|>",
        "pad_token": "<pad>",
        "unk_token": "<unk>",
    }


def _tokenizer_config() -> dict[str, Any]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": CHAT_TEMPLATE,
        "added_tokens_decoder": {
            str(i): {
                "content": token,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
            for i, token in enumerate(SPECIAL_TOKENS)
        },
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<pad>",
        "unk_token": "<unk>",
        "clean_up_tokenization_spaces": False,
        "model_max_length": MAX_POSITIONS,
        "split_special_tokens": False,
    }


def _tokenizer() -> Any:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {token: i for i, token in enumerate((*SPECIAL_TOKENS, *WORDS))}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    # Joins tokens with single spaces (no word starts with "##"), so decode then encode is the identity.
    tokenizer.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    return tokenizer


class _Init:
    """Seeded float32 initialisers; every tensor draws from its own stream, keyed by its name."""

    def __init__(self, seed: int) -> None:
        self.seed = seed

    def rng(self, name: str) -> np.random.Generator:
        key = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little")
        return np.random.default_rng([self.seed, key])

    def normal(self, name: str, shape: Sequence[int], std: float) -> np.ndarray:
        return (self.rng(name).standard_normal(tuple(shape)) * std).astype(np.float32)

    def linear(self, name: str, out_dim: int, in_dim: int, out_rms: float, in_rms: float = 1.0) -> np.ndarray:
        """Weights whose outputs have RMS `out_rms` for inputs of RMS `in_rms`."""
        return self.normal(name, (out_dim, in_dim), out_rms / (in_rms * math.sqrt(in_dim)))


def _tensors(seed: int, geometry: GdnGeometry = CPU_GEOMETRY) -> dict[str, Any]:
    import torch

    init = _Init(seed)
    arrays: dict[str, np.ndarray] = {}
    embed = init.normal("model.embed_tokens.weight", (VOCAB_SIZE, HIDDEN), 1.0)
    template_ids = [*range(_FIRST_WORD_ID), *(_FIRST_WORD_ID + WORDS.index(w) for w in _ROLE_WORDS)]
    embed[template_ids] *= TEMPLATE_EMBED_SCALE
    arrays["model.embed_tokens.weight"] = embed
    arrays["lm_head.weight"] = _lm_head(embed, seed)
    arrays["model.norm.weight"] = np.zeros(HIDDEN, np.float32)
    gdn_index = 0
    for i, layer_type in enumerate(LAYER_TYPES):
        prefix = f"model.layers.{i}"
        arrays.update(_norms(prefix))
        if layer_type == "linear_attention":
            arrays.update(_gdn_layer(init, f"{prefix}.linear_attn", geometry.decays(gdn_index), geometry))
            gdn_index += 1
        else:
            arrays.update(_attention_layer(init, f"{prefix}.self_attn", ATTN_PUSH))
        arrays.update(_moe(init, f"{prefix}.mlp", MLP_PUSH))
    arrays.update(_mtp(init))
    tensors = {}
    for name in sorted(arrays):
        # A_log stays fp32 (as vLLM keeps it) so the planted decays are exact.
        dtype = torch.float32 if name.endswith("A_log") else torch.bfloat16
        tensors[name] = torch.from_numpy(np.ascontiguousarray(arrays[name])).to(dtype).contiguous()
    return tensors


def _lm_head(embed: np.ndarray, seed: int) -> np.ndarray:
    """Row f(x) is x's embedding direction: a hidden state near embed[x] predicts f(x)."""
    f = successor(seed)
    head = np.zeros_like(embed)
    words = np.arange(_FIRST_WORD_ID, VOCAB_SIZE)
    unit = embed[words] / np.linalg.norm(embed[words], axis=1, keepdims=True)
    head[f[words]] = unit * LOGIT_SCALE
    return head


def _norms(prefix: str) -> dict[str, np.ndarray]:
    # Qwen3-Next RMSNorm scales by (1 + weight): zeros are the identity.
    return {
        f"{prefix}.input_layernorm.weight": np.zeros(HIDDEN, np.float32),
        f"{prefix}.post_attention_layernorm.weight": np.zeros(HIDDEN, np.float32),
    }


def _gdn_layer(
    init: _Init, prefix: str, decays: Sequence[float], geometry: GdnGeometry = CPU_GEOMETRY
) -> dict[str, np.ndarray]:
    hd, v_heads = geometry.head_dim, geometry.v_heads
    key_dim = geometry.k_heads * hd
    v_per_k = geometry.v_per_k
    q = init.linear(f"{prefix}.q", key_dim, HIDDEN, 1.0)
    k = init.linear(f"{prefix}.k", key_dim, HIDDEN, 1.0)
    v = init.linear(f"{prefix}.v", v_heads * hd, HIDDEN, 1.0)
    z = init.linear(f"{prefix}.z", v_heads * hd, HIDDEN, 1.0)
    b = init.linear(f"{prefix}.b", v_heads, HIDDEN, 1.0)
    # Tiny `a` rows keep softplus(a + dt_bias) near softplus(dt_bias) for any input, so the decay stays planted.
    a = init.linear(f"{prefix}.a", v_heads, HIDDEN, 0.02)
    # Checkpoint layout (gqa interleaved): per key-head group g, rows [q_g, k_g, v_g, z_g] and [b_g, a_g].
    qkvz, ba = [], []
    for g in range(geometry.k_heads):
        vs = slice(g * v_per_k * hd, (g + 1) * v_per_k * hd)
        qkvz += [q[g * hd : (g + 1) * hd], k[g * hd : (g + 1) * hd], v[vs], z[vs]]
        ba += [b[g * v_per_k : (g + 1) * v_per_k], a[g * v_per_k : (g + 1) * v_per_k]]
    conv_dim = 2 * key_dim + v_heads * hd
    conv = init.normal(f"{prefix}.conv1d", (conv_dim, 1, CONV_KERNEL), 0.3)
    conv[:, 0, -1] += 1.0  # mostly the current token, blurred by the previous three
    softplus_dt = math.log1p(math.exp(GDN_DT_BIAS))
    a_log = [math.log(-math.log(d) / softplus_dt) for d in decays]
    # The gated RMSNorm output has RMS ~ rms(silu(z)) ~ 0.6 for z ~ N(0, 1).
    out = init.linear(f"{prefix}.out_proj", HIDDEN, v_heads * hd, GDN_PUSH, in_rms=0.6)
    return {
        f"{prefix}.in_proj_qkvz.weight": np.concatenate(qkvz),
        f"{prefix}.in_proj_ba.weight": np.concatenate(ba),
        f"{prefix}.conv1d.weight": conv,
        f"{prefix}.dt_bias": np.full(v_heads, GDN_DT_BIAS, np.float32),
        f"{prefix}.A_log": np.asarray(a_log, np.float32),
        f"{prefix}.norm.weight": np.ones(hd, np.float32),
        f"{prefix}.out_proj.weight": out,
    }


def _attention_layer(init: _Init, prefix: str, push: float) -> dict[str, np.ndarray]:
    hd = HEAD_DIM
    q = init.linear(f"{prefix}.q", NUM_HEADS * hd, HIDDEN, 1.0)
    gate = init.linear(f"{prefix}.gate", NUM_HEADS * hd, HIDDEN, 1.0)
    # q_proj holds [q_h, gate_h] per head.
    q_gate = np.concatenate(
        [x for h in range(NUM_HEADS) for x in (q[h * hd : (h + 1) * hd], gate[h * hd : (h + 1) * hd])]
    )
    # in_rms: the values, averaged over a few tokens and gated by sigmoid(gate) ~ 0.5, have RMS ~ 0.5.
    return {
        f"{prefix}.q_proj.weight": q_gate,
        f"{prefix}.k_proj.weight": init.linear(f"{prefix}.k_proj", NUM_KV_HEADS * hd, HIDDEN, 1.0),
        f"{prefix}.v_proj.weight": init.linear(f"{prefix}.v_proj", NUM_KV_HEADS * hd, HIDDEN, 1.0),
        f"{prefix}.o_proj.weight": init.linear(f"{prefix}.o_proj", HIDDEN, NUM_HEADS * hd, push, in_rms=0.5),
        f"{prefix}.q_norm.weight": np.full(hd, QK_NORM_WEIGHT, np.float32),
        f"{prefix}.k_norm.weight": np.full(hd, QK_NORM_WEIGHT, np.float32),
    }


def _moe(init: _Init, prefix: str, push: float) -> dict[str, np.ndarray]:
    arrays = {f"{prefix}.gate.weight": init.linear(f"{prefix}.gate", NUM_EXPERTS, HIDDEN, 1.0)}
    experts = [(f"{prefix}.experts.{e}", EXPERT_DIM) for e in range(NUM_EXPERTS)]
    for name, dim in [*experts, (f"{prefix}.shared_expert", SHARED_EXPERT_DIM)]:
        arrays[f"{name}.gate_proj.weight"] = init.linear(f"{name}.gate_proj", dim, HIDDEN, 1.0)
        arrays[f"{name}.up_proj.weight"] = init.linear(f"{name}.up_proj", dim, HIDDEN, 1.0)
        # silu(g) * u has RMS ~ 0.5 for g, u ~ N(0, 1).
        arrays[f"{name}.down_proj.weight"] = init.linear(f"{name}.down_proj", HIDDEN, dim, push, in_rms=0.5)
    arrays[f"{prefix}.shared_expert_gate.weight"] = init.linear(f"{prefix}.shared_expert_gate", 1, HIDDEN, 1.0)
    return arrays


def _mtp(init: _Init) -> dict[str, np.ndarray]:
    """One MTP layer that proposes f(next): fc passes the next token's embedding through, mixers stay quiet."""
    fc = np.zeros((HIDDEN, 2 * HIDDEN), np.float32)
    fc[:, :HIDDEN] = np.eye(HIDDEN, dtype=np.float32)  # input is cat([norm(embed(next)), norm(hidden)])
    arrays = {
        "mtp.fc.weight": fc,
        "mtp.norm.weight": np.zeros(HIDDEN, np.float32),
        "mtp.pre_fc_norm_embedding.weight": np.zeros(HIDDEN, np.float32),
        "mtp.pre_fc_norm_hidden.weight": np.zeros(HIDDEN, np.float32),
    }
    arrays.update(_norms("mtp.layers.0"))
    arrays.update(_attention_layer(init, "mtp.layers.0.self_attn", MTP_PUSH))
    arrays.update(_moe(init, "mtp.layers.0.mlp", MTP_PUSH))
    return arrays


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m servers.tiny_model", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="cache folder; the model is built inside it")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--variant", choices=sorted(VARIANTS), default="cpu", help="gpu: GPU_GEOMETRY (see there)")
    args = parser.parse_args(argv)
    print(build_tiny_model(args.out, args.seed, args.variant))
    return 0


if __name__ == "__main__":
    sys.exit(main())
