"""The CPU port of the MTP proposer's slot-mapping step against an independent reference.

The reference re-reads the Triton kernel one program at a time, in plain Python over lists and a flat
block-table buffer indexed by `row * stride + column`, exactly as the kernel's pointer arithmetic does.
"""

from __future__ import annotations

import ast
import importlib.util
import random
from pathlib import Path

import pytest
import torch

from servers.vllm_plugin.eagle_step import eagle_step_slot_mapping_metadata_kernel

PAD = -1


def reference(
    positions: list[int],
    flat_table: list[int],
    stride: int,
    seq_lens: list[int],
    out_positions: list[int],
    out_slots: list[int],
    block_size: int,
    max_model_len: int,
    n_blocks: int,
    batch_size: int,
    programs: int,
) -> None:
    """One Triton program per slot; reads positions and seq_lens before the outputs are written."""
    read_positions, read_seq = list(positions), list(seq_lens)
    for req in range(programs):
        if req >= batch_size:
            out_slots[req] = PAD
            continue
        new = read_positions[req] + 1
        exceeds = new >= max_model_len
        clamped = 0 if exceeds else new
        block_number = min(clamped // block_size, n_blocks - 1)
        block_id = flat_table[req * stride + block_number]
        slot = PAD if exceeds else block_id * block_size + clamped % block_size
        seq = 1 if exceeds else read_seq[req] + 1
        out_positions[req] = clamped
        out_slots[req] = slot
        seq_lens[req] = min(seq, max_model_len)


def run_case(rng: random.Random, alias_positions: bool) -> None:
    block_size = rng.choice([1, 4, 16, 128])
    max_model_len = rng.choice([block_size * 3, 64, 4096])
    n_blocks = -(-max_model_len // block_size)
    stride = n_blocks + rng.randint(0, 3)  # a wider persistent table, viewed narrower
    batch = rng.randint(1, 6)
    programs = batch + rng.randint(0, 3)
    wide = torch.randint(1, 1000, (batch + 2, stride), dtype=torch.int32)
    table = wide[:batch, :n_blocks]
    # Positions near the end of the model's length, so some requests exceed it.
    positions = [rng.randint(max(0, max_model_len - 3), max_model_len - 1) if rng.random() < 0.3 else
                 rng.randint(0, max_model_len - 2) for _ in range(batch)]  # fmt: skip
    seq_lens = [p + 1 for p in positions]
    pos_t = torch.tensor(positions, dtype=torch.int64)
    seq_t = torch.tensor(seq_lens, dtype=torch.int32)
    out_pos_t = pos_t if alias_positions else torch.full((batch,), 7, dtype=torch.int64)
    out_slot_t = torch.full((programs + 2,), 99, dtype=torch.int64)[:programs]

    ref_out_pos = list(positions) if alias_positions else [7] * batch
    ref_slots = [99] * programs
    ref_seq = list(seq_lens)
    flat = wide.flatten().tolist()
    reference(positions, flat, stride, ref_seq, ref_out_pos, ref_slots, block_size, max_model_len, n_blocks, batch,
              programs)  # fmt: skip

    eagle_step_slot_mapping_metadata_kernel(
        pos_t, table, table.stride(0), seq_t, out_pos_t, out_slot_t,
        block_size, max_model_len, n_blocks, PAD, batch, num_programs=programs,
    )  # fmt: skip
    assert out_pos_t.tolist() == ref_out_pos
    assert out_slot_t.tolist() == ref_slots
    assert seq_t.tolist() == ref_seq


@pytest.mark.parametrize("seed", range(40))
def test_random_against_reference(seed: int) -> None:
    run_case(random.Random(seed), alias_positions=seed % 2 == 0)


def test_crafted_edges() -> None:
    # block 4, max_model_len 10: req 0 moves inside a block, req 1 crosses into block 2, req 2 hits the
    # limit (position 0, PAD slot, seq_len 1), req 3 lands in the table's last block and its seq_len reaches
    # the limit; slot 4 is padding. The aliased positions buffer is read before it is overwritten.
    table = torch.tensor([[11, 12, 13], [21, 22, 23], [31, 32, 33], [41, 42, 43]], dtype=torch.int32)
    positions = torch.tensor([1, 7, 9, 8], dtype=torch.int64)
    seq_lens = torch.tensor([2, 8, 10, 9], dtype=torch.int32)
    slots = torch.zeros(5, dtype=torch.int64)
    eagle_step_slot_mapping_metadata_kernel(positions, table, 3, seq_lens, positions, slots, 4, 10, 3, PAD, 4)
    assert positions.tolist() == [2, 8, 0, 9]
    assert slots.tolist() == [11 * 4 + 2, 23 * 4 + 0, PAD, 43 * 4 + 1, PAD]
    assert seq_lens.tolist() == [3, 9, 1, 10]


def test_port_mirrors_kernel_parameters() -> None:
    # The JIT owner binds launch arguments to the kernel's names; read them from the installed vLLM.
    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.submodule_search_locations
    source = Path(next(iter(spec.submodule_search_locations)), "v1/spec_decode/utils.py").read_text()
    kernel = next(
        node
        for node in ast.parse(source).body
        if isinstance(node, ast.FunctionDef) and node.name == "eagle_step_slot_mapping_metadata_kernel"
    )
    code = eagle_step_slot_mapping_metadata_kernel.__code__
    assert list(code.co_varnames[: code.co_argcount]) == [a.arg for a in kernel.args.args]
