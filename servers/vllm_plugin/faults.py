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
- ``concurrent-resume`` (the A3 family; #53919, #51571: a request handed state that belongs to another one in
  flight, seen only with several running requests): ``stale-checkpoint``, but only for a hit whose last block
  another running request holds at lookup (its reference count is above 0 before this request takes it), so
  only requests that resume from one cached prefix at the same time are wrong; one that resumes alone is exact.
- ``preempted-resume`` (the load family; #53919's corruption appeared only with several running requests, and
  under memory pressure vLLM preempts a running request, frees its blocks and later reschedules it, looking up
  its own prompt and answer so far in the prefix cache): a request rescheduled after a preemption that finds a hit
  resumes from the Mamba checkpoint cached last at another boundary (usually another request's state), so only a
  server whose KV cache is too small for its load resumes wrong. (Not ``stale-checkpoint``'s block before: by the
  time a preempted request is rescheduled, the pressure that preempted it has evicted every earlier checkpoint of
  it; on the CPU pair none was ever cached, and that form of this fault never fired.)
- ``recycled-block`` (the load family: under memory pressure cached blocks are evicted and their memory written
  again while other requests resume; SGLang #36537 lost eagerly materialized state that way): ``stale-checkpoint``,
  but only for a hit whose last block had a cached block evicted from it before (``BlockPool`` re-allocated it), so
  only a server whose cache is too small for its load resumes wrong.
- ``short-continuation`` (the A6 family: a prefill shorter than the drafter's lookahead, in a batch with decodes,
  handled as if it were a decode step): ``stale-checkpoint``, but only for a hit on a prompt that continues a
  finished request's whole sequence (its prompt and its answer) by at most ``SHORT_TOKENS`` tokens, so only a
  follow-up of 1-2 tokens after a decode-region hit resumes wrong. A follow-up that asks a question (the multi-turn
  and held-prefix probes' turn 2: the chat template alone adds more) or a repeat of a prompt is exact.
- ``offset-miss`` (the silent-0%-hit family; #54360, #45238, #40696): a prompt that ends from a quarter to
  three eighths of a block past a boundary gets no hit at all, as if prefix caching were off for it; every other
  prompt hits as before. No state and no answer is wrong: only the hit rate, and the coverage of every probe
  whose prompts end there, silently drop.

The hit faults fire only where vLLM cached a Mamba checkpoint at the shifted boundary. In align mode a
prefill materializes one checkpoint per chunk and decode one per boundary it crosses (some are missing),
so they fire on hits that end in the decode-written region, not on hits at a lone prompt checkpoint;
likewise ``chunk-end-as-boundary`` shows only on a hit at a poisoned boundary (with MTP a resend of the
same prompt hits one block lower, a turn 2 or a longer sibling reaches it).

Every fire (a state handed over or stored that the clean engine would not have) is counted per process
and logged as ``BLACKBOX_FAULT fired name=<fault> count=<n>`` on the ``vllm.blackbox`` logger at WARNING,
so a test can tell "the fault never fired" from "the tester missed it"; ``fired_counts`` reads a log.

Sporadic faults. A real bug of this family corrupts some resumes, not all. ``BLACKBOX_FAULT_SPORADIC`` (a
fraction in [0, 1], default 1: every candidate fires) makes a fault fire on that fraction of its candidates
(each place where it could change a state), in one of two shapes (``BLACKBOX_FAULT_SHAPE``):

- ``block`` (default): a poisoned block. The draw is a seeded hash of the block's identity (the tokens up to
  the boundary the request resumes from, or whose snapshot is written), so every request that resumes from
  that block is wrong, and none that resumes from a sound one is.
- ``restore``: a transient fault. The draw is a seeded hash of the event (the request's tokens, the boundary,
  and how many times this process saw that same event before), so the same block is restored right one
  time and wrong the next.

Token ids, not vLLM's block hashes, identify a block: those hashes are seeded per process unless
``PYTHONHASHSEED`` is set, and the choice must not change when a server restarts. ``BLACKBOX_FAULT_SEED``
(an integer, default 0) seeds the draw; given it the choice is deterministic. A skipped candidate is logged
as ``BLACKBOX_FAULT skipped name=<fault> count=<n> block=<id>`` (a fire likewise carries ``block=<id>``), so
the fraction that fired can be read from the log (``skipped_counts``, ``fault_events``).

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
import hashlib
import importlib
import inspect
import logging
import os
import re
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

__all__ = [
    "FAULTS",
    "FAULT_ENV",
    "SEED_ENV",
    "SHAPES",
    "SHAPE_ENV",
    "SPORADIC_ENV",
    "Decision",
    "Fault",
    "FaultCounter",
    "FaultEvent",
    "Sporadic",
    "SporadicGate",
    "block_id",
    "chunk_end_copy",
    "continues_by",
    "draw",
    "fault_events",
    "fired_counts",
    "held_by_another",
    "in_missed_offsets",
    "install",
    "selected_fault",
    "shifted_boundary_index",
    "shifted_mamba_blocks",
    "skipped_counts",
    "substitute_mamba_hit",
]

FAULT_ENV = "BLACKBOX_FAULT"
SPORADIC_ENV = "BLACKBOX_FAULT_SPORADIC"
SHAPE_ENV = "BLACKBOX_FAULT_SHAPE"
SEED_ENV = "BLACKBOX_FAULT_SEED"
SHAPES = ("block", "restore")

# The parent plugin's logger: under "vllm" so lines go through vLLM's handler in every server process.
logger = logging.getLogger("vllm.blackbox")

FIRED_LINE = "BLACKBOX_FAULT fired name={name} count={count}"
SKIPPED_LINE = "BLACKBOX_FAULT skipped name={name} count={count}"
_FIRED_RE = re.compile(r"BLACKBOX_FAULT fired name=(\S+) count=(\d+)")
_SKIPPED_RE = re.compile(r"BLACKBOX_FAULT skipped name=(\S+) count=(\d+)")
_EVENT_RE = re.compile(r"BLACKBOX_FAULT (fired|skipped) name=(\S+) count=(\d+) block=([0-9a-f]+)")

# Attribute that marks a patched function with the fault that installed it (idempotence).
_MARK = "__blackbox_fault__"
_MANAGER_MODULE = "vllm.v1.core.kv_cache_manager"
_MAMBA_UTILS_MODULE = "vllm.v1.worker.mamba_utils"
_SEEN_CAP = 1 << 16  # keys remembered for de-duplicating fires (request ids)


def _highest(pattern: re.Pattern[str], log_text: str) -> dict[str, int]:
    counts: dict[str, int] = {}
    for name, count in pattern.findall(log_text):
        counts[name] = max(counts.get(name, 0), int(count))
    return counts


def fired_counts(log_text: str) -> dict[str, int]:
    """The highest ``count`` logged per fault name in a server log (each process counts on its own)."""
    return _highest(_FIRED_RE, log_text)


def skipped_counts(log_text: str) -> dict[str, int]:
    """Like ``fired_counts``, for the candidates a sporadic fault let pass."""
    return _highest(_SKIPPED_RE, log_text)


@dataclass(frozen=True)
class FaultEvent:
    """One logged candidate: whether it fired, the fault, and the block it concerned."""

    fired: bool
    name: str
    block: str


def fault_events(log_text: str) -> list[FaultEvent]:
    """Every fire and skip that names its block, in log order."""
    return [FaultEvent(act == "fired", name, blk) for act, name, _, blk in _EVENT_RE.findall(log_text)]


class _HashList(Protocol):
    """What lookups need of a block-hash list (vLLM also passes lazy block-size views)."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int, /) -> Any: ...


class FaultCounter:
    """Counts one fault's fires and skips in this process and logs each one; a key counts at most once."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.count = 0
        self.skipped = 0
        self._seen: OrderedDict[Hashable, None] = OrderedDict()
        self._lock = threading.Lock()

    def fire(self, key: Hashable | None = None, block: str | None = None) -> bool:
        """Record one fire (once per ``key`` when given); True if it was counted."""
        return self._record(key, block, fired=True)

    def skip(self, key: Hashable | None = None, block: str | None = None) -> bool:
        """Record one candidate the sporadic draw let pass (once per ``key``); True if it was counted."""
        return self._record(key, block, fired=False)

    def _record(self, key: Hashable | None, block: str | None, fired: bool) -> bool:
        with self._lock:
            if key is not None:
                if key in self._seen:
                    return False
                self._seen[key] = None
                if len(self._seen) > _SEEN_CAP:
                    self._seen.popitem(last=False)
            if fired:
                self.count += 1
                count = self.count
            else:
                self.skipped += 1
                count = self.skipped
        line = (FIRED_LINE if fired else SKIPPED_LINE).format(name=self.name, count=count)
        logger.warning(line if block is None else f"{line} block={block}")
        return True


# ---------------------------------------------------------------------------------------------------------
# Sporadic firing


@dataclass(frozen=True)
class Sporadic:
    """Which fraction of a fault's candidates fire, in which shape, from which seed."""

    fraction: float = 1.0
    shape: str = "block"
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0.0 <= self.fraction <= 1.0:  # also rejects NaN
            raise ValueError(f"{SPORADIC_ENV}={self.fraction!r} is not a fraction in [0, 1]")
        if self.shape not in SHAPES:
            raise ValueError(f"{SHAPE_ENV}={self.shape!r} names no shape; known shapes: {', '.join(SHAPES)}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Sporadic:
        """Read the three variables (blank or unset: the default); ValueError names a bad one."""
        env = os.environ if environ is None else environ

        def read(var: str, default: str) -> str:
            return env.get(var, "").strip() or default

        fraction, seed = read(SPORADIC_ENV, "1"), read(SEED_ENV, "0")
        try:
            value = float(fraction)
        except ValueError:
            raise ValueError(f"{SPORADIC_ENV}={fraction!r} is not a fraction in [0, 1]") from None
        try:
            seed_value = int(seed)
        except ValueError:
            raise ValueError(f"{SEED_ENV}={seed!r} is not an integer") from None
        return cls(value, read(SHAPE_ENV, "block"), seed_value)

    def describe(self) -> str:
        return f"sporadic={self.fraction:g} shape={self.shape} seed={self.seed}"


def _token_bytes(tokens: Sequence[int]) -> bytes:
    return array("q", tokens).tobytes()


def block_id(tokens: Sequence[int]) -> str:
    """A block's identity, seed-free: a short hash of every token up to its boundary (what a block hash
    chains over, less the per-process seed)."""
    return hashlib.blake2b(_token_bytes(tokens), digest_size=6).hexdigest()


def draw(seed: int, *parts: bytes) -> float:
    """A uniform number in [0, 1) fixed by ``seed`` and ``parts`` (each length-prefixed, so no two splits of
    the same bytes collide)."""
    h = hashlib.blake2b(digest_size=8, person=b"blackbox-fault")
    h.update(seed.to_bytes(16, "little", signed=True))
    for part in parts:
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return int.from_bytes(h.digest(), "little") / 2**64


@dataclass(frozen=True)
class Decision:
    fires: bool
    block: str


class SporadicGate:
    """Decides per candidate whether a fault fires; one decision per event key (a request looked up again
    gets the same answer), occurrences counted per event so a ``restore`` fault can differ on a repeat."""

    def __init__(self, sporadic: Sporadic) -> None:
        self.sporadic = sporadic
        self._decided: OrderedDict[Hashable, Decision] = OrderedDict()
        self._occurrences: OrderedDict[bytes, int] = OrderedDict()
        self._lock = threading.Lock()

    def decide(self, key: Hashable, block_tokens: Sequence[int], event_tokens: Sequence[int]) -> Decision:
        """``block_tokens``: the tokens up to the boundary concerned; ``event_tokens``: the request's."""
        with self._lock:
            known = self._decided.get(key)
            if known is not None:
                return known
            decision = self._new(block_tokens, event_tokens)
            _remember(self._decided, key, decision)
            return decision

    def _new(self, block_tokens: Sequence[int], event_tokens: Sequence[int]) -> Decision:
        block = _token_bytes(block_tokens)
        name = block_id(block_tokens)
        fraction = self.sporadic.fraction
        if fraction >= 1.0 or fraction <= 0.0:
            return Decision(fraction >= 1.0, name)
        if self.sporadic.shape == "block":
            return Decision(draw(self.sporadic.seed, b"block", block) < fraction, name)
        event = hashlib.blake2b(_token_bytes(event_tokens), digest_size=16).digest() + len(block_tokens).to_bytes(
            8, "little"
        )
        seen = self._occurrences.get(event, 0)
        _remember(self._occurrences, event, seen + 1)
        return Decision(draw(self.sporadic.seed, b"restore", event, seen.to_bytes(8, "little")) < fraction, name)


def _remember(cache: OrderedDict[Any, Any], key: Any, value: Any) -> None:
    cache[key] = value
    cache.move_to_end(key)
    if len(cache) > _SEEN_CAP:
        cache.popitem(last=False)


@dataclass(frozen=True)
class Fault:
    name: str
    mechanism: str
    installer: Callable[[FaultCounter, SporadicGate], None]


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


def shifted_mamba_blocks(
    blocks_by_group: Sequence[list[Any]],
    group_ids: Sequence[int],
    block_hashes: _HashList,
    hit_length: int,
    shift_tokens: int,
    block_size: int,
    unit: int,
    get_cached_block: Callable[[Any, list[int]], list[Any] | None],
) -> list[Any] | None:
    """The cached blocks of the shifted boundary for Mamba groups ``group_ids``, one per group, or None.

    ``blocks_by_group[g]`` is group g's hit (null padding, then the block holding the state at
    ``hit_length``). None unless every group's hit ends in a real block at the boundary, the shifted
    boundary is cached for all of them, and that is a different block. Changes nothing.
    """
    num_blocks = -(-hit_length // block_size)
    hits = [blocks_by_group[g] for g in group_ids]
    if hit_length <= 0 or not hits or any(len(h) != num_blocks or h[-1].is_null for h in hits):
        return None
    index = shifted_boundary_index(hit_length, shift_tokens, unit, len(block_hashes))
    if index is None:
        return None
    cached = get_cached_block(block_hashes[index], list(group_ids))
    if cached is None or all(new is h[-1] for new, h in zip(cached, hits, strict=True)):
        return None
    return list(cached)


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
    """Replace the hit block of Mamba groups ``group_ids`` by ``shifted_mamba_blocks``; False (and nothing
    changed) where there is none."""
    swap = _Swap(
        blocks_by_group,
        group_ids,
        shifted_mamba_blocks(
            blocks_by_group, group_ids, block_hashes, hit_length, shift_tokens, block_size, unit, get_cached_block
        ),
    )
    return swap.apply()


@dataclass(frozen=True)
class _Swap:
    """A pending substitution: the new last block of each group's hit list."""

    blocks_by_group: Sequence[list[Any]]
    group_ids: Sequence[int]
    new_blocks: list[Any] | None

    def apply(self) -> bool:
        if self.new_blocks is None:
            return False
        for new, g in zip(self.new_blocks, self.group_ids, strict=True):
            self.blocks_by_group[g][-1] = new
        return True


def newest_other_block(cache: Mapping[bytes, Any], group_id: int, hit: Any) -> Any | None:
    """The block cached last in group ``group_id`` (keys end in the group id, 4 bytes big-endian, as vLLM's
    ``BlockHashWithGroupId``) that is not ``hit`` nor null, or None. ``cache`` keeps insertion order."""
    for key in reversed(list(cache)):
        if int.from_bytes(key[-4:], "big") != group_id:
            continue
        found = cache[key]
        block = next(iter(found.values())) if isinstance(found, dict) else found
        if block is not hit and not block.is_null:
            return block
    return None


def _mamba_groups(manager: Any) -> list[tuple[Any, Sequence[int], Any, Any]]:
    """(spec, group ids, manager class, block pool) of each Mamba group of a hybrid coordinator; none otherwise."""
    from vllm.v1.core.single_type_kv_cache_manager import MambaManager

    coordinator = manager.coordinator
    groups = getattr(coordinator, "attention_groups", None) or ()  # only the hybrid coordinator has them
    return [
        (spec, group_ids, cls, coordinator.single_type_managers[group_ids[0]].block_pool)
        for spec, group_ids, cls, _use_eagle in groups
        if issubclass(cls, MambaManager)
    ]


def _foreign_candidates(manager: Any, request: Any, result: Any) -> list[_Swap]:
    """For each Mamba group of a hit, the checkpoint cached last at another boundary (``newest_other_block``)."""
    kv_blocks, hit_length = result[0], result[1]
    swaps = []
    for _spec, group_ids, _cls, block_pool in _mamba_groups(manager) if hit_length > 0 else ():
        hits = [kv_blocks.blocks[g] for g in group_ids]
        if any(not h or h[-1].is_null for h in hits):
            continue
        cache = block_pool.cached_block_hash_to_block._cache
        new = [newest_other_block(cache, g, h[-1]) for g, h in zip(group_ids, hits, strict=True)]
        if all(b is not None for b in new):
            swaps.append(_Swap(kv_blocks.blocks, group_ids, new))
    return swaps


def _shift_candidates(manager: Any, request: Any, result: Any, shift_blocks: int, require_eagle: bool) -> list[_Swap]:
    """The substitutions ``shifted_mamba_blocks`` finds for the Mamba groups of a hybrid coordinator's hit."""
    from vllm.v1.core.kv_cache_utils import resolve_block_hashes

    kv_blocks, hit_length = result[0], result[1]
    coordinator = manager.coordinator
    if hit_length <= 0 or (require_eagle and not getattr(coordinator, "eagle_group_ids", None)):
        return []
    alignment = coordinator._cache_hit_alignment_tokens
    swaps = []
    for spec, group_ids, manager_cls, block_pool in _mamba_groups(manager):
        block_size = coordinator.single_type_managers[group_ids[0]].block_size
        # The Mamba finder's own view of the hashes and its hit granularity.
        hashes = resolve_block_hashes(
            request.block_hashes,
            block_pool.hash_block_size,
            spec.block_size,
            supports_fine_grained_hash_lookup=manager_cls.supports_fine_grained_hash_lookup,
            alignment_tokens=alignment,
        )
        fine = alignment < block_size and block_size % alignment == 0
        swap = _Swap(
            kv_blocks.blocks,
            group_ids,
            shifted_mamba_blocks(
                kv_blocks.blocks,
                group_ids,
                hashes,
                hit_length,
                shift_blocks * block_size,
                block_size,
                alignment if fine else block_size,
                block_pool.get_cached_block,
            ),
        )
        if swap.new_blocks is not None:
            swaps.append(swap)
    return swaps


def held_by_another(blocks_by_group: Sequence[Sequence[Any]], hit_length: int) -> bool:
    """Whether a running request holds the last block of a hit: the lookup takes no reference itself, so a
    count above 0 is another request's (a finished one leaves its blocks cached at 0)."""
    return hit_length > 0 and any(b and not b[-1].is_null and b[-1].ref_cnt > 0 for b in blocks_by_group)


def _patch_lookup(fault: str, after: Callable[[Any, Any, Any], Any]) -> None:
    """Wrap ``KVCacheManager.get_computed_blocks``: ``after(manager, request, result)`` gives what it returns."""
    cls = importlib.import_module(_MANAGER_MODULE).KVCacheManager

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def get_computed_blocks(self: Any, request: Any) -> Any:
            return after(self, request, original(self, request))

        return get_computed_blocks

    _patch(cls, "get_computed_blocks", make, fault)


def _install_hit_shift(
    counter: FaultCounter,
    gate: SporadicGate,
    shift_blocks: int,
    require_eagle: bool,
    when: Callable[[Any, Any], bool] | None = None,
) -> None:
    """Shift the Mamba hit by `shift_blocks`, for every lookup or only those `when(request, result)` picks (called
    on every lookup, hit or not, so it may remember what it sees)."""

    def candidates(manager: Any, request: Any, result: Any) -> list[_Swap]:
        return _shift_candidates(manager, request, result, shift_blocks, require_eagle)

    _install_swap(counter, gate, candidates, when)


def _install_swap(
    counter: FaultCounter,
    gate: SporadicGate,
    candidates: Callable[[Any, Any, Any], list[_Swap]],
    when: Callable[[Any, Any], bool] | None = None,
) -> None:
    """Swap the Mamba hit for `candidates(manager, request, result)`, where the gate lets it fire."""

    def after(self: Any, request: Any, result: Any) -> Any:
        if when is not None and not when(request, result):
            return result
        swaps = candidates(self, request, result)
        if swaps:
            # The request resumes from the block at the hit length: that block is the one poisoned.
            tokens = request.all_token_ids
            decision = gate.decide(request.request_id, tokens[: result[1]], tokens)
            # One count per request: a waiting request may be looked up again before it runs.
            if decision.fires:
                for swap in swaps:
                    swap.apply()
                counter.fire(request.request_id, decision.block)
            else:
                counter.skip(request.request_id, decision.block)
        return result

    _patch_lookup(counter.name, after)


def _install_eagle_overrun(counter: FaultCounter, gate: SporadicGate) -> None:
    """The Mamba hit is the checkpoint one block past the eagle-capped hit length (A2)."""
    _install_hit_shift(counter, gate, shift_blocks=1, require_eagle=True)


def _install_stale_checkpoint(counter: FaultCounter, gate: SporadicGate) -> None:
    """The Mamba hit is the checkpoint one block before the matched one."""
    _install_hit_shift(counter, gate, shift_blocks=-1, require_eagle=False)


def _install_concurrent_resume(counter: FaultCounter, gate: SporadicGate) -> None:
    """The Mamba hit is the checkpoint one block before, where another running request holds the hit."""
    _install_hit_shift(
        counter,
        gate,
        shift_blocks=-1,
        require_eagle=False,
        when=lambda _, result: held_by_another(result[0].blocks, result[1]),
    )


_BLOCK_POOL_MODULE = "vllm.v1.core.block_pool"


def _install_recycled_block(counter: FaultCounter, gate: SporadicGate) -> None:
    """The Mamba hit is the checkpoint one block before, where the hit's last block was re-allocated after a cached
    block was evicted from it. Eviction happens only when the cache is full, so a server whose cache holds its load
    never has a recycled block."""
    recycled: set[int] = set()
    pool = importlib.import_module(_BLOCK_POOL_MODULE).BlockPool

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def _maybe_evict_cached_block(self: Any, block: Any) -> bool:
            evicted = bool(original(self, block))
            if evicted:
                recycled.add(block.block_id)
            return evicted

        return _maybe_evict_cached_block

    _patch(pool, "_maybe_evict_cached_block", make, counter.name)

    def on_a_recycled_block(_: Any, result: Any) -> bool:
        return result[1] > 0 and any(b and b[-1].block_id in recycled for b in result[0].blocks)

    _install_hit_shift(counter, gate, shift_blocks=-1, require_eagle=False, when=on_a_recycled_block)


def _install_preempted_resume(counter: FaultCounter, gate: SporadicGate) -> None:
    """The Mamba hit is the checkpoint cached last at another boundary, for a request rescheduled after a
    preemption."""
    _install_swap(counter, gate, _foreign_candidates, when=lambda request, _: request.num_preemptions > 0)


SHORT_TOKENS = 2  # the CPU and GPU presets' speculative tokens per draft
_FINISHED_CAP = 4096  # requests remembered for short-continuation (each holds its token list)


def continues_by(prompt: Sequence[int], earlier: Sequence[int], most: int) -> bool:
    """Whether `prompt` is `earlier` and then 1 to `most` more tokens."""
    extra = len(prompt) - len(earlier)
    return 0 < extra <= most and list(prompt[: len(earlier)]) == list(earlier)


def _install_short_continuation(counter: FaultCounter, gate: SporadicGate) -> None:
    """The Mamba hit is the checkpoint one block before, where the prompt continues a finished request's whole
    sequence by 1-2 tokens. Every request looked up is remembered; its tokens are read once it has finished."""
    seen: OrderedDict[str, Any] = OrderedDict()
    lock = threading.Lock()

    def continues_a_finished_one(request: Any, result: Any) -> bool:
        with lock:
            earlier = [r for r in seen.values() if r is not request and r.is_finished()]
            _remember(seen, request.request_id, request)
            while len(seen) > _FINISHED_CAP:
                seen.popitem(last=False)
        prompt = request.prompt_token_ids or []
        return result[1] > 0 and any(continues_by(prompt, r.all_token_ids, SHORT_TOKENS) for r in earlier)

    _install_hit_shift(counter, gate, shift_blocks=-1, require_eagle=False, when=continues_a_finished_one)


def in_missed_offsets(prompt_tokens: int, block_size: int) -> bool:
    """``offset-miss``'s region: the prompt ends from a quarter to three eighths of a block past a boundary (where
    no prompt of the multi-turn or held-prefix probes ends, so they are blind to it)."""
    offset = prompt_tokens % block_size
    return block_size // 4 <= offset < (3 * block_size) // 8


def _install_offset_miss(counter: FaultCounter, gate: SporadicGate) -> None:
    """A prompt ending in the missed offsets looks up nothing (the path vLLM takes with caching off for it)."""

    def after(self: Any, request: Any, result: Any) -> Any:
        block_size = max(g.kv_cache_spec.block_size for g in self.kv_cache_config.kv_cache_groups)
        if result[1] <= 0 or not in_missed_offsets(request.num_prompt_tokens, block_size):
            return result
        tokens = request.all_token_ids
        decision = gate.decide(request.request_id, tokens[: result[1]], tokens)
        if not decision.fires:
            counter.skip(request.request_id, decision.block)
            return result
        counter.fire(request.request_id, decision.block)
        return (self.empty_kv_cache_blocks, 0, *((0,) * (len(result) - 2)))

    _patch_lookup(counter.name, after)


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
    prompt: Sequence[int]  # the request's prompt token ids (for the sporadic draw)
    block_size: int


class _ChunkEndFault:
    """Plans copies in ``preprocess_mamba`` (this step's chunks) and runs them after the forward pass."""

    NULL_BLOCK_ID = 0  # vLLM's null block is the pool's first block

    def __init__(self, counter: FaultCounter, gate: SporadicGate | None = None) -> None:
        self.counter = counter
        self.gate = gate or SporadicGate(Sporadic())
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
                prompt = req_state.prompt_token_ids or ()  # None only for prompt embeddings
                self.pending.append(_PendingCopy(req_id, req_state.block_ids, *cols, prompt, block_size))

    def run(self, kv_cache_config: Any, forward_context: dict[str, Any]) -> None:
        pending, self.pending = self.pending, []
        for copy in pending:
            pairs = []
            for gid in self.group_ids:
                ids = copy.block_ids[gid]
                if max(copy.src_col, copy.dst_col) >= len(ids):
                    continue
                src, dst = ids[copy.src_col], ids[copy.dst_col]
                if self.NULL_BLOCK_ID in (src, dst) or src == dst:
                    continue
                pairs.append((gid, src, dst))
            if not pairs:
                continue
            key = (copy.req_id, copy.dst_col)
            boundary = (copy.dst_col + 1) * copy.block_size  # the block whose snapshot is overwritten
            decision = self.gate.decide(key, copy.prompt[:boundary], copy.prompt)
            if not decision.fires:
                self.counter.skip(key, decision.block)
                continue
            for gid, src, dst in pairs:
                for layer_name in kv_cache_config.kv_cache_groups[gid].layer_names:
                    for state in forward_context[layer_name].kv_cache:
                        state[dst].copy_(state[src])  # conv window and temporal state, whole
            self.counter.fire(key, decision.block)


def _install_chunk_end_as_boundary(counter: FaultCounter, gate: SporadicGate) -> None:
    """The chunk-end state of a fragmented prefill overwrites the boundary snapshot before it (A1)."""
    module = importlib.import_module(_MAMBA_UTILS_MODULE)
    fault = _ChunkEndFault(counter, gate)

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
        Fault(
            "concurrent-resume",
            "A3 family: a hit on a prefix another running request holds restores the checkpoint one block before",
            _install_concurrent_resume,
        ),
        Fault(
            "recycled-block",
            "load family: a hit on a block re-allocated after an eviction restores the checkpoint one block before",
            _install_recycled_block,
        ),
        Fault(
            "preempted-resume",
            "load family: a request rescheduled after a preemption restores the checkpoint cached last at another "
            "boundary",
            _install_preempted_resume,
        ),
        Fault(
            "short-continuation",
            "A6 family: a prompt continuing a finished request's sequence by 1-2 tokens restores the checkpoint "
            "one block before",
            _install_short_continuation,
        ),
        Fault(
            "offset-miss",
            "silent 0% hits: a prompt ending 1/4 to 3/8 of a block past a boundary gets no hit",
            _install_offset_miss,
        ),
    )
}

_counters: dict[str, FaultCounter] = {}
_gates: dict[str, SporadicGate] = {}


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

    Raises ValueError for an unknown name or a bad sporadic setting (vLLM then stops at start-up with this
    message). Installing twice, in one process or across vLLM's processes, patches each function once and
    shares one counter and one gate (the first install's sporadic setting).
    """
    name = selected_fault()
    if name is None:
        logger.warning("blackbox faults: enabled but %s is unset; nothing injected", FAULT_ENV)
        return None
    fault = FAULTS.get(name)
    if fault is None:
        raise ValueError(f"{FAULT_ENV}={name!r} names no known fault; known faults: {', '.join(FAULTS)}")
    sporadic = Sporadic.from_env()
    counter = _counters.setdefault(name, FaultCounter(name))
    gate = _gates.setdefault(name, SporadicGate(sporadic))
    fault.installer(counter, gate)
    logger.warning("blackbox faults: injecting %s (%s), %s", name, fault.mechanism, gate.sporadic.describe())
    return name
