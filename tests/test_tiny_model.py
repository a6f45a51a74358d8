"""The tiny Qwen3-Next builder: determinism, planted memory, planted structure, and a tokenizer that round-trips.

The model is run through transformers' own Qwen3-Next code on CPU, forced onto its reference torch path (no fla
or causal-conv1d kernels), as an independent reference for what vLLM serves.
"""

from __future__ import annotations

import copy
import inspect
import json
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from blackbox.vocabulary import PUNCTUATION
from blackbox.vocabulary import WORDS as BLACKBOX_WORDS
from servers import tiny_model
from servers.tiny_model import SPECIAL_TOKENS, VERSION, WORDS, build_tiny_model, successor

SEED = 0
PREFIX, CONTINUATION = 128, 32
GDN_LAYERS = [i for i, t in enumerate(tiny_model.LAYER_TYPES) if t == "linear_attention"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), SEED)


@pytest.fixture(scope="module")
def reference_path() -> Iterator[None]:
    """Point transformers' Qwen3-Next at its torch reference functions, whatever kernels are installed."""
    from transformers.models.qwen3_next import modeling_qwen3_next as modeling

    names = [
        "torch_chunk_gated_delta_rule",
        "torch_recurrent_gated_delta_rule",
        "causal_conv1d_fn",
        "causal_conv1d_update",
    ]
    saved = {name: getattr(modeling, name) for name in names}
    for name, fn in saved.items():
        setattr(modeling, name, inspect.unwrap(fn))
    yield
    for name, fn in saved.items():
        setattr(modeling, name, fn)


def _load(model_dir: Path, dtype: torch.dtype) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()


@pytest.fixture(scope="module")
def fp32_model(model_dir: Path, reference_path: None) -> Any:
    return _load(model_dir, torch.float32)


@pytest.fixture(scope="module")
def bf16_model(model_dir: Path, reference_path: None) -> Any:
    return _load(model_dir, torch.bfloat16)


def _words(rng: np.random.Generator, n: int) -> torch.Tensor:
    return torch.tensor(rng.integers(len(SPECIAL_TOKENS), tiny_model.VOCAB_SIZE, size=(1, n)))


def _file_bytes(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_same_seed_builds_identical_bytes_and_other_seed_differs(tmp_path: Path) -> None:
    first = build_tiny_model(tmp_path / "a", SEED)
    second = build_tiny_model(tmp_path / "b", SEED)
    other = build_tiny_model(tmp_path / "c", SEED + 1)

    assert first.name == f"tiny-qwen3next-s{SEED}-v{VERSION}"
    assert _file_bytes(first) == _file_bytes(second)
    assert (first / "model.safetensors").read_bytes() != (other / "model.safetensors").read_bytes()
    assert sorted(p.name for p in tmp_path.joinpath("a").iterdir()) == [first.name]  # no staging left behind


def test_existing_build_is_reused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    built = build_tiny_model(tmp_path, SEED)
    stamp = (built / "model.safetensors").stat().st_mtime_ns

    assert tiny_model.main(["--out", str(tmp_path), "--seed", str(SEED)]) == 0
    assert capsys.readouterr().out.strip() == str(built)
    assert (built / "model.safetensors").stat().st_mtime_ns == stamp


def test_tensor_names_and_shapes_match_the_config(model_dir: Path) -> None:
    tensors = load_file(model_dir / "model.safetensors")

    assert tensors["model.layers.0.linear_attn.in_proj_qkvz.weight"].shape == (512, 128)
    assert tensors["model.layers.0.linear_attn.in_proj_ba.weight"].shape == (4, 128)
    assert tensors["model.layers.0.linear_attn.conv1d.weight"].shape == (384, 1, 4)
    assert tensors["model.layers.1.self_attn.q_proj.weight"].shape == (512, 128)
    assert tensors["model.layers.3.mlp.experts.3.down_proj.weight"].shape == (128, 64)
    assert tensors["mtp.fc.weight"].shape == (128, 256)
    assert tensors["mtp.layers.0.mlp.shared_expert_gate.weight"].shape == (1, 128)
    assert {name.split(".")[0] for name in tensors} == {"model", "lm_head", "mtp"}
    assert all(t.dtype == torch.bfloat16 for n, t in tensors.items() if not n.endswith("A_log"))


def test_every_gdn_head_decays_slowly_for_any_input(model_dir: Path) -> None:
    """decay = exp(-exp(A_log) * softplus(a + dt_bias)), with |a| bounded by Cauchy-Schwarz.

    `a` is a row of in_proj_ba applied to the input RMSNorm's output x, and |x| <= sqrt(hidden) * max|1 + w|.
    """
    tensors = {k: v.float() for k, v in load_file(model_dir / "model.safetensors").items()}
    heads = 0
    for i in GDN_LAYERS:
        prefix = f"model.layers.{i}"
        norm_gain = (1 + tensors[f"{prefix}.input_layernorm.weight"]).abs().max().item()
        x_norm = math.sqrt(tiny_model.HIDDEN) * norm_gain
        ba = tensors[f"{prefix}.linear_attn.in_proj_ba.weight"]
        a_rows = ba.view(tiny_model.LINEAR_K_HEADS, 2, -1, tiny_model.HIDDEN)[:, 1].reshape(-1, tiny_model.HIDDEN)
        a_max = a_rows.norm(dim=1) * x_norm
        a_log = tensors[f"{prefix}.linear_attn.A_log"]
        dt_bias = tensors[f"{prefix}.linear_attn.dt_bias"]

        def decay(a: torch.Tensor, a_log: torch.Tensor = a_log, dt_bias: torch.Tensor = dt_bias) -> torch.Tensor:
            return torch.exp(-a_log.exp() * torch.nn.functional.softplus(a + dt_bias))

        assert a_max.max().item() < 0.5
        assert decay(a_max).min().item() >= 0.95
        assert decay(-a_max).max().item() <= 0.996
        assert (
            0.96 <= decay(torch.zeros_like(a_max)).min().item() <= decay(torch.zeros_like(a_max)).max().item() <= 0.995
        )
        heads += a_log.numel()
    assert heads == 4


def _continue(model: Any, ids: torch.Tensor, surgery: Callable[[Any], None] | None = None) -> torch.Tensor:
    """Logits of the continuation, resumed from the cache of the first PREFIX tokens after `surgery` on it."""
    with torch.no_grad():
        cache = model(ids[:, :PREFIX], use_cache=True).past_key_values
        if surgery is not None:
            surgery(cache)
        return model(ids[:, PREFIX:], past_key_values=cache).logits[0].float()


def _set_state(states: list[torch.Tensor] | None) -> Callable[[Any], None]:
    def surgery(cache: Any) -> None:
        for n, layer in enumerate(GDN_LAYERS):
            state = cache.layers[layer].recurrent_states[0]
            state.copy_(torch.zeros_like(state) if states is None else states[n])

    return surgery


def test_a_wrong_recurrent_state_changes_later_logits_far_beyond_bf16_noise(fp32_model: Any, bf16_model: Any) -> None:
    """Resume the next 32 tokens after 128 from a zeroed, or another prompt's, GDN state (KV and conv kept).

    Noise floor: max |Δ logit| between the bf16 and the fp32 model on the same correct resume (and between two
    identical runs). A wrong state must move some logit by more than 10x that floor, also in the last 16
    tokens, and change the argmax somewhere.
    """
    rng = np.random.default_rng(11)
    ids, other = _words(rng, PREFIX + CONTINUATION), _words(rng, PREFIX)
    with torch.no_grad():
        full = fp32_model(ids).logits[0, PREFIX:].float()
        other_cache = fp32_model(other, use_cache=True).past_key_values
    other_states = [copy.deepcopy(other_cache.layers[i].recurrent_states[0]) for i in GDN_LAYERS]

    correct = _continue(fp32_model, ids)
    assert (correct - full).abs().max().item() < 1e-3  # resuming from the cache is exact
    repeat = (_continue(fp32_model, ids) - correct).abs().max().item()
    bf16 = (_continue(bf16_model, ids) - correct).abs().max().item()
    floor = max(repeat, bf16)
    assert 0 < floor < 1.0

    for surgery in (_set_state(None), _set_state(other_states)):
        wrong = _continue(fp32_model, ids, surgery)
        delta = (wrong - correct).abs().max(dim=-1).values
        assert delta.max().item() > 10 * floor
        assert delta[CONTINUATION // 2 :].max().item() > 10 * floor
        assert (wrong.argmax(-1) != correct.argmax(-1)).sum().item() >= 2


def test_outputs_follow_the_planted_successor_most_but_not_all_of_the_time(fp32_model: Any) -> None:
    ids = _words(np.random.default_rng(5), 400)
    f = torch.tensor(successor(SEED))
    with torch.no_grad():
        argmax = fp32_model(ids).logits[0].argmax(-1)
    follow = (argmax == f[ids[0]]).float().mean().item()
    assert 0.75 <= follow <= 0.95
    assert argmax.min().item() >= len(SPECIAL_TOKENS)  # never a special token


def test_mtp_head_proposes_the_successor_of_the_next_token(model_dir: Path, fp32_model: Any) -> None:
    """Runs the MTP layer as vLLM does: fc(cat(norm(embed(next)), norm(hidden))) -> decoder layer -> norm -> lm_head."""
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextDecoderLayer, Qwen3NextRMSNorm

    config = fp32_model.config
    weights = {
        k[len("mtp.") :]: v.float()
        for k, v in load_file(model_dir / "model.safetensors").items()
        if k.startswith("mtp.")
    }
    full_attention = config.layer_types.index("full_attention")
    layer = Qwen3NextDecoderLayer(config, full_attention).eval()
    layer_weights = {k[len("layers.0.") :]: v for k, v in weights.items() if k.startswith("layers.0.")}
    experts = [f"mlp.experts.{e}" for e in range(config.num_experts)]
    gate_up = [
        torch.cat([layer_weights.pop(f"{e}.gate_proj.weight"), layer_weights.pop(f"{e}.up_proj.weight")])
        for e in experts
    ]
    layer_weights["mlp.experts.gate_up_proj"] = torch.stack(gate_up)
    layer_weights["mlp.experts.down_proj"] = torch.stack([layer_weights.pop(f"{e}.down_proj.weight") for e in experts])
    layer_weights["mlp.gate.weight"] = layer_weights.pop("mlp.gate.weight")
    layer.load_state_dict(layer_weights)
    norms = {}
    for name in ("norm", "pre_fc_norm_embedding", "pre_fc_norm_hidden"):
        norms[name] = Qwen3NextRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        norms[name].load_state_dict({"weight": weights[f"{name}.weight"]})

    ids = _words(np.random.default_rng(6), 200)
    f = torch.tensor(successor(SEED))
    with torch.no_grad():
        hidden = fp32_model.model(ids).last_hidden_state[:, :-1]
        nxt = ids[:, 1:]
        embed = fp32_model.model.embed_tokens(nxt)
        x = torch.cat([norms["pre_fc_norm_embedding"](embed), norms["pre_fc_norm_hidden"](hidden)], dim=-1)
        x = x @ weights["fc.weight"].T
        positions = torch.arange(1, ids.shape[1]).unsqueeze(0)
        x = layer(x, position_embeddings=fp32_model.model.rotary_emb(x, positions), position_ids=positions)
        proposal = fp32_model.lm_head(norms["norm"](x)).argmax(-1)
    assert (proposal == f[nxt]).float().mean().item() >= 0.95


def test_word_list_fills_the_vocab_and_has_codes() -> None:
    assert len(WORDS) + len(SPECIAL_TOKENS) == tiny_model.VOCAB_SIZE
    assert len(set(WORDS)) == len(WORDS)
    assert all((w.isalnum() and w.islower()) or w.isdigit() or w in PUNCTUATION for w in WORDS)
    assert set(BLACKBOX_WORDS) <= set(WORDS)  # the tester's documents tokenize without <unk>
    assert {"user", "assistant", "system", "code", "0", "42", "k07"} <= set(WORDS)


def test_decode_then_encode_is_the_identity_and_the_chat_template_keeps_boundaries(model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer: Any = AutoTokenizer.from_pretrained(model_dir)
    rng = np.random.default_rng(3)
    answer_ids = _words(rng, 300)[0].tolist()
    answer = tokenizer.decode(answer_ids)
    assert tokenizer(answer, add_special_tokens=False)["input_ids"] == answer_ids
    assert "  " not in answer

    question = " ".join(WORDS[i] for i in rng.integers(0, len(WORDS), 50))
    turn1: list[dict[str, str]] = [{"role": "user", "content": question}]
    prompt1 = tokenizer.apply_chat_template(turn1, tokenize=True, add_generation_prompt=True)["input_ids"]
    turn2 = [*turn1, {"role": "assistant", "content": answer}, {"role": "user", "content": "what is the code"}]
    prompt2 = tokenizer.apply_chat_template(turn2, tokenize=True, add_generation_prompt=True)["input_ids"]
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in ("<|im_start|>", "<|im_end|>", "assistant", "user")}

    assert prompt1[:2] == [ids["<|im_start|>"], ids["user"]]
    assert prompt1[-2:] == [ids["<|im_start|>"], ids["assistant"]]
    assert len(prompt1) == 50 + 5
    # Turn 2 re-sends turn 1's prompt and answer tokens exactly.
    assert prompt2[: len(prompt1)] == prompt1
    assert prompt2[len(prompt1) : len(prompt1) + len(answer_ids) + 1] == [*answer_ids, ids["<|im_end|>"]]
    assert tokenizer.unk_token_id not in prompt2


# --- the GPU variant ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gpu_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-gpu"), SEED, variant="gpu")


def test_gpu_variant_has_twice_as_many_value_heads_and_its_own_folder(gpu_model_dir: Path, model_dir: Path) -> None:
    geometry = tiny_model.GPU_GEOMETRY
    config = json.loads((gpu_model_dir / "config.json").read_text())
    tensors = load_file(gpu_model_dir / "model.safetensors")

    assert gpu_model_dir.name == f"tiny-qwen3next-gpu-s{SEED}-v{VERSION}"
    assert config["linear_num_value_heads"] == 2 * config["linear_num_key_heads"] == 2 * geometry.k_heads
    assert config["linear_key_head_dim"] == config["linear_value_head_dim"] == geometry.head_dim
    key_dim, value_dim = geometry.k_heads * geometry.head_dim, geometry.v_heads * geometry.head_dim
    assert tensors["model.layers.0.linear_attn.in_proj_qkvz.weight"].shape == (2 * key_dim + 2 * value_dim, 128)
    assert tensors["model.layers.0.linear_attn.in_proj_ba.weight"].shape == (2 * geometry.v_heads, 128)
    assert tensors["model.layers.0.linear_attn.conv1d.weight"].shape == (2 * key_dim + value_dim, 1, 4)
    # Everything but the GDN mixers is the CPU model's, byte for byte.
    cpu = load_file(model_dir / "model.safetensors")
    shared = [n for n in cpu if ".linear_attn." not in n]
    assert shared and all(torch.equal(cpu[n], tensors[n]) for n in shared)


def test_gpu_variant_decays_span_the_planted_range(gpu_model_dir: Path) -> None:
    tensors = {k: v.float() for k, v in load_file(gpu_model_dir / "model.safetensors").items()}
    for n, layer in enumerate(GDN_LAYERS):
        prefix = f"model.layers.{layer}.linear_attn"
        softplus_dt = torch.nn.functional.softplus(tensors[f"{prefix}.dt_bias"])
        decay = torch.exp(-tensors[f"{prefix}.A_log"].exp() * softplus_dt)
        low, high = tiny_model.GDN_DECAYS[n]
        assert decay.numel() == tiny_model.GPU_GEOMETRY.v_heads
        assert decay.min().item() == pytest.approx(low, abs=1e-4)
        assert decay.max().item() == pytest.approx(high, abs=1e-4)


def test_gpu_variant_follows_the_successor_like_the_cpu_model(gpu_model_dir: Path, reference_path: None) -> None:
    model = _load(gpu_model_dir, torch.float32)
    ids = _words(np.random.default_rng(5), 400)
    f = torch.tensor(successor(SEED))
    with torch.no_grad():
        argmax = model(ids).logits[0].argmax(-1)
    follow = (argmax == f[ids[0]]).float().mean().item()
    assert 0.75 <= follow <= 0.95  # measured 0.835 (CPU model 0.817)


def _ba_last_stride(k_heads: int, v_heads: int, tokens: int = 3) -> int:
    """vLLM 0.26 `fix_query_key_value_ordering` on in_proj_ba's output, as its CUDA path does it."""
    ba = torch.zeros(tokens, 2 * v_heads)
    grouped = ba.view(tokens, k_heads, 2 * v_heads // k_heads)
    b, _ = torch.split(grouped, [v_heads // k_heads, v_heads // k_heads], dim=2)
    return int(b.reshape(tokens, v_heads).stride(-1))


def test_gpu_geometry_gives_the_decode_kernel_contiguous_b_and_a() -> None:
    """The CUDA decode kernel raises "a/b must be contiguous in the last dim" unless the last stride is 1."""
    cpu, gpu = tiny_model.CPU_GEOMETRY, tiny_model.GPU_GEOMETRY
    assert _ba_last_stride(cpu.k_heads, cpu.v_heads) == 2  # the crash on the H200
    assert _ba_last_stride(gpu.k_heads, gpu.v_heads) == 1
    assert _ba_last_stride(16, 32) == 1  # Qwen3-Next-80B's heads


def test_unknown_variant_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="gpu"):
        build_tiny_model(tmp_path, SEED, variant="tpu")
