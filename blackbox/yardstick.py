"""Is the reference numerically like the treatment? The settings that must match, from what the servers publish.

The exactness and logprob graders FAIL a treatment whose hits deviate from recomputation more than the
reference's do. That comparison means corruption only if a correct treatment and its reference compute alike:
a reference that does not chunk its prefill is bit-exact where a treatment with a small step budget is not, and a
correct treatment would read FAIL against it (issue 27: `--max-num-batched-tokens 96` on the treatment alone gave
"33/33 differ from recomputation vs 0/64"). So every setting that changes a correct engine's numerics is
compared before any traffic, and a difference refuses the run (`ConfigMismatch`, exit 3).

`MUST_MATCH` lists those settings with why; `MAY_DIFFER` the published settings that legitimately differ (by role
or capacity) and why. A setting that either server does not publish (no `/server_info` without
`VLLM_SERVER_DEV_MODE=1`) cannot be checked: it is named in the verdict as assumed alike, never passed silently.

Not inferred from traffic: `vllm:iteration_tokens_total` does not bound the step budget (a treatment at
`--max-num-batched-tokens 96` counted steps of up to 1024 tokens), so an unpublished budget stays unknown.

The control is never a grader's only yardstick (recall counts a flip only where the treatment's own no-reuse
answer, on the same server, agrees with the control's), so its differences are reported, not refused.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from blackbox import errors
from blackbox.history import Arm
from blackbox.server_info import ServerInfo
from blackbox.verdict import Finding

__all__ = ["MAY_DIFFER", "MUST_MATCH", "Difference", "check", "compare", "normalise"]

_SCHEDULING = "how prefills split into steps: a chunk ending inside a block changes the recurrent state's rounding"
_BATCH = "which requests share a step: batch composition changes a kernel's reduction order"
_KERNELS = "another kernel or precision for the same operation"
_CACHED = "what a hit restores: its precision or which states are checkpointed"

# setting name (a key of `ServerInfo.settings`) -> why a difference changes a correct engine's numerics
MUST_MATCH: Mapping[str, str] = {
    "version": "another vLLM release runs other kernels and schedules",
    "max_num_batched_tokens": _SCHEDULING,
    "enable_chunked_prefill": _SCHEDULING,
    "long_prefill_token_threshold": _SCHEDULING,
    "max_num_partial_prefills": _SCHEDULING,
    "max_long_partial_prefills": _SCHEDULING,
    "max_num_seqs": _BATCH,
    "policy": _BATCH,
    "async_scheduling": "async scheduling overlaps steps and changes what each step holds (and is the #53919 path)",
    "dtype": _KERNELS,
    "quantization": _KERNELS,
    "logprobs_mode": "the logprobs themselves are another quantity (raw or processed)",
    "enforce_eager": "eager and compiled kernels round differently",
    "compilation.mode": "eager and compiled kernels round differently",
    "compilation.cudagraph_mode": "CUDA graphs pad batches to capture sizes",
    "compilation.backend": _KERNELS,
    "attention.backend": _KERNELS,
    "mamba.backend": _KERNELS,
    "kernel.moe_backend": _KERNELS,
    "kernel.linear_backend": _KERNELS,
    "disable_cascade_attn": _KERNELS,
    "tensor_parallel_size": "the split of every matmul and its all-reduce order",
    "pipeline_parallel_size": "the split of the model and its batching",
    "data_parallel_size": _BATCH,
    "enable_expert_parallel": "the split of the experts and its all-to-all order",
    "prefill_context_parallel_size": "the split of the prefill",
    "decode_context_parallel_size": "the split of the decode",
    "cache_dtype": _CACHED,
    "mamba_cache_dtype": _CACHED,
    "mamba_ssm_cache_dtype": _CACHED,
    "mamba_cache_mode": _CACHED,
    "prefix_cache_retention_interval": _CACHED,
    "block_size": _CACHED,
    "mamba_block_size": _CACHED,
    "enable_mamba_shared_prefix_checkpoint": _CACHED,
    "use_replayssm": _CACHED,
    "replayssm_buffer_len": _CACHED,
    "VLLM_BATCH_INVARIANT": "batch-invariant kernels are another computation",
    "VLLM_ATTENTION_BACKEND": _KERNELS,
    "VLLM_FLOAT32_MATMUL_PRECISION": _KERNELS,
    "VLLM_GDN_DECODE_KERNEL": _KERNELS,
    "VLLM_SSM_CONV_STATE_LAYOUT": _KERNELS,
}

# Published, and allowed to differ (documented so that a new field is a decision, not an accident).
MAY_DIFFER: Mapping[str, str] = {
    "speculative_*": "the role: the reference is the treatment without speculative decoding",
    "enable_prefix_caching": "the role (checked by the role check: the reference caches, the control does not)",
    "max_num_scheduled_tokens": "derived: vLLM sets it from the step budget when speculative decoding runs",
    "num_gpu_blocks": "capacity: the drafter takes memory; it decides what is evicted, not how a hit computes",
    "num_cpu_blocks": "capacity",
    "gpu_memory_utilization": "capacity",
    "kv_cache_memory_bytes": "capacity",
    "VLLM_CPU_KVCACHE_SPACE": "capacity",
    "VLLM_PREFIX_CACHE_RETENTION_INTERVAL": "the treatment's trigger setting, checked by the trigger gate",
    "cpu_threads": "the launcher binds a server started alone to every core and one of a trio to one; no "
    "difference in a correct CPU engine's numbers was seen from it (the clean cold race PASSes across it)",
}


@dataclass(frozen=True)
class Difference:
    setting: str
    treatment: str
    other: str
    why: str

    def describe(self, arm: str) -> str:
        return f"{self.setting}: treatment {self.treatment}, {arm} {self.other}"


def normalise(name: str, value: str) -> str:
    """One spelling per value: `torch.bfloat16` is `bfloat16`, booleans and None as Python writes them."""
    text = value.strip()
    if name == "dtype" and text.startswith("torch."):
        text = text[len("torch.") :]
    lowered = text.lower()
    if lowered in ("true", "false", "none"):
        return lowered.capitalize()
    return text


def threads(bind: str) -> str:
    """`VLLM_CPU_OMP_THREADS_BIND` as a thread count ("0-3,8" -> "5"); the value itself where it is no core list."""
    total = 0
    for part in bind.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:-(\d+))?\s*", part)
        if not m:
            return bind
        total += (int(m[2]) - int(m[1]) + 1) if m[2] else 1
    return str(total)


_ABSENT = "(absent)"
_WHOLE_CONFIG = "/server_info"  # the source that publishes every section: a field it lacks, the release lacks


def _published(info: ServerInfo) -> dict[str, str]:
    settings = {k: normalise(k, v) for k, v in info.settings.items()}
    if info.version is not None:
        settings["version"] = info.version
    bind = settings.pop("VLLM_CPU_OMP_THREADS_BIND", None)
    if bind is not None:
        settings["cpu_threads"] = threads(bind)
    if _WHOLE_CONFIG in info.sources:
        settings |= {name: _ABSENT for name in MUST_MATCH if name not in settings and name != "version"}
    return settings


def compare(treatment: ServerInfo, other: ServerInfo) -> tuple[list[Difference], list[str]]:
    """Settings of `MUST_MATCH` that differ, and those that one of the two does not publish (assumed alike). A
    server that published its whole config and lacks a setting runs a release without it: "(absent)"."""
    mine, theirs = _published(treatment), _published(other)
    differ = [
        Difference(name, mine[name], theirs[name], why)
        for name, why in MUST_MATCH.items()
        if name in mine and name in theirs and mine[name] != theirs[name]
    ]
    unknown = [name for name in MUST_MATCH if name not in mine or name not in theirs]
    return differ, unknown


# Probes whose graders use the reference's hits as their yardstick (the cold race's is the treatment's own racers).
REFERENCE_GRADED = frozenset({"multiturn", "held-prefix", "short-follow-up", "load", "preemption", "hit-geometry"})


def check(infos: Mapping[str, ServerInfo], probes: Sequence[str] = ("multiturn",)) -> Finding:
    """The `yardstick` gate: refused when the reference computes unlike the treatment and a probe run grades
    against it; PASS otherwise, naming what could not be checked (figure `caveat`, which the verdict repeats)."""
    treatment = infos[Arm.TREATMENT]
    figures: dict[str, object] = {}
    notes: list[str] = []
    if Arm.CONTROL in infos:
        control_differ, _ = compare(treatment, infos[Arm.CONTROL])
        control_differ = [d for d in control_differ if d.setting not in _CONTROL_ROLE]
        if control_differ:
            figures["control_differs"] = [d.__dict__ for d in control_differ]
            notes.append(
                "the control differs in "
                + "; ".join(d.describe("control") for d in control_differ)
                + " (it is recall's second baseline only: a flip needs the treatment's own no-reuse answer too)"
            )
    if Arm.REFERENCE not in infos:
        return Finding.passed("yardstick", "; ".join(["no reference: no grader compares with one", *notes]), **figures)
    differ, unknown = compare(treatment, infos[Arm.REFERENCE])
    figures |= {"differs": [d.__dict__ for d in differ], "assumed_alike": unknown}
    if differ and not REFERENCE_GRADED & set(probes):
        said = "; ".join(d.describe("reference") for d in differ)
        return Finding.passed("yardstick", f"no probe run grades against the reference (it differs: {said})", **figures)
    if differ:
        return Finding.from_error(
            "yardstick",
            errors.ConfigMismatch(
                "the reference does not compute like the treatment, so a correct treatment could read as corrupt "
                "against it: " + "; ".join(d.describe("reference") for d in differ),
                hint="start the reference with the treatment's flags minus --speculative-config ("
                + ", ".join(_flag(d) for d in differ)
                + "); docs/comparability.md lists what must match and why",
            ),
            **figures,
        )
    if unknown:
        caveat = (
            f"the reference is assumed to run like the treatment in {len(unknown)} settings not published by both "
            f"({', '.join(unknown)}; VLLM_SERVER_DEV_MODE=1 on both servers lets blackbox check them)"
        )
        figures["caveat"] = caveat
        notes.insert(0, caveat)
    said = f"the reference computes like the treatment in the {len(MUST_MATCH) - len(unknown)} settings checked"
    return Finding.passed("yardstick", "; ".join([said, *notes]), **figures)


# Prefix caching off forces mamba_cache_mode none, and with it the retention and the Mamba block size.
_CONTROL_ROLE = {"mamba_cache_mode", "prefix_cache_retention_interval", "mamba_block_size"}


_FLAGS = {
    "max_num_batched_tokens": "--max-num-batched-tokens",
    "max_num_seqs": "--max-num-seqs",
    "enable_chunked_prefill": "--enable-chunked-prefill",
    "long_prefill_token_threshold": "--long-prefill-token-threshold",
    "async_scheduling": "--async-scheduling",
    "dtype": "--dtype",
    "quantization": "--quantization",
    "enforce_eager": "--enforce-eager",
    "tensor_parallel_size": "--tensor-parallel-size",
    "pipeline_parallel_size": "--pipeline-parallel-size",
    "cache_dtype": "--kv-cache-dtype",
    "mamba_ssm_cache_dtype": "--mamba-ssm-cache-dtype",
    "mamba_cache_dtype": "--mamba-cache-dtype",
    "mamba_cache_mode": "--mamba-cache-mode",
    "prefix_cache_retention_interval": "--prefix-cache-retention-interval",
    "block_size": "--block-size",
    "logprobs_mode": "--logprobs-mode",
}


_SWITCHES = ("--enforce-eager", "--async-scheduling", "--enable-chunked-prefill")


def _flag(d: Difference) -> str:
    flag = _FLAGS.get(d.setting)
    if flag is None:
        return f"{d.setting} {d.treatment}"
    if d.treatment in ("True", "False") and flag in _SWITCHES:
        return flag if d.treatment == "True" else f"--no-{flag[2:]}"
    return f"{flag} {d.treatment}"
