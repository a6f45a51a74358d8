"""Fault injection: make vLLM 0.32 corrupt Mamba prefix-cache state the way real bugs did.

A fault is a known-bad engine for testing the tester: it shows whether a tester that reports "clean" would
have seen a real corruption. Enabled only when ``BLACKBOX_VLLM_PLUGINS`` names ``faults`` *and*
``BLACKBOX_FAULT`` names one fault (``servers.launch --fault NAME`` sets both for the treatment); an
unknown name stops the server at start-up with the list of known ones.

Every fault corrupts *state*, never text: it changes which recurrent (Mamba/GDN) state a request resumes
from, or what state a cached block holds, by monkeypatching vLLM internals. The output then goes wrong
the way it did in the field (lost or doubled context), through the model itself.

- ``eagle-overrun`` (A2; vLLM #43559, #57128): with EAGLE/MTP the attention groups drop the last matched
  block and the hybrid coordinator caps the combined hit at that length L, but the Mamba group ignored
  ``drop_eagle_block`` and kept the checkpoint one block further. The request resumes at L with the
  state of L + block_size: a block of tokens is consumed twice.
- ``chunk-end-as-boundary`` (A1; #45477, #47861, fixed by #51113): a prefill chunk that ends mid-block
  leaves its chunk-end state where a block-boundary snapshot is published, so the boundary's cache entry
  holds a state that has consumed other tokens. In #45477 the slot kept state@e and was hashed as the
  boundary after e; vLLM 0.32 re-aligns chunk ends, so here the chunk-end state overwrites the snapshot
  of the boundary b before it (a hit on b resumes having consumed tokens b..e already). It fires only
  when chunking is fragmented (a chunk starts exactly on a boundary the request materialized itself and
  ends mid-block), as the real bug did: "a single request is accidentally safe", its low slots are null.
- ``stale-checkpoint``: a hit restores the checkpoint of the block before the one it matched (the state
  of L - block_size handed over for a hit of length L): a block of context is lost.

The hit faults fire only where vLLM cached a Mamba checkpoint at the shifted boundary. In align mode a
prefill materializes one checkpoint per chunk and decode one per boundary it crosses (some are missing),
so they fire on hits that end in the decode-written region, not on hits at a lone prompt checkpoint;
likewise ``chunk-end-as-boundary`` shows only on a hit at a poisoned boundary (with MTP a resend of the
same prompt hits one block lower, a turn 2 or a longer sibling reaches it).

Every fire (a state handed over or stored that the clean engine would not have) is counted per process
and logged as ``BLACKBOX_FAULT fired name=<fault> count=<n>`` on the ``vllm.blackbox`` logger at WARNING,
so a test can tell "the fault never fired" from "the tester missed it"; ``fired_counts`` reads a log.

Where the patches live (each is idempotent, marked with ``__blackbox_fault__``):

- hit substitution (``eagle-overrun``, ``stale-checkpoint``): ``KVCacheManager.get_computed_blocks`` in the
  EngineCore process, where the scheduler owns the KV-cache manager. It swaps the last block of each Mamba
  group's hit for the cached block of the shifted boundary; block bookkeeping (ref counts, eviction)
  then follows the swapped block, and the worker's align pre-copy restores the request's state from it.
- chunk-end snapshot (``chunk-end-as-boundary``): ``mamba_utils.preprocess_mamba`` and
  ``mamba_utils.postprocess_mamba_align_gpu`` in the worker process (the V1 runner calls both through the
  module). The first plans the copies for this step's chunks, the second runs them after the forward
  pass, with tensor copies (any device). It needs align mode with speculative decoding, like the bug.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
import os
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

__all__ = [
    "FAULTS",
    "FAULT_ENV",
    "Fault",
    "FaultCounter",
    "chunk_end_copy",
    "fired_counts",
    "install",
    "selected_fault",
    "shifted_boundary_index",
    "substitute_mamba_hit",
]

FAULT_ENV = "BLACKBOX_FAULT"

# The parent plugin's logger: under "vllm" so lines go through vLLM's handler in every server process.
logger = logging.getLogger("vllm.blackbox")

FIRED_LINE = "BLACKBOX_FAULT fired name={name} count={count}"
_FIRED_RE = re.compile(r"BLACKBOX_FAULT fired name=(\S+) count=(\d+)")

# Attribute that marks a patched function with the fault that installed it (idempotence).
_MARK = "__blackbox_fault__"
_MANAGER_MODULE = "vllm.v1.core.kv_cache_manager"
_MAMBA_UTILS_MODULE = "vllm.v1.worker.mamba_utils"
_SEEN_CAP = 1 << 16  # keys remembered for de-duplicating fires (request ids)


def fired_counts(log_text: str) -> dict[str, int]:
    """The highest ``count`` logged per fault name in a server log (each process counts on its own)."""
    counts: dict[str, int] = {}
    for name, count in _FIRED_RE.findall(log_text):
        counts[name] = max(counts.get(name, 0), int(count))
    return counts


class _HashList(Protocol):
    """What lookups need of a block-hash list (vLLM also passes lazy block-size views)."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int, /) -> Any: ...


class FaultCounter:
    """Counts one fault's fires in this process and logs each one; a key fires at most once."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.count = 0
        self._seen: OrderedDict[Hashable, None] = OrderedDict()
        self._lock = threading.Lock()

    def fire(self, key: Hashable | None = None) -> bool:
        """Record one fire (once per ``key`` when given); True if it was counted."""
        with self._lock:
            if key is not None:
                if key in self._seen:
                    return False
                self._seen[key] = None
                if len(self._seen) > _SEEN_CAP:
                    self._seen.popitem(last=False)
            self.count += 1
            count = self.count
        logger.warning(FIRED_LINE.format(name=self.name, count=count))
        return True


@dataclass(frozen=True)
class Fault:
    name: str
    mechanism: str
    installer: Callable[[FaultCounter], None]


# ---------------------------------------------------------------------------------------------------------
# Hit substitution: eagle-overrun (+1 block) and stale-checkpoint (-1 block)


def shifted_boundary_index(hit_length: int, shift_tokens: int, unit: int, num_hashes: int) -> int | None:
    """Index into the block-hash list (``unit`` tokens per hash) of the boundary ``hit_length + shift``.

    None when there is no such cached boundary to look up: no hit, a shifted boundary at or below 0, off
    the unit grid, or past the request's hashed tokens.
    """
    target = hit_length + shift_tokens
    if hit_length <= 0 or target <= 0 or target % unit:
        return None
    index = target // unit - 1
    return index if index < num_hashes else None


def substitute_mamba_hit(
    blocks_by_group: Sequence[list[Any]],
    group_ids: Sequence[int],
    block_hashes: _HashList,
    hit_length: int,
    shift_tokens: int,
    block_size: int,
    unit: int,
    get_cached_block: Callable[[Any, list[int]], list[Any] | None],
) -> bool:
    """Replace the hit block of Mamba groups ``group_ids`` by the cached block of the shifted boundary.

    ``blocks_by_group[g]`` is group g's hit (null padding, then the block holding the state at
    ``hit_length``). Changes nothing and returns False unless every group's hit ends in a real block at
    the boundary, the shifted boundary is cached for all of them, and that is a different block.
    """
    num_blocks = -(-hit_length // block_size)
    hits = [blocks_by_group[g] for g in group_ids]
    if hit_length <= 0 or not hits or any(len(h) != num_blocks or h[-1].is_null for h in hits):
        return False
    index = shifted_boundary_index(hit_length, shift_tokens, unit, len(block_hashes))
    if index is None:
        return False
    cached = get_cached_block(block_hashes[index], list(group_ids))
    if cached is None or all(new is h[-1] for new, h in zip(cached, hits, strict=True)):
        return False
    for new, h in zip(cached, hits, strict=True):
        h[-1] = new
    return True


def _shift_hit(manager: Any, request: Any, result: Any, shift_blocks: int, require_eagle: bool) -> bool:
    """Apply ``substitute_mamba_hit`` to every Mamba group of a hybrid coordinator's granted hit."""
    from vllm.v1.core.kv_cache_utils import resolve_block_hashes
    from vllm.v1.core.single_type_kv_cache_manager import MambaManager

    kv_blocks, hit_length = result[0], result[1]
    coordinator = manager.coordinator
    groups = getattr(coordinator, "attention_groups", None)  # only the hybrid coordinator has them
    if hit_length <= 0 or groups is None or (require_eagle and not coordinator.eagle_group_ids):
        return False
    alignment = coordinator._cache_hit_alignment_tokens
    changed = False
    for spec, group_ids, manager_cls, _use_eagle in groups:
        if not issubclass(manager_cls, MambaManager):
            continue
        group_manager = coordinator.single_type_managers[group_ids[0]]
        block_size = group_manager.block_size
        block_pool = group_manager.block_pool
        # The Mamba finder's own view of the hashes and its hit granularity.
        hashes = resolve_block_hashes(
            request.block_hashes,
            block_pool.hash_block_size,
            spec.block_size,
            supports_fine_grained_hash_lookup=manager_cls.supports_fine_grained_hash_lookup,
            alignment_tokens=alignment,
        )
        fine = alignment < block_size and block_size % alignment == 0
        changed |= substitute_mamba_hit(
            kv_blocks.blocks,
            group_ids,
            hashes,
            hit_length,
            shift_blocks * block_size,
            block_size,
            alignment if fine else block_size,
            block_pool.get_cached_block,
        )
    return changed


def _install_hit_shift(counter: FaultCounter, shift_blocks: int, require_eagle: bool) -> None:
    module = importlib.import_module(_MANAGER_MODULE)
    cls = module.KVCacheManager

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def get_computed_blocks(self: Any, request: Any) -> Any:
            result = original(self, request)
            if _shift_hit(self, request, result, shift_blocks, require_eagle):
                # One count per request: a waiting request may be looked up again before it runs.
                counter.fire(request.request_id)
            return result

        return get_computed_blocks

    _patch(cls, "get_computed_blocks", make, counter.name)


def _install_eagle_overrun(counter: FaultCounter) -> None:
    """The Mamba hit is the checkpoint one block past the eagle-capped hit length (A2)."""
    _install_hit_shift(counter, shift_blocks=1, require_eagle=True)


def _install_stale_checkpoint(counter: FaultCounter) -> None:
    """The Mamba hit is the checkpoint one block before the matched one."""
    _install_hit_shift(counter, shift_blocks=-1, require_eagle=False)


# ---------------------------------------------------------------------------------------------------------
# chunk-end-as-boundary (worker side)


def chunk_end_copy(
    start: int, end: int, num_drafts: int, num_prompt_tokens: int, origin: int | None, block_size: int
) -> tuple[int, int] | None:
    """(source column, destination column) of the A1 copy for a chunk [start, end), or None.

    The chunk must be a prefill chunk (no drafts, inside the prompt) that starts exactly at a block
    boundary b and ends mid-block: the align invariant "column p holds the state after (p + 1) *
    block_size tokens" then has column b / block_size - 1 holding this request's own state at b (the
    previous chunk ended there; ``origin``, the request's cache hit length, is below b so the block is not
    a shared hit). The chunk-end state lives in the running column ``end // block_size``. The request
    still owns the boundary block during this step (vLLM frees it on processed tokens, after the step).
    """
    if num_drafts or origin is None or end > num_prompt_tokens or end % block_size == 0:
        return None
    boundary = end // block_size * block_size
    if boundary == 0 or start != boundary or origin >= boundary:
        return None
    return end // block_size, boundary // block_size - 1


@dataclass
class _PendingCopy:
    req_id: str
    block_ids: tuple[list[int], ...]  # the request's per-group block ids (the runner's live lists)
    src_col: int
    dst_col: int


class _ChunkEndFault:
    """Plans copies in ``preprocess_mamba`` (this step's chunks) and runs them after the forward pass."""

    NULL_BLOCK_ID = 0  # vLLM's null block is the pool's first block

    def __init__(self, counter: FaultCounter) -> None:
        self.counter = counter
        self.origins: dict[str, int] = {}  # req id -> num_computed_tokens when first scheduled
        self.pending: list[_PendingCopy] = []
        self.group_ids: list[int] = []

    def plan(self, scheduler_output: Any, input_batch: Any, requests: Any, copy_bufs: Any) -> None:
        self.pending = []
        for new_req in scheduler_output.scheduled_new_reqs:
            self.origins[new_req.req_id] = new_req.num_computed_tokens
        for req_id in (*scheduler_output.finished_req_ids, *(scheduler_output.preempted_req_ids or ())):
            self.origins.pop(req_id, None)
        self.group_ids = list(copy_bufs.mamba_group_ids)
        block_size = copy_bufs.mamba_spec.block_size
        drafts = scheduler_output.scheduled_spec_decode_tokens
        for req_id in input_batch.req_ids:
            req_state = requests[req_id]
            start = req_state.num_computed_tokens
            end = start + scheduler_output.num_scheduled_tokens.get(req_id, 0)
            cols = chunk_end_copy(
                start,
                end,
                len(drafts.get(req_id, ())),
                req_state.num_prompt_tokens,
                self.origins.get(req_id),
                block_size,
            )
            if cols is not None:
                self.pending.append(_PendingCopy(req_id, req_state.block_ids, *cols))

    def run(self, kv_cache_config: Any, forward_context: dict[str, Any]) -> None:
        pending, self.pending = self.pending, []
        for copy in pending:
            copied = False
            for gid in self.group_ids:
                ids = copy.block_ids[gid]
                if max(copy.src_col, copy.dst_col) >= len(ids):
                    continue
                src, dst = ids[copy.src_col], ids[copy.dst_col]
                if self.NULL_BLOCK_ID in (src, dst) or src == dst:
                    continue
                for layer_name in kv_cache_config.kv_cache_groups[gid].layer_names:
                    for state in forward_context[layer_name].kv_cache:
                        state[dst].copy_(state[src])  # conv window and temporal state, whole
                copied = True
            if copied:
                self.counter.fire((copy.req_id, copy.dst_col))


def _install_chunk_end_as_boundary(counter: FaultCounter) -> None:
    """The chunk-end state of a fragmented prefill overwrites the boundary snapshot before it (A1)."""
    module = importlib.import_module(_MAMBA_UTILS_MODULE)
    fault = _ChunkEndFault(counter)

    def make_pre(original: Callable[..., Any]) -> Callable[..., Any]:
        signature = inspect.signature(original)

        @functools.wraps(original)
        def preprocess_mamba(*args: Any, **kwargs: Any) -> Any:
            bound = signature.bind(*args, **kwargs).arguments
            fault.plan(bound["scheduler_output"], bound["input_batch"], bound["requests"], bound["copy_bufs"])
            return original(*args, **kwargs)

        return preprocess_mamba

    def make_post(original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def postprocess_mamba_align_gpu(**kwargs: Any) -> Any:
            result = original(**kwargs)
            fault.run(kwargs["kv_cache_config"], kwargs["forward_context"])
            return result

        return postprocess_mamba_align_gpu

    _patch(module, "preprocess_mamba", make_pre, counter.name)
    _patch(module, "postprocess_mamba_align_gpu", make_post, counter.name)


# ---------------------------------------------------------------------------------------------------------
# Registry and installation

FAULTS: dict[str, Fault] = {
    f.name: f
    for f in (
        Fault("eagle-overrun", "A2: Mamba hit one block past the eagle-capped hit", _install_eagle_overrun),
        Fault(
            "chunk-end-as-boundary",
            "A1: mid-block chunk-end state stored as the boundary snapshot",
            _install_chunk_end_as_boundary,
        ),
        Fault("stale-checkpoint", "hit restores the checkpoint one block before", _install_stale_checkpoint),
    )
}

_counters: dict[str, FaultCounter] = {}


def _patch(owner: Any, attr: str, make: Callable[[Callable[..., Any]], Callable[..., Any]], fault: str) -> bool:
    """Replace ``owner.attr`` by ``make(original)`` unless a fault already patched it; True if patched."""
    current = getattr(owner, attr)
    if getattr(current, _MARK, None) is not None:
        return False
    wrapper = make(current)
    setattr(wrapper, _MARK, fault)
    setattr(owner, attr, wrapper)
    return True


def selected_fault() -> str | None:
    """The fault named by BLACKBOX_FAULT, or None when unset or blank."""
    return os.environ.get(FAULT_ENV, "").strip() or None


def install() -> str | None:
    """Install the fault named by BLACKBOX_FAULT; its name, or None if none is named.

    Raises ValueError for an unknown name (vLLM then stops at start-up with this message). Installing
    twice, in one process or across vLLM's processes, patches each function once and shares one counter.
    """
    name = selected_fault()
    if name is None:
        logger.warning("blackbox faults: enabled but %s is unset; nothing injected", FAULT_ENV)
        return None
    fault = FAULTS.get(name)
    if fault is None:
        raise ValueError(f"{FAULT_ENV}={name!r} names no known fault; known faults: {', '.join(FAULTS)}")
    counter = _counters.setdefault(name, FaultCounter(name))
    fault.installer(counter)
    logger.warning("blackbox faults: injecting %s (%s)", name, fault.mechanism)
    return name
