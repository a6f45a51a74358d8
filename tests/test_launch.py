"""Profiles as data, and the Fleet against fake servers (small Python scripts), no vLLM needed."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import sys
import textwrap
import time
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from servers import launch, profiles
from servers.launch import Fleet, ServerStartError, Shutdown
from servers.profiles import (
    FRAGMENTED_BATCHED_TOKENS,
    GPU_MEMORY_BUDGET,
    ROLES,
    ServerSpec,
    build_specs,
    place_on_gpus,
    retention_args,
    shares_a_gpu,
)

SPEC = '{"method":"mtp","num_speculative_tokens":2}'


@pytest.fixture
def two_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(profiles, "_usable_cores", lambda: [0, 1])


def cpu_specs(
    tmp_path: Path, roles: tuple[str, ...] = ("treatment", "control", "reference"), **kw: Any
) -> dict[str, ServerSpec]:
    return {s.role: s for s in build_specs("cpu-tiny", roles, model="/m/tiny", cache_dir=tmp_path, **kw)}


def flag(args: tuple[str, ...], name: str) -> str:
    return args[args.index(name) + 1]


# --- profiles ---------------------------------------------------------------------------------------------


def test_argv_runs_the_api_server_module(tmp_path: Path, two_cores: None) -> None:
    spec = cpu_specs(tmp_path)["treatment"]
    assert spec.argv[:3] == [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
    assert spec.argv[3:11] == [
        "--model", "/m/tiny", "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", "8100",
    ]  # fmt: skip
    assert spec.argv[11:] == list(spec.args)
    assert spec.url == "http://127.0.0.1:8100"


def test_treatment_has_align_prefix_caching_spec_config_and_retention(tmp_path: Path, two_cores: None) -> None:
    args = cpu_specs(tmp_path)["treatment"].args
    assert "--enable-prefix-caching" in args
    assert flag(args, "--mamba-cache-mode") == "align"
    assert flag(args, "--prefix-cache-retention-interval") == "None"
    assert flag(args, "--speculative-config") == SPEC
    assert "--enable-prompt-tokens-details" in args
    assert "--no-enable-prefix-caching" not in args


def test_control_turns_caching_off_and_keeps_spec_config_and_compile_mode(tmp_path: Path, two_cores: None) -> None:
    specs = cpu_specs(tmp_path)
    args = specs["control"].args
    assert "--no-enable-prefix-caching" in args
    assert "--enable-prefix-caching" not in args
    assert "--mamba-cache-mode" not in args
    assert flag(args, "--speculative-config") == flag(specs["treatment"].args, "--speculative-config")
    assert "--enable-prompt-tokens-details" in args
    for role in ("treatment", "control", "reference"):
        assert "--enforce-eager" in specs[role].args


def test_reference_is_treatment_without_spec_decode(tmp_path: Path, two_cores: None) -> None:
    specs = cpu_specs(tmp_path)
    args = specs["reference"].args
    assert "--speculative-config" not in args
    treatment = list(specs["treatment"].args)
    cut = treatment.index("--speculative-config")
    del treatment[cut : cut + 2]
    assert list(args) == treatment


def test_cpu_common_flags_and_env(tmp_path: Path, two_cores: None) -> None:
    for spec in cpu_specs(tmp_path).values():
        assert flag(spec.args, "--dtype") == "bfloat16"
        assert flag(spec.args, "--max-model-len") == "4096"
        assert flag(spec.args, "--max-num-seqs") == "8"
        assert "--max-num-batched-tokens" not in spec.args
        assert "--tensor-parallel-size" not in spec.args
        assert spec.device == "cpu"
        assert spec.served_model_name == "tiny"
        assert spec.env["VLLM_CPU_KVCACHE_SPACE"] == "1"
        assert spec.env["VLLM_HOST_IP"] == "127.0.0.1"
        assert spec.env["HF_HUB_OFFLINE"] == "1"
        assert spec.env["BLACKBOX_VLLM_PLUGINS"] == "cpu-kernels"
        assert "BLACKBOX_FAULT" not in spec.env
        assert "CUDA_VISIBLE_DEVICES" not in spec.env


def test_ports_follow_the_role_not_the_order(tmp_path: Path, two_cores: None) -> None:
    specs = cpu_specs(tmp_path, ("reference", "treatment"), base_port=8140)
    assert specs["treatment"].port == 8140
    assert specs["reference"].port == 8142


def test_cpu_cores_spread_over_roles(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def binds(cores: list[int], roles: tuple[str, ...]) -> dict[str, str]:
        monkeypatch.setattr(profiles, "_usable_cores", lambda: cores)
        return {r: s.env["VLLM_CPU_OMP_THREADS_BIND"] for r, s in cpu_specs(tmp_path, roles).items()}

    three = ("treatment", "control", "reference")
    assert binds([0, 1], three) == {"treatment": "0", "control": "1", "reference": "1"}
    assert binds([0, 1], three[:2]) == {"treatment": "0", "control": "1"}
    assert binds([0], three) == {"treatment": "0", "control": "0", "reference": "0"}
    assert binds([0, 1, 2, 3], three[:2]) == {"treatment": "0-1", "control": "2-3"}
    assert binds([0, 2, 4, 6, 8, 10], three) == {"treatment": "0,2", "control": "4,6", "reference": "8,10"}


def test_fault_goes_to_the_treatment_only(tmp_path: Path, two_cores: None) -> None:
    specs = cpu_specs(tmp_path, fault="stale-state")
    assert specs["treatment"].env["BLACKBOX_VLLM_PLUGINS"] == "cpu-kernels,faults"
    assert specs["treatment"].env["BLACKBOX_FAULT"] == "stale-state"
    for role in ("control", "reference"):
        assert specs[role].env["BLACKBOX_VLLM_PLUGINS"] == "cpu-kernels"
        assert "BLACKBOX_FAULT" not in specs[role].env


def test_fragmented_profile_shrinks_the_prefill_budget(tmp_path: Path, two_cores: None) -> None:
    specs = build_specs("cpu-tiny-fragmented", model="/m", cache_dir=tmp_path)
    for spec in specs:
        budget = int(flag(spec.args, "--max-num-batched-tokens"))
        assert budget == FRAGMENTED_BATCHED_TOKENS < 128  # below one block, so chunks end mid-block
        assert budget >= int(flag(spec.args, "--max-num-seqs"))  # vLLM's lower bound


@pytest.mark.parametrize(
    ("profile", "module", "builder"),
    [
        ("cpu-tiny", "servers.tiny_model", "build_tiny_model"),
        ("cpu-tiny-recall", "servers.recall_model", "build_recall_model"),  # the model trained to recall
    ],
)
def test_cpu_profiles_build_their_model_lazily(
    profile: str, module: str, builder: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[Path] = []

    def build(cache_dir: Path) -> Path:
        calls.append(cache_dir)
        return cache_dir / "tiny-model"

    fake = types.ModuleType(module)
    setattr(fake, builder, build)
    monkeypatch.setitem(sys.modules, module, fake)
    specs = build_specs(profile, cache_dir=tmp_path)
    assert calls == [tmp_path]
    assert {s.model for s in specs} == {str(tmp_path / "tiny-model")}
    assert {s.served_model_name for s in specs} == {"tiny"}


def test_extra_args_and_spec_override_reach_every_role(tmp_path: Path, two_cores: None) -> None:
    override = {"method": "mtp", "num_speculative_tokens": 1}
    specs = cpu_specs(tmp_path, extra_args=["--seed", "7"], speculative_config=override)
    for spec in specs.values():
        assert spec.args[-2:] == ("--seed", "7")
    assert json.loads(flag(specs["treatment"].args, "--speculative-config")) == override
    assert flag(specs["control"].args, "--speculative-config") == flag(specs["treatment"].args, "--speculative-config")


def test_qwen_preset_pins_one_gpu_per_role(tmp_path: Path) -> None:
    roles = ("treatment", "control", "reference")
    specs = build_specs("qwen3.6-27b-fp8", roles, cache_dir=tmp_path, gpu_count=8, has_flashinfer=True)
    assert [s.env["CUDA_VISIBLE_DEVICES"] for s in specs] == ["0", "1", "2"]
    for spec in specs:
        assert spec.model == spec.served_model_name == "Qwen/Qwen3.6-27B-FP8"
        assert spec.device == "cuda"
        assert flag(spec.args, "--tensor-parallel-size") == "1"
        assert flag(spec.args, "--gpu-memory-utilization") == "0.90"
        assert "--enforce-eager" not in spec.args
        assert "BLACKBOX_VLLM_PLUGINS" not in spec.env
        assert "VLLM_USE_FLASHINFER_SAMPLER" not in spec.env
        assert "--gdn-prefill-backend" not in spec.args
    assert flag(specs[0].args, "--speculative-config") == SPEC
    assert not shares_a_gpu(specs)


def test_one_gpu_holds_three_roles_with_a_memory_fraction_each(tmp_path: Path) -> None:
    roles = ("treatment", "control", "reference")
    specs = build_specs("qwen3.6-27b-fp8", roles, cache_dir=tmp_path, gpu_count=1)
    assert [s.env["CUDA_VISIBLE_DEVICES"] for s in specs] == ["0", "0", "0"]
    assert [flag(s.args, "--gpu-memory-utilization") for s in specs] == ["0.30", "0.30", "0.30"]
    assert all(s.args.count("--gpu-memory-utilization") == 1 for s in specs)
    assert shares_a_gpu(specs)


def test_two_gpus_three_roles_share_round_robin(tmp_path: Path) -> None:
    roles = ("treatment", "control", "reference")
    specs = {s.role: s for s in build_specs("qwen3.6-27b-fp8", roles, cache_dir=tmp_path, gpu_count=2)}
    assert {r: s.env["CUDA_VISIBLE_DEVICES"] for r, s in specs.items()} == {
        "treatment": "0", "control": "1", "reference": "0",
    }  # fmt: skip
    assert {r: flag(s.args, "--gpu-memory-utilization") for r, s in specs.items()} == {
        "treatment": "0.45", "control": "0.90", "reference": "0.45",
    }  # fmt: skip


def test_placement_never_overcommits_a_gpu() -> None:
    for n_roles in range(1, 4):
        for count in range(1, 5):
            placement = place_on_gpus(ROLES[:n_roles], 1, None, count)
            per_gpu: dict[str, float] = {}
            for p in placement:
                per_gpu[p.devices] = per_gpu.get(p.devices, 0.0) + p.memory_fraction
                assert set(p.shared_with) == {q.role for q in placement if q.devices == p.devices} - {p.role}
            assert all(0 < total <= GPU_MEMORY_BUDGET for total in per_gpu.values())
            assert len(per_gpu) == min(n_roles, count)


def test_tensor_parallel_roles_share_whole_gpu_groups(tmp_path: Path) -> None:
    specs = build_specs("nemotron-3-super-120b", gpus=range(6), cache_dir=tmp_path)
    assert [s.env["CUDA_VISIBLE_DEVICES"] for s in specs] == ["0,1,2,3", "0,1,2,3"]
    assert [flag(s.args, "--gpu-memory-utilization") for s in specs] == ["0.45", "0.45"]


def test_no_gpu_found_keeps_one_gpu_per_role(tmp_path: Path) -> None:
    specs = build_specs("qwen3.6-27b-fp8", ("treatment", "control"), cache_dir=tmp_path, gpu_count=0)
    assert [s.env["CUDA_VISIBLE_DEVICES"] for s in specs] == ["0", "1"]


def test_visible_gpu_count_reads_cuda_visible_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    assert profiles.visible_gpu_count() == 2
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert profiles.visible_gpu_count() == 0


@pytest.mark.parametrize(
    ("version", "missing"),
    [("0.26.0", True), ("0.28.9", True), ("0.29.0", False), ("0.29.0rc1.dev7+gabc", False), ("0.32.0", False),
     ("1.0.0", False), (None, False)],
)  # fmt: skip
def test_retention_flag_only_where_the_version_has_it(tmp_path: Path, version: str | None, missing: bool) -> None:
    args = retention_args(version)
    assert (args == ()) == missing
    specs = {s.role: s for s in build_specs("gpu-tiny", ROLES, model="/m", cache_dir=tmp_path, gpu_count=1,
                                            vllm_version=version)}  # fmt: skip
    for role in ("treatment", "reference"):
        assert ("--prefix-cache-retention-interval" in specs[role].args) != missing
        assert "--enable-prefix-caching" in specs[role].args
    assert "--prefix-cache-retention-interval" not in specs["control"].args
    assert all(profiles.RETENTION_ENV not in s.env for s in specs.values())


@pytest.mark.parametrize(
    ("version", "needed"), [("0.28.0", True), ("0.28.9", True), ("0.29.0", False), ("0.32.0", False), (None, False)]
)
def test_cpu_roles_ask_0_28_for_a_float32_ssm_state(tmp_path: Path, version: str | None, needed: bool) -> None:
    """0.28 kept a bfloat16 SSM cache on CPUs without AMX, which its CPU GDN kernel rejects; later versions pick
    float32 themselves. Every role gets the flag (the state dtype must not differ between arms); GPUs never do."""
    cpu = build_specs("cpu-tiny", ROLES, model="/m", cache_dir=tmp_path, vllm_version=version)
    for spec in cpu:
        args = " ".join(spec.args)
        assert ("--mamba-ssm-cache-dtype" in args) == needed
        assert ("--mamba-ssm-cache-dtype float32" in args) == needed
    gpu = build_specs("gpu-tiny", ROLES, model="/m", cache_dir=tmp_path, gpu_count=1, vllm_version=version)
    assert all("--mamba-ssm-cache-dtype" not in spec.args for spec in gpu)


def test_flashinfer_fallback_only_without_flashinfer(tmp_path: Path) -> None:
    without = build_specs("gpu-tiny", ROLES, model="/m", cache_dir=tmp_path, gpu_count=1, has_flashinfer=False)
    with_it = build_specs("gpu-tiny", ROLES, model="/m", cache_dir=tmp_path, gpu_count=1, has_flashinfer=True)
    for spec in without:
        assert spec.env["VLLM_USE_FLASHINFER_SAMPLER"] == "0"
        assert flag(spec.args, "--gdn-prefill-backend") == "triton"
    for spec in with_it:
        assert "VLLM_USE_FLASHINFER_SAMPLER" not in spec.env
        assert "--gdn-prefill-backend" not in spec.args


def test_gpu_tiny_builds_the_gpu_variant_and_serves_it_as_tiny(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[Path, str]] = []

    def build(cache_dir: Path, seed: int = 0, variant: str = "cpu") -> Path:
        calls.append((cache_dir, variant))
        return cache_dir / f"tiny-{variant}"

    fake = types.ModuleType("servers.tiny_model")
    fake.build_tiny_model = build  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "servers.tiny_model", fake)
    specs = build_specs("gpu-tiny", ROLES, cache_dir=tmp_path, gpu_count=1, vllm_version="0.26.0")
    assert calls == [(tmp_path, "gpu")]
    for spec in specs:
        assert spec.model == str(tmp_path / "tiny-gpu")
        assert spec.served_model_name == "tiny"
        assert spec.device == "cuda"
        assert flag(spec.args, "--max-model-len") == "8192"
        assert "--enforce-eager" in spec.args  # vLLM 0.26's FULL CUDA graphs die with MTP (bench/results/gpu.md)
        # One block size on every role: left to choose, vLLM 0.26 gives the MTP treatment 288 and the reference
        # 272, and the yardstick gate refuses the triple (bench/results/gpu-load.md).
        assert flag(spec.args, "--block-size") == "288"
        assert spec.args.count("--block-size") == 1
        assert "BLACKBOX_VLLM_PLUGINS" not in spec.env
    assert {spec.role for spec in specs} == set(ROLES)


def test_nemotron_preset_takes_disjoint_gpu_sets_in_order(tmp_path: Path) -> None:
    specs = build_specs("nemotron-3-super-120b", gpus=[7, 6, 5, 4, 3, 2, 1, 0], cache_dir=tmp_path)
    sets = [s.env["CUDA_VISIBLE_DEVICES"] for s in specs]
    assert sets == ["7,6,5,4", "3,2,1,0"]
    assert specs[0].model == "nvidia/NVIDIA-Nemotron-3-Super-120B-A12B-BF16"
    assert flag(specs[0].args, "--tensor-parallel-size") == "4"
    assert json.loads(flag(specs[0].args, "--speculative-config"))["method"] == "mtp"


def test_custom_profile(tmp_path: Path) -> None:
    specs = build_specs(
        "custom", model="/models/my-hybrid", tensor_parallel=2, cache_dir=tmp_path, fault="x", gpu_count=4
    )
    assert [s.env["CUDA_VISIBLE_DEVICES"] for s in specs] == ["0,1", "2,3"]
    assert specs[0].served_model_name == "my-hybrid"
    assert specs[0].env["BLACKBOX_VLLM_PLUGINS"] == "faults"
    assert flag(specs[0].args, "--tensor-parallel-size") == "2"


@pytest.mark.parametrize(
    ("call", "words"),
    [
        (lambda d: build_specs("cpu-huge", cache_dir=d), ["unknown profile", "cpu-tiny"]),
        (lambda d: build_specs("cpu-tiny", ("treatment", "judge"), model="m", cache_dir=d), ["'judge'"]),
        (lambda d: build_specs("cpu-tiny", ("control", "control"), model="m", cache_dir=d), ["repeat"]),
        (lambda d: build_specs("cpu-tiny", (), model="m", cache_dir=d), ["no roles"]),
        (lambda d: build_specs("cpu-tiny", model="m", tensor_parallel=2, cache_dir=d), ["--tp 1"]),
        (lambda d: build_specs("custom", cache_dir=d), ["needs a model", "--model"]),
        (lambda d: build_specs("custom", model="m", tensor_parallel=0, cache_dir=d), ["not positive"]),
        (lambda d: build_specs("nemotron-3-super-120b", gpus=range(3), cache_dir=d), ["TP 4 needs 4 GPUs", "got 3"]),
        (lambda d: build_specs("qwen3.6-27b-fp8", gpus=[1, 1], cache_dir=d), ["repeats"]),
    ],
)
def test_bad_input_says_what_to_do(
    tmp_path: Path, two_cores: None, call: Callable[[Path], object], words: list[str]
) -> None:
    with pytest.raises(ValueError) as info:
        call(tmp_path)
    for word in words:
        assert word in str(info.value)


def test_fleet_refuses_shared_ports(tmp_path: Path) -> None:
    spec = fake_spec("treatment", 9000, ["true"])
    with pytest.raises(ValueError, match="share a port"):
        Fleet([spec, fake_spec("control", 9000, ["true"])], tmp_path)


# --- fleet ------------------------------------------------------------------------------------------------

FAKE_SERVER = textwrap.dedent(
    """
    import http.server, json, signal, subprocess, sys
    port, name, pid_file, child_ignores_term = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4] == "1"
    code = "import signal, time\\n"
    if child_ignores_term:
        code += "signal.signal(signal.SIGTERM, signal.SIG_IGN)\\n"
    child = subprocess.Popen([sys.executable, "-c", code + "time.sleep(600)"])
    open(pid_file, "w").write(str(child.pid))

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path == "/health":
                body = b""
            elif self.path == "/v1/models":
                body = json.dumps({"object": "list", "data": [{"id": name}]}).encode()
            else:
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    print("fake server up", flush=True)
    http.server.HTTPServer(("127.0.0.1", port), Handler).serve_forever()
    """
)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def fake_spec(role: str, port: int, command: list[str]) -> ServerSpec:
    return ServerSpec(role, "fake", "fake-model", port, (), {"FAKE_ROLE": role}, "cpu", tuple(command))


def fake_server(tmp_path: Path, role: str, *, child_ignores_term: bool = False) -> tuple[ServerSpec, Path]:
    script = tmp_path / "fake_server.py"
    script.write_text(FAKE_SERVER)
    pid_file = tmp_path / f"{role}.child"
    port = free_port()
    argv = [sys.executable, str(script), str(port), "fake-model", str(pid_file), str(int(child_ignores_term))]
    return fake_spec(role, port, argv), pid_file


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.fixture
def started(tmp_path: Path) -> Iterator[tuple[Fleet, dict[str, int]]]:
    """Two fake servers, each with a child; yields the fleet and the children's PIDs."""
    (a, a_pid), (b, b_pid) = fake_server(tmp_path, "treatment"), fake_server(tmp_path, "control")
    fleet = Fleet([a, b], tmp_path / "logs")
    with fleet:
        fleet.start(timeout_s=30)
        children = {"treatment": int(a_pid.read_text()), "control": int(b_pid.read_text())}
        yield fleet, children


def test_start_waits_for_health_and_records_everything(started: tuple[Fleet, dict[str, int]]) -> None:
    fleet, _ = started
    assert set(fleet.urls) == {"treatment", "control"}
    assert all(url.startswith("http://127.0.0.1:") for url in fleet.urls.values())
    assert set(fleet.startup_s) == {"treatment", "control"}
    assert all(0 < s < 30 for s in fleet.startup_s.values())
    rss = fleet.rss_bytes()
    assert all(n > 1_000_000 for n in rss.values())  # a Python server and its Python child
    record = json.loads((fleet.log_dir / "pids.json").read_text())
    assert record["treatment"]["pid"] == fleet.pids["treatment"]
    assert record["control"]["env"] == {"FAKE_ROLE": "control"}
    assert "fake server up" in (fleet.log_dir / "treatment.log").read_text()
    assert fleet.exited() == {}


def test_stop_kills_each_process_group_and_is_idempotent(started: tuple[Fleet, dict[str, int]]) -> None:
    fleet, children = started
    pids = [*fleet.pids.values(), *children.values()]
    assert not any(gone(pid) for pid in pids)
    fleet.stop()
    assert all(gone(pid) for pid in pids)
    fleet.stop()
    assert set(fleet.exited()) == {"treatment", "control"}


def test_stop_escalates_to_sigkill(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(launch, "STOP_GRACE_S", 1.0)
    spec, pid_file = fake_server(tmp_path, "treatment", child_ignores_term=True)
    with Fleet([spec], tmp_path / "logs") as fleet:
        fleet.start(timeout_s=30)
        child = int(pid_file.read_text())
        began = time.monotonic()
        fleet.stop()
        assert gone(child)
        assert gone(fleet.pids["treatment"])
        assert time.monotonic() - began < 10


def test_port_taken_names_port_role_and_fix(tmp_path: Path) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        fleet = Fleet([fake_spec("control", port, [sys.executable, "-c", "pass"])], tmp_path)
        with pytest.raises(ServerStartError) as info:
            fleet.start(timeout_s=5)
    err = info.value
    assert (err.role, err.port) == ("control", port)
    assert str(port) in str(err)
    assert "control" in str(err)
    assert "--base-port" in str(err)
    assert fleet.pids == {}  # nothing was started


def test_a_same_named_server_of_another_launch_on_the_port_is_not_taken_for_ours(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two launches that check the same free ports at once both pass the check; the one whose server then loses the
    bind must not take the other's server, answering with the same model name on that port, for its own."""
    other, _ = fake_server(tmp_path, "treatment")
    with Fleet([other], tmp_path / "other-logs") as theirs:
        theirs.start(timeout_s=30)
        monkeypatch.setattr(launch, "port_free", lambda *_: True)  # both checked before either bound
        loser = fake_spec("treatment", other.port, ["/bin/sh", "-c", "echo loading; exec sleep 60"])
        with Fleet([loser], tmp_path / "logs") as ours, pytest.raises(ServerStartError) as info:
            ours.start(timeout_s=30)
        assert theirs.exited() == {}  # theirs untouched
    text = str(info.value)
    assert f"port {other.port}" in text and "not from the treatment server started here" in text, text
    assert "--base-port" in text
    assert gone(ours.pids["treatment"])


def test_server_dying_at_start_raises_with_its_log_tail(tmp_path: Path) -> None:
    script = "import sys\nfor i in range(60): print(f'line {i}')\nsys.exit(3)"
    healthy, _ = fake_server(tmp_path, "control")
    dying = fake_spec("treatment", free_port(), [sys.executable, "-c", script])
    with Fleet([dying, healthy], tmp_path / "logs") as fleet, pytest.raises(ServerStartError) as info:
        fleet.start(timeout_s=30)
    err = info.value
    assert (err.role, err.returncode) == ("treatment", 3)
    text = str(err)
    assert "treatment" in text
    assert "code 3" in text
    assert "line 59" in text
    assert "line 20" in text
    assert "line 19\n" not in text  # only the last 40 lines
    assert gone(fleet.pids["control"])  # the healthy one was stopped too


def test_server_never_ready_times_out(tmp_path: Path) -> None:
    # A shell, not Python: on a loaded machine an interpreter can take longer than the 1 s timeout to print.
    silent = fake_spec("reference", free_port(), ["/bin/sh", "-c", "echo loading; exec sleep 60"])
    with Fleet([silent], tmp_path) as fleet, pytest.raises(ServerStartError) as info:
        fleet.start(timeout_s=1)
    assert "not ready after 1 s" in str(info.value)
    assert "loading" in info.value.log_tail
    assert gone(fleet.pids["reference"])


def test_signals_raise_shutdown_and_handlers_come_back(tmp_path: Path) -> None:
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    fleet = Fleet([], tmp_path)
    with pytest.raises(Shutdown) as info, fleet.handle_signals():
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
    assert info.value.signum == signal.SIGTERM
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before


def test_cli_reports_bad_input_with_exit_3(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = launch.main(["--profile", "custom", "--log-dir", str(tmp_path), "--cache-dir", str(tmp_path)])
    assert code == 3
    assert "--model" in capsys.readouterr().err


def test_one_by_one_starts_each_server_after_the_previous_is_ready(tmp_path: Path) -> None:
    (a, _), (b, _) = fake_server(tmp_path, "treatment"), fake_server(tmp_path, "control")
    with Fleet([a, b], tmp_path / "logs") as fleet:
        fleet.start(timeout_s=30, one_by_one=True)
        first, second = fleet._servers["treatment"], fleet._servers["control"]
        assert first.ready_s is not None
        assert second.started >= first.started + first.ready_s
        assert set(fleet.urls) == {"treatment", "control"}


def test_servers_sharing_a_gpu_start_one_by_one_by_default(tmp_path: Path) -> None:
    specs = build_specs("gpu-tiny", ("treatment", "control"), model="/m", cache_dir=tmp_path, gpu_count=1)
    assert shares_a_gpu(specs)
    (a, _), (b, _) = fake_server(tmp_path, "treatment"), fake_server(tmp_path, "control")
    shared = [dataclasses.replace(fake, device="cuda", env=spec.env) for fake, spec in zip([a, b], specs, strict=True)]
    with Fleet(shared, tmp_path / "logs") as fleet:
        fleet.start(timeout_s=30)
        first, second = fleet._servers["treatment"], fleet._servers["control"]
        assert first.ready_s is not None
        assert second.started >= first.started + first.ready_s


def test_the_preempt_profile_gives_the_reference_half_the_blocks_and_a_user_flag_still_wins(tmp_path: Path) -> None:
    """Without the drafter a block holds twice the tokens, so the reference gets half the treatment's blocks; vLLM
    keeps the last of a repeated flag, so the profile's own flags come first and `extra_args` last."""

    def blocks(specs: list[profiles.ServerSpec]) -> dict[str, str]:
        """Each role's last --num-gpu-blocks-override value: the one vLLM keeps."""
        out = {}
        for s in specs:
            at = max(i for i, a in enumerate(s.args) if a == "--num-gpu-blocks-override")
            out[s.role] = s.args[at + 1]
        return out

    roles = ("treatment", "control", "reference")
    specs = build_specs("cpu-tiny-preempt", roles, model="/m", cache_dir=tmp_path)
    half = str(profiles.PREEMPT_BLOCKS // 2)
    assert blocks(specs) == {"treatment": "80", "control": "80", "reference": half}
    mine = build_specs(
        "cpu-tiny-preempt", roles, model="/m", cache_dir=tmp_path, extra_args=("--num-gpu-blocks-override", "99")
    )
    assert set(blocks(mine).values()) == {"99"}
