"""The CPU ports (servers/vllm_plugin/cpu_kernels.py) against vLLM's own Triton kernels, on identical inputs.

    python -m servers.gpu.compare_kernels [--seeds 200]          # on a CUDA machine with vLLM installed
    python -m servers.gpu.compare_kernels --cpu --seeds 20       # plumbing check: the port on both sides

Inputs are tests/test_cpu_kernels.py's random caches (the same seed gives the same bytes): one copy stays in host
memory for the port, one goes to the GPU for the Triton kernel, launched on the grid vLLM uses (requests x states);
on the GPU, state sizes are rounded to 16 elements, as vLLM's pages are aligned. Both backing buffers must come out
byte-identical, and so must the updated accepted counts. Covers the V1 postprocess path (what align mode with spec
decode runs; no index mapping, as vLLM's V1 runner launches it) and the precopy kernel with an identity mapping
(vLLM 0.26's precopy always takes one).
Prints one line per case and a total; exit 1 on any difference.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import inspect
import random
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from servers.vllm_plugin import cpu_kernels

_HARNESS = Path(__file__).resolve().parents[2] / "tests" / "test_cpu_kernels.py"


def _harness() -> ModuleType:
    spec = importlib.util.spec_from_file_location("cpu_kernel_harness", _HARNESS)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while being built
    spec.loader.exec_module(module)
    return module


def _to(cache: Any, device: str) -> Any:
    """The cache moved to `device` with the same strides (states are views of the buffers)."""
    buffers = [b.to(device) for b in cache.buffers]
    states = [b.as_strided(s.shape, s.stride()) for b, s in zip(buffers, cache.states, strict=True)]
    tables = [t.to(device).contiguous() for t in cache.block_tables]
    return type(cache)(cache.specs, buffers, states, tables, cache.dim_first)


def _launcher(kernel: Any, grid: tuple[int, int]) -> Callable[..., None]:
    """Call a Triton kernel on `grid`, or a CPU port as it is; drop keyword arguments the kernel lacks."""
    names = set(getattr(kernel, "arg_names", None) or inspect.signature(kernel).parameters)

    def launch(*args: Any, **kwargs: Any) -> None:
        kept = {k: v for k, v in kwargs.items() if k in names}
        if hasattr(kernel, "arg_names"):
            kernel[grid](*args, **kept)
        else:
            kernel(*args, **kept)

    return launch


def _metadata(harness: ModuleType, cache: Any, device: str) -> list[Any]:
    meta = list(harness.kernel_metadata(cache))
    return [m.to(device) if isinstance(m, torch.Tensor) else m for m in meta]


def _same(a: Any, b: Any) -> bool:
    return all(
        torch.equal(x.cpu().view(torch.uint8), y.cpu().view(torch.uint8))
        for x, y in zip(a.buffers, b.buffers, strict=True)
    )


def compare(
    seed: int, harness: ModuleType, ports: tuple[Any, Any], kernels: tuple[Any, Any], device: str
) -> tuple[bool, str]:
    """One random case through (postprocess, precopy): `ports` on host memory, `kernels` on `device`."""
    rng = random.Random(seed)
    specs, num_groups = harness.random_specs(rng)
    if device != "cpu":
        # vLLM's pages and state rows are 16-byte aligned; the harness's odd sizes (dim 1-9, 3 padding elements)
        # are fine for the port but make the Triton kernel's loads fault with "misaligned address".
        specs = [dataclasses.replace(s, dim=-(-s.dim // 16) * 16, padded=False) for s in specs]
    dim_first = rng.random() < 0.3
    block_size, num_spec = rng.choice([2, 4, 16]), rng.randint(1, 3)
    num_reqs = rng.randint(1, harness.MAX_REQS)
    blocks = harness.MAX_BLOCKS
    running = [rng.randint(1, (blocks - 2 * num_spec - 2) * block_size) for _ in range(harness.MAX_REQS)]
    accepted = [rng.randint(1, num_spec + 1) for _ in range(harness.MAX_REQS)]
    state_idx = [
        (r + a - 1) // block_size if rng.random() < 0.3 else (r - 1) // block_size
        for r, a in zip(running, accepted, strict=True)
    ]
    new_computed = [r + a - 1 for r, a in zip(running, accepted, strict=True)]
    port = harness.make_cache(specs, num_groups, dim_first, seed)
    other = _to(harness.make_cache(specs, num_groups, dim_first, seed), device)
    grid = (num_reqs, len(specs))
    i32 = harness.i32

    def post(cache: Any, kernel: Any, dev: str) -> list[int]:
        out = i32(accepted).to(dev)
        _launcher(kernel, grid)(
            i32(accepted).to(dev), i32(state_idx).to(dev), None, i32(new_computed).to(dev), None,
            *_metadata(harness, cache, dev), out, None, num_reqs,
            block_size=block_size, COPY_BLOCK_SIZE=1024, CONV_STATE_DIM_FIRST=dim_first,
            HAS_IDX_MAPPING=False, PRECOMPUTED_NEW_COMPUTED=True,
        )  # fmt: skip
        if dev != "cpu":
            torch.cuda.synchronize()
        return [int(x) for x in out.cpu().tolist()]

    port_out, other_out = post(port, ports[0], "cpu"), post(other, kernels[0], device)
    if port_out != other_out or not _same(port, other):
        return False, f"postprocess differs (accepted {port_out} vs {other_out})"

    src = [rng.choice([-1, rng.randint(0, blocks - num_spec - 2)]) for _ in range(harness.MAX_REQS)]
    dst = [s + rng.choice([0, 1, 2]) if s >= 0 else rng.randint(0, 3) for s in src]
    bias = [rng.randint(0, num_spec) for _ in range(harness.MAX_REQS)]
    mapping = list(range(num_reqs))

    def pre(cache: Any, kernel: Any, dev: str) -> None:
        _launcher(kernel, grid)(
            i32(dst).to(dev), i32(src).to(dev), i32(bias).to(dev), *_metadata(harness, cache, dev),
            i32(mapping).to(dev), num_reqs, COPY_BLOCK_SIZE=1024, CONV_STATE_DIM_FIRST=dim_first,
            HAS_IDX_MAPPING=True,
        )  # fmt: skip
        if dev != "cpu":
            torch.cuda.synchronize()

    pre(port, ports[1], "cpu")
    pre(other, kernels[1], device)
    if not _same(port, other):
        return False, "precopy differs"
    return True, f"{len(specs)} states, {num_groups} groups, block {block_size}, {num_reqs} requests"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m servers.gpu.compare_kernels", description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=200)
    p.add_argument("--cpu", action="store_true", help="run the port on both sides (no GPU, no Triton)")
    args = p.parse_args(argv)
    ports = (cpu_kernels.postprocess_mamba_fused_kernel, cpu_kernels.precopy_mamba_align_fused_kernel)
    if args.cpu:
        triton_kernels, device = ports, "cpu"
    else:
        from vllm.v1.worker import mamba_utils

        triton_kernels = (mamba_utils.postprocess_mamba_fused_kernel, mamba_utils.precopy_mamba_align_fused_kernel)
        device = "cuda"
    harness = _harness()
    failures = 0
    for seed in range(args.seeds):
        ok, what = compare(seed, harness, ports, triton_kernels, device)
        failures += not ok
        print(f"seed {seed}: {'same' if ok else 'DIFFERENT'}: {what}", flush=True)
    print(f"{args.seeds - failures} of {args.seeds} cases byte-identical ({device})")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
