"""The CPU ports of vLLM's align-mode Mamba copy kernels against an independent reference.

The ports work on raw addresses, like the Triton kernels. The reference here works on tensors
instead: it slices the state tensors by block id in plain loops over requests, layers and states.
Both run on identical copies of the same cache, and the whole backing storage (page padding included)
must come out byte-identical.
"""

from __future__ import annotations

import ast
import importlib.util
import random
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import servers.vllm_plugin as plugin
from servers.vllm_plugin.cpu_kernels import (
    PORTS,
    ports,
    postprocess_mamba_fused_kernel,
    precopy_mamba_align_fused_kernel,
)

MAX_REQS = 8
MAX_BLOCKS = 12
NUM_BLOCKS = MAX_REQS * MAX_BLOCKS + 1  # block 0 stays unused, as vLLM's null block


@dataclass
class StateSpec:
    kind: str  # "conv" or "temporal"
    group: int
    dtype: torch.dtype
    conv_width: int = 3
    dim: int = 5
    padded: bool = False  # temporal page stride larger than the state (vLLM's as_strided pages)


@dataclass
class Cache:
    specs: list[StateSpec]
    buffers: list[torch.Tensor]  # backing storage, compared whole
    states: list[torch.Tensor]  # [NUM_BLOCKS, ...] views of the buffers
    block_tables: list[torch.Tensor]  # per group, int32 [MAX_REQS, MAX_BLOCKS]
    dim_first: bool


def make_cache(specs: list[StateSpec], num_groups: int, dim_first: bool, seed: int) -> Cache:
    """A deterministic cache: equal seeds give equal contents. Requests never share a block."""
    gen = torch.Generator().manual_seed(seed)
    buffers, states = [], []
    for spec in specs:
        if spec.kind == "conv":
            shape = (spec.dim, spec.conv_width) if dim_first else (spec.conv_width, spec.dim)
            page = shape[0] * shape[1]
        else:
            shape = (2, spec.dim)
            page = 2 * spec.dim + (3 if spec.padded else 0)
        buffer = torch.randint(-100, 100, (NUM_BLOCKS * page,), generator=gen).to(spec.dtype)
        stride = (page, shape[1], 1)
        buffers.append(buffer)
        states.append(buffer.as_strided((NUM_BLOCKS, *shape), stride))
    block_tables = []
    for _ in range(num_groups):
        ids = torch.randperm(NUM_BLOCKS - 1, generator=gen)[: MAX_REQS * MAX_BLOCKS] + 1
        block_tables.append(ids.to(torch.int32).reshape(MAX_REQS, MAX_BLOCKS))
    return Cache(specs, buffers, states, block_tables, dim_first)


# (block_table_ptrs, block_table_stride_req, then 8 flattened per-state metadata tensors)
Metadata = tuple[
    torch.Tensor,
    int,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
]


def kernel_metadata(cache: Cache) -> Metadata:
    """The block-table and flattened state arguments, built the way vLLM's _populate_metadata does."""
    base, block_stride, elem, inner, width, group, rows, row_stride = ([] for _ in range(8))
    for spec, state in zip(cache.specs, cache.states, strict=True):
        base.append(state.data_ptr())
        block_stride.append(state.stride(0) * state.element_size())
        elem.append(state.element_size())
        group.append(spec.group)
        if spec.kind == "temporal":
            width.append(0)
            inner.append(state[0].numel())
            rows.append(0)
            row_stride.append(0)
        elif cache.dim_first:
            width.append(state.size(2))
            inner.append(1)
            rows.append(state.size(1))
            row_stride.append(state.stride(1) * state.element_size())
        else:
            width.append(state.size(1))
            inner.append(state.stride(1))
            rows.append(0)
            row_stride.append(0)
    i32, i64 = torch.int32, torch.int64
    return (
        torch.tensor([bt.data_ptr() for bt in cache.block_tables], dtype=i64),
        cache.block_tables[0].stride(0),
        torch.tensor(base, dtype=i64),
        torch.tensor(block_stride, dtype=i64),
        torch.tensor(elem, dtype=i32),
        torch.tensor(inner, dtype=i64),
        torch.tensor(width, dtype=i32),
        torch.tensor(group, dtype=i32),
        torch.tensor(rows, dtype=i32),
        torch.tensor(row_stride, dtype=i64),
    )


def reference_copy(cache: Cache, row: int, src_col: int, dst_col: int, bias: int) -> None:
    """conv: slide the window left by `bias` tokens; temporal: take the state `bias` columns on.
    `row`: the block-table row the columns index."""
    for spec, state in zip(cache.specs, cache.states, strict=True):
        bt = cache.block_tables[spec.group][row].tolist()
        if spec.kind == "temporal":
            state[bt[dst_col]] = state[bt[src_col + bias]].clone()
            continue
        keep = spec.conv_width - bias
        if keep <= 0:
            continue
        if cache.dim_first:
            state[bt[dst_col], :, :keep] = state[bt[src_col], :, bias:].clone()
        else:
            state[bt[dst_col], :keep] = state[bt[src_col], bias:].clone()


def reference_postprocess(
    cache: Cache,
    batch: list[int],
    accepted: list[int],
    state_idx: list[int],
    new_computed: list[int],
    block_size: int,
    rows_by_batch: bool = False,
) -> list[int]:
    """Returns the new accepted counts. new_computed: tokens computed after this step's acceptance.
    rows_by_batch: block tables are indexed by position in `batch` (vLLM <= 0.31), else by request slot."""
    out = list(accepted)
    for position, req in enumerate(batch):
        if req < 0:
            continue
        running = new_computed[req] - accepted[req] + 1  # tokens in the running state before this step
        boundary = new_computed[req] // block_size * block_size
        if boundary < running:
            continue  # the accepted tokens reached no new block boundary
        dst_col = boundary // block_size - 1
        if dst_col == state_idx[req]:
            out[req] = 1
            if boundary == running:
                continue
        reference_copy(cache, position if rows_by_batch else req, state_idx[req], dst_col, boundary - running)
    return out


def reference_precopy(
    cache: Cache, batch: list[int], dst: list[int], src: list[int], bias: list[int], rows_by_batch: bool = False
) -> None:
    for position, req in enumerate(batch):
        if req >= 0 and src[req] >= 0 and src[req] != dst[req]:
            reference_copy(cache, position if rows_by_batch else req, src[req], dst[req], bias[req])


def assert_same(port: Cache, ref: Cache) -> None:
    for a, b in zip(port.buffers, ref.buffers, strict=True):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def i32(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


# Group 0: a conv and a temporal state per layer, two layers (mamba2-like, bf16 and fp32).
# Group 1: one temporal state with page padding (GDN-like, one byte elements to test odd sizes).
SPECS = [
    StateSpec("conv", 0, torch.bfloat16),
    StateSpec("temporal", 0, torch.float32),
    StateSpec("conv", 0, torch.bfloat16),
    StateSpec("temporal", 0, torch.float32),
    StateSpec("temporal", 1, torch.int8, dim=7, padded=True),
]


@pytest.mark.parametrize("dim_first", [False, True])
def test_postprocess_v1_crafted(dim_first: bool) -> None:
    # block_size 4, two draft tokens per step; one request per case:
    #   0: accepted tokens stay inside the block            -> nothing
    #   1: crosses into the next block, bias 1              -> copy bt[2] -> bt[1]
    #   2: lands exactly on the running block's boundary    -> counter reset only
    #   3: src == dst with bias 2 (same-block conv shift)   -> overlapping copy, counter reset
    #   4: exactly aligned, different column, bias 0        -> plain copy bt[1] -> bt[0]
    #   5: beyond num_reqs                                   -> untouched
    computed = [5, 6, 7, 5, 3, 6]
    scheduled = [3, 3, 1, 3, 1, 3]
    drafts = [2, 2, 0, 2, 0, 2]
    accepted = [1, 3, 1, 3, 1, 3]
    state_idx = [1, 2, 1, 1, 1, 2]
    num_reqs = 5
    port = make_cache(SPECS, 2, dim_first, seed=1)
    ref = make_cache(SPECS, 2, dim_first, seed=1)
    out = i32(accepted)
    postprocess_mamba_fused_kernel(
        i32(accepted),
        i32(state_idx),
        i32(scheduled),
        i32(computed),
        i32(drafts),
        *kernel_metadata(port),
        out,
        None,
        num_reqs,
        block_size=4,
        COPY_BLOCK_SIZE=1024,
        CONV_STATE_DIM_FIRST=dim_first,
        TEMPORAL_TILES=16,
    )
    new_computed = [c + s - d + a - 1 for c, s, d, a in zip(computed, scheduled, drafts, accepted, strict=True)]
    expected = reference_postprocess(ref, list(range(num_reqs)), accepted, state_idx, new_computed, 4)
    assert out.tolist() == expected == [1, 3, 1, 1, 1, 3]
    assert_same(port, ref)
    assert not all(
        torch.equal(a, b) for a, b in zip(port.buffers, make_cache(SPECS, 2, dim_first, 1).buffers, strict=True)
    )


def test_postprocess_v2_idx_mapping_precomputed() -> None:
    # V2 flavour: batch rows map to request slots (-1 skips), new_num_computed is given directly, and
    # the counters are read from a snapshot and written to a separate tensor.
    mapping = [6, -1, 2, 0]
    new_computed = [9, 0, 8, 0, 0, 0, 12, 0]
    accepted = [3, 1, 1, 1, 1, 1, 2, 1]
    state_idx = [2, 0, 1, 0, 0, 0, 2, 0]
    port = make_cache(SPECS, 2, False, seed=2)
    ref = make_cache(SPECS, 2, False, seed=2)
    out = i32(accepted)
    postprocess_mamba_fused_kernel(
        i32(accepted),
        i32(state_idx),
        None,
        i32(new_computed),
        None,
        *kernel_metadata(port),
        out,
        i32(mapping),
        len(mapping),
        block_size=4,
        COPY_BLOCK_SIZE=1024,
        CONV_STATE_DIM_FIRST=False,
        HAS_IDX_MAPPING=True,
        PRECOMPUTED_NEW_COMPUTED=True,
        TEMPORAL_TILES=16,
    )
    assert out.tolist() == reference_postprocess(ref, mapping, accepted, state_idx, new_computed, 4)
    assert_same(port, ref)


@pytest.mark.parametrize("use_mapping", [False, True])
def test_precopy_crafted(use_mapping: bool) -> None:
    # 0: fresh request (-1), 1: same block, 2: next block bias 0, 3: next block bias 2, 4: past num_reqs
    dst = [0, 2, 3, 4, 5]
    src = [-1, 2, 2, 3, 4]
    bias = [0, 1, 0, 2, 1]
    mapping = [3, 0, 2, 1] if use_mapping else None
    port = make_cache(SPECS, 2, False, seed=3)
    ref = make_cache(SPECS, 2, False, seed=3)
    precopy_mamba_align_fused_kernel(
        i32(dst),
        i32(src),
        i32(bias),
        *kernel_metadata(port),
        None if mapping is None else i32(mapping),
        4,
        COPY_BLOCK_SIZE=1024,
        CONV_STATE_DIM_FIRST=False,
        HAS_IDX_MAPPING=mapping is not None,
        TEMPORAL_TILES=16,
    )
    reference_precopy(ref, [0, 1, 2, 3] if mapping is None else mapping, dst, src, bias)
    assert_same(port, ref)


def test_no_states_and_no_requests_are_noops() -> None:
    empty = make_cache([], 1, False, seed=4)
    out = i32([2])
    postprocess_mamba_fused_kernel(
        i32([2]),
        i32([1]),
        i32([2]),
        i32([6]),
        i32([1]),
        *kernel_metadata(empty),
        out,
        None,
        1,
        block_size=4,
    )
    assert out.tolist() == [2]  # no state program 0 in the grid, so the kernel stores nothing
    port = make_cache(SPECS, 2, False, seed=5)
    precopy_mamba_align_fused_kernel(
        i32([3]), i32([1]), i32([0]), *kernel_metadata(port), None, 0, HAS_IDX_MAPPING=False
    )
    assert_same(port, make_cache(SPECS, 2, False, seed=5))


def random_specs(rng: random.Random) -> tuple[list[StateSpec], int]:
    num_groups = rng.randint(1, 3)
    specs = []
    for group in range(num_groups):
        for _ in range(rng.randint(1, 2)):  # layers
            if rng.random() < 0.6:
                specs.append(
                    StateSpec(
                        "conv",
                        group,
                        rng.choice([torch.bfloat16, torch.float32]),
                        conv_width=rng.randint(1, 4),
                        dim=rng.randint(1, 9),
                    )
                )
            specs.append(
                StateSpec(
                    "temporal",
                    group,
                    rng.choice([torch.int8, torch.float16, torch.float64]),
                    dim=rng.randint(1, 9),
                    padded=rng.random() < 0.5,
                )
            )
    return specs, num_groups


@pytest.mark.parametrize("seed", range(60))
def test_random_against_reference(seed: int) -> None:
    rng = random.Random(seed)
    specs, num_groups = random_specs(rng)
    dim_first = rng.random() < 0.3
    block_size, num_spec = rng.choice([2, 4, 16]), rng.randint(1, 3)
    num_reqs = rng.randint(1, MAX_REQS)
    mapping = rng.sample(range(MAX_REQS), num_reqs) if rng.random() < 0.5 else None
    if mapping is not None and num_reqs > 1:
        mapping[rng.randrange(num_reqs)] = -1
    batch = mapping if mapping is not None else list(range(num_reqs))

    # Postprocess: a running state somewhere in a block, then 1..num_spec+1 accepted tokens.
    running = [rng.randint(1, (MAX_BLOCKS - 2 * num_spec - 2) * block_size) for _ in range(MAX_REQS)]
    accepted = [rng.randint(1, num_spec + 1) for _ in range(MAX_REQS)]
    state_idx = [
        (r + a - 1) // block_size if rng.random() < 0.3 else (r - 1) // block_size
        for r, a in zip(running, accepted, strict=True)
    ]
    new_computed = [r + a - 1 for r, a in zip(running, accepted, strict=True)]
    port = make_cache(specs, num_groups, dim_first, seed)
    ref = make_cache(specs, num_groups, dim_first, seed)
    out = i32(accepted)
    postprocess_mamba_fused_kernel(
        i32(accepted),
        i32(state_idx),
        None,
        i32(new_computed),
        None,
        *kernel_metadata(port),
        out,
        None if mapping is None else i32(mapping),
        num_reqs,
        block_size=block_size,
        CONV_STATE_DIM_FIRST=dim_first,
        HAS_IDX_MAPPING=mapping is not None,
        PRECOMPUTED_NEW_COMPUTED=True,
    )
    assert out.tolist() == reference_postprocess(ref, batch, accepted, state_idx, new_computed, block_size)
    assert_same(port, ref)

    # Precopy on the result: previous running column -> a later or the same column.
    src = [rng.choice([-1, rng.randint(0, MAX_BLOCKS - num_spec - 2)]) for _ in range(MAX_REQS)]
    dst = [s + rng.choice([0, 1, 2]) if s >= 0 else rng.randint(0, 3) for s in src]
    bias = [rng.randint(0, num_spec) for _ in range(MAX_REQS)]
    precopy_mamba_align_fused_kernel(
        i32(dst),
        i32(src),
        i32(bias),
        *kernel_metadata(port),
        None if mapping is None else i32(mapping),
        num_reqs,
        CONV_STATE_DIM_FIRST=dim_first,
        HAS_IDX_MAPPING=mapping is not None,
    )
    reference_precopy(ref, batch, dst, src, bias)
    assert_same(port, ref)


def test_ports_mirror_kernel_parameters() -> None:
    # The dispatcher binds launches by the kernel's parameter names and order; read them from the
    # installed vLLM source (parsing, not importing, keeps this test fast).
    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.submodule_search_locations
    source = Path(next(iter(spec.submodule_search_locations)), "v1/worker/mamba_utils.py").read_text()
    kernels = {
        node.name: [arg.arg for arg in node.args.args]
        for node in ast.parse(source).body
        if isinstance(node, ast.FunctionDef)
    }
    for name, port in PORTS.items():
        assert list(port.__code__.co_varnames[: port.__code__.co_argcount]) == kernels[name], name


def test_register_is_inert_without_the_env_var(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    monkeypatch.setitem(plugin.INSTALLERS, "cpu-kernels", lambda: calls.append("cpu-kernels"))
    monkeypatch.delenv(plugin.ENV_VAR, raising=False)
    plugin.register()
    monkeypatch.setenv(plugin.ENV_VAR, "faults-not-yet, other")
    plugin.register()
    assert calls == []
    monkeypatch.setenv(plugin.ENV_VAR, " other , cpu-kernels,cpu-kernels")
    plugin.register()
    assert calls == ["cpu-kernels"]


@pytest.mark.parametrize("seed", range(12))
def test_batch_row_ports_against_reference(seed: int) -> None:
    # vLLM <= 0.31: a mapped launch reads the block table at the batch row, the counters at the slot.
    rng = random.Random(1000 + seed)
    postprocess, precopy = (ports(rows_by_batch=True)[name] for name in sorted(PORTS))
    block_size, num_reqs = 4, rng.randint(2, MAX_REQS)
    mapping = rng.sample(range(MAX_REQS), num_reqs)
    mapping[rng.randrange(num_reqs)] = -1
    running = [rng.randint(1, (MAX_BLOCKS - 4) * block_size) for _ in range(MAX_REQS)]
    accepted = [rng.randint(1, 3) for _ in range(MAX_REQS)]
    state_idx = [(r - 1) // block_size for r in running]
    new_computed = [r + a - 1 for r, a in zip(running, accepted, strict=True)]
    port = make_cache(SPECS, 2, False, seed)
    ref = make_cache(SPECS, 2, False, seed)
    out = i32(accepted)
    postprocess(
        i32(accepted), i32(state_idx), None, i32(new_computed), None, *kernel_metadata(port), out, i32(mapping),
        num_reqs, block_size=block_size, HAS_IDX_MAPPING=True, PRECOMPUTED_NEW_COMPUTED=True,
    )  # fmt: skip
    assert out.tolist() == reference_postprocess(ref, mapping, accepted, state_idx, new_computed, block_size, True)
    assert_same(port, ref)
    src = [rng.randint(0, MAX_BLOCKS - 4) for _ in range(MAX_REQS)]
    dst = [s + rng.choice([0, 1, 2]) for s in src]
    bias = [rng.randint(0, 2) for _ in range(MAX_REQS)]
    precopy(i32(dst), i32(src), i32(bias), *kernel_metadata(port), i32(mapping), num_reqs, HAS_IDX_MAPPING=True)
    reference_precopy(ref, mapping, dst, src, bias, rows_by_batch=True)
    assert_same(port, ref)
    # The two row rules differ here, so the test can tell them apart.
    assert any(req not in (-1, position) for position, req in enumerate(mapping))
