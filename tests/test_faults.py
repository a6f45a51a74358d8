"""The fault-injection plugin: inert unless asked, loud about unknown faults, and exact about what it corrupts.

The hit-substitution faults run against a real vLLM ``KVCacheManager`` (hybrid Mamba + attention, EAGLE on)
whose prefix cache is filled by hand, so the test goes through vLLM's own coordinator and only the cache
contents are staged. The chunk-end fault runs on fake scheduler/runner objects and real tensors.
"""

from __future__ import annotations

import inspect
import logging
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from scipy.stats import binomtest

import servers.vllm_plugin as plugin
from servers.vllm_plugin import faults
from servers.vllm_plugin.faults import (
    FAULTS,
    FaultCounter,
    FaultEvent,
    Sporadic,
    SporadicGate,
    block_id,
    chunk_end_copy,
    draw,
    fault_events,
    fired_counts,
    held_by_another,
    shifted_boundary_index,
    skipped_counts,
    substitute_mamba_hit,
)

BS = 128
KNOWN = (
    "eagle-overrun",
    "chunk-end-as-boundary",
    "stale-checkpoint",
    "concurrent-resume",
    "recycled-block",
    "preempted-resume",
    "short-continuation",
    "offset-miss",
)
# (module, attribute owner path, attribute) of everything a fault may patch.
TARGETS = (
    ("vllm.v1.core.kv_cache_manager", "KVCacheManager", "get_computed_blocks"),
    ("vllm.v1.core.block_pool", "BlockPool", "_maybe_evict_cached_block"),
    ("vllm.v1.worker.mamba_utils", None, "preprocess_mamba"),
    ("vllm.v1.worker.mamba_utils", None, "postprocess_mamba_align_gpu"),
)


def _owner(module: str, cls: str | None) -> Any:
    mod = sys.modules[module]
    return getattr(mod, cls) if cls else mod


def _patched() -> list[str]:
    """The patch targets that carry a fault's marker, among the modules already imported."""
    return [
        attr
        for module, cls, attr in TARGETS
        if module in sys.modules and hasattr(getattr(_owner(module, cls), attr), "__blackbox_fault__")
    ]


@pytest.fixture
def restore_targets(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Import the patch targets and put the originals back after the test; counters start at zero."""
    import vllm.v1.core.block_pool
    import vllm.v1.core.kv_cache_manager
    import vllm.v1.worker.mamba_utils  # noqa: F401

    for module, cls, attr in TARGETS:
        owner = _owner(module, cls)
        monkeypatch.setattr(owner, attr, getattr(owner, attr))
    monkeypatch.setattr(faults, "_counters", {})
    monkeypatch.setattr(faults, "_gates", {})
    for var in (faults.SPORADIC_ENV, faults.SHAPE_ENV, faults.SEED_ENV):
        monkeypatch.delenv(var, raising=False)
    assert _patched() == []
    yield


# --- inertness and selection -------------------------------------------------------------------------


def test_known_faults() -> None:
    assert tuple(FAULTS) == KNOWN
    assert plugin.INSTALLERS["faults"] is not None


def test_no_env_patches_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(plugin.ENV_VAR, raising=False)
    monkeypatch.setenv(faults.FAULT_ENV, "eagle-overrun")  # named, but the feature is off
    before = set(sys.modules)
    plugin.register()
    assert _patched() == []
    assert not {m for m in set(sys.modules) - before if m.startswith("vllm")}


def test_faults_without_a_fault_name_patches_nothing(
    monkeypatch: pytest.MonkeyPatch, restore_targets: None, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv(plugin.ENV_VAR, "faults")
    for value in (None, "", "  "):
        if value is None:
            monkeypatch.delenv(faults.FAULT_ENV, raising=False)
        else:
            monkeypatch.setenv(faults.FAULT_ENV, value)
        with caplog.at_level(logging.WARNING, logger="vllm.blackbox"):
            plugin.register()
        assert faults.install() is None
        assert _patched() == []
    assert "BLACKBOX_FAULT is unset" in caplog.text


def test_unknown_fault_fails_start_up_naming_the_known_ones(
    monkeypatch: pytest.MonkeyPatch, restore_targets: None
) -> None:
    monkeypatch.setenv(plugin.ENV_VAR, "cpu-kernels-off,faults")
    monkeypatch.setenv(faults.FAULT_ENV, "eagle-overrrun")
    with pytest.raises(ValueError, match="eagle-overrrun") as err:
        plugin.register()
    for name in KNOWN:
        assert name in str(err.value)
    assert _patched() == []


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("eagle-overrun", ["get_computed_blocks"]),
        ("stale-checkpoint", ["get_computed_blocks"]),
        ("concurrent-resume", ["get_computed_blocks"]),
        ("chunk-end-as-boundary", ["preprocess_mamba", "postprocess_mamba_align_gpu"]),
    ],
)
def test_each_fault_patches_its_targets_once(
    monkeypatch: pytest.MonkeyPatch, restore_targets: None, name: str, expected: list[str]
) -> None:
    monkeypatch.setenv(plugin.ENV_VAR, "faults")
    monkeypatch.setenv(faults.FAULT_ENV, f" {name} ")
    plugin.register()
    assert _patched() == expected
    first = {attr: getattr(_owner(m, c), attr) for m, c, attr in TARGETS}
    plugin.register()  # vLLM loads plugins in several processes, sometimes twice in one
    assert faults.install() == name
    for module, cls, attr in TARGETS:
        current = getattr(_owner(module, cls), attr)
        assert current is first[attr]
        if attr in expected:
            assert current.__blackbox_fault__ == name
            assert not hasattr(current.__wrapped__, "__blackbox_fault__")  # wrapped once, not twice


def test_patch_targets_match_the_installed_vllm(restore_targets: None) -> None:
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.worker import mamba_utils

    assert list(inspect.signature(KVCacheManager.get_computed_blocks).parameters) == ["self", "request"]
    pre = inspect.signature(mamba_utils.preprocess_mamba).parameters
    assert {"scheduler_output", "input_batch", "requests", "copy_bufs"} <= set(pre)
    post = inspect.signature(mamba_utils.postprocess_mamba_align_gpu).parameters
    # Keyword-only, so the runner passes kv_cache_config and forward_context by name.
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in post.values())
    assert {"kv_cache_config", "forward_context"} <= set(post)


# --- counting and the log line -------------------------------------------------------------------------


def test_fired_counts_reads_the_highest_count_per_fault() -> None:
    log = "\n".join(
        [
            "(EngineCore pid=1) WARNING 11-30 01:40:45 [faults.py:118] BLACKBOX_FAULT fired name=eagle-overrun count=1",
            "(Worker pid=2) WARNING [faults.py:118] BLACKBOX_FAULT fired name=chunk-end-as-boundary count=7",
            "BLACKBOX_FAULT fired name=eagle-overrun count=3",
            "BLACKBOX_FAULT fired name=eagle-overrun count=2",  # another process, fewer fires
            "blackbox faults: injecting eagle-overrun",
            "BLACKBOX_FAULT fired name=broken count=x",
        ]
    )
    assert fired_counts(log) == {"eagle-overrun": 3, "chunk-end-as-boundary": 7}
    assert fired_counts("") == {}
    assert fired_counts("INFO nothing fired here") == {}


def test_counter_logs_each_fire_and_counts_a_key_once(caplog: pytest.LogCaptureFixture) -> None:
    counter = FaultCounter("stale-checkpoint")
    with caplog.at_level(logging.WARNING, logger="vllm.blackbox"):
        assert counter.fire("req-a")
        assert not counter.fire("req-a")
        assert counter.fire("req-b")
        assert counter.fire()
        assert counter.fire()
    assert counter.count == 4
    lines = [r.getMessage() for r in caplog.records if r.name == "vllm.blackbox"]
    assert lines == [f"BLACKBOX_FAULT fired name=stale-checkpoint count={n}" for n in (1, 2, 3, 4)]
    assert all(r.levelno == logging.WARNING for r in caplog.records)
    assert fired_counts(caplog.text) == {"stale-checkpoint": 4}


# --- hit substitution: pure selection --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("hit", "shift", "unit", "num_hashes", "expected"),
    [
        (512, BS, BS, 5, 4),  # eagle-overrun: boundary 640 is hash 4
        (512, -BS, BS, 5, 2),  # stale: boundary 384
        (512, BS, BS, 4, None),  # 640 is past the request's hashed tokens
        (128, -BS, BS, 5, None),  # boundary 0 has no checkpoint block
        (0, BS, BS, 5, None),  # no hit, nothing handed over
        (160, BS, 32, 20, 8),  # fine-grained hits: 288 tokens is hash unit 8
        (160, BS, BS, 20, None),  # off the block grid
    ],
)
def test_shifted_boundary_index(hit: int, shift: int, unit: int, num_hashes: int, expected: int | None) -> None:
    assert shifted_boundary_index(hit, shift, unit, num_hashes) == expected


@dataclass(eq=False)
class Block:
    block_id: int
    is_null: bool = False


NULL = Block(0, is_null=True)


class FakePool:
    """Cached blocks by (hash, group id), as BlockPool.get_cached_block looks them up."""

    def __init__(self, cached: dict[tuple[str, int], Block]) -> None:
        self.cached = cached

    def get_cached_block(self, block_hash: str, group_ids: list[int]) -> list[Block] | None:
        blocks = [self.cached.get((block_hash, g)) for g in group_ids]
        return None if any(b is None for b in blocks) else [b for b in blocks if b is not None]


HASHES = [f"h{i}" for i in range(5)]  # boundaries 128, 256, ..., 640


def _mamba_hit(block: Block, hit: int = 512) -> list[Block]:
    return [NULL] * (hit // BS - 1) + [block]


def test_substitution_hands_over_the_shifted_checkpoint() -> None:
    at = {b: Block(b) for b in (128, 384, 512, 640)}
    pool = FakePool({(f"h{b // BS - 1}", 0): blk for b, blk in at.items()})
    for shift, expected in ((BS, 640), (-BS, 384)):
        blocks = [_mamba_hit(at[512]), [Block(90), Block(91), Block(92), Block(93)]]
        assert substitute_mamba_hit(blocks, [0], HASHES, 512, shift, BS, BS, pool.get_cached_block)
        assert blocks[0][-1] is at[expected]
        assert blocks[0][:-1] == [NULL] * 3
        assert [b.block_id for b in blocks[1]] == [90, 91, 92, 93]  # attention untouched


def test_substitution_changes_nothing_it_cannot_justify() -> None:
    hit_block = Block(8)
    pool = FakePool({("h3", 0): hit_block, ("h1", 0): Block(6)})

    def run(blocks: list[Block], hit: int, shift: int) -> bool:
        return substitute_mamba_hit([blocks], [0], HASHES, hit, shift, BS, BS, pool.get_cached_block)

    assert not run(_mamba_hit(hit_block), 512, BS)  # 640 not cached
    assert not run(_mamba_hit(hit_block), 512, -BS)  # 384 not cached
    assert not run([NULL] * 3 + [NULL], 512, -BS)  # no real hit block
    assert not run([hit_block], 512, -BS)  # list does not end at the hit boundary
    assert not run([], 0, BS)  # no hit
    assert not run(_mamba_hit(Block(6), 256), 256, -BS)  # boundary 128: nothing cached there
    same = FakePool({("h3", 0): hit_block})
    assert not substitute_mamba_hit(
        [_mamba_hit(hit_block)], [0], ["h0", "h1", "h2", "h2", "h3"], 512, BS, BS, BS, same.get_cached_block
    )  # the shifted hash maps to the same block


def test_substitution_covers_every_group_of_the_spec_or_none() -> None:
    pool = FakePool({("h4", 0): Block(40), ("h4", 2): Block(42)})
    blocks = [_mamba_hit(Block(30)), [Block(9)] * 4, _mamba_hit(Block(32))]
    assert substitute_mamba_hit(blocks, [0, 2], HASHES, 512, BS, BS, BS, pool.get_cached_block)
    assert (blocks[0][-1].block_id, blocks[2][-1].block_id) == (40, 42)
    partial = FakePool({("h4", 0): Block(40)})  # group 2 lacks the block: a miss for the spec
    blocks = [_mamba_hit(Block(30)), [Block(9)] * 4, _mamba_hit(Block(32))]
    assert not substitute_mamba_hit(blocks, [0, 2], HASHES, 512, BS, BS, BS, partial.get_cached_block)
    assert (blocks[0][-1].block_id, blocks[2][-1].block_id) == (30, 32)


# --- hit substitution through vLLM's real KV-cache manager ----------------------------------------------


@dataclass
class RealCache:
    manager: Any
    request: Any
    mamba: dict[int, Any]  # boundary -> the cached Mamba block


def _real_cache(mamba_boundaries: tuple[int, ...], use_eagle: bool = True, prompt_tokens: int = 700) -> RealCache:
    """A hybrid manager (group 0 Mamba align, group 1 attention + drafter), 700 prompt tokens of which
    5 attention blocks and the Mamba states at ``mamba_boundaries`` are cached."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash, make_block_hash_with_group_id
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec
    from vllm.v1.request import Request

    attention = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=8, dtype=torch.bfloat16)
    mamba = MambaSpec(
        block_size=BS, shapes=((2, 2),), dtypes=(torch.float32,), mamba_cache_mode="align", num_speculative_blocks=2
    )
    groups = [KVCacheGroupSpec(["gdn"], mamba), KVCacheGroupSpec(["attn"], attention, is_eagle_group=use_eagle)]
    config = KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=groups)
    manager = KVCacheManager(
        config, max_model_len=4096, scheduler_block_size=BS, hash_block_size=BS, use_eagle=use_eagle
    )
    init_none_hash(sha256)
    request = Request(
        request_id="turn-2",
        prompt_token_ids=list(range(prompt_tokens)),
        sampling_params=SamplingParams(max_tokens=1),
        pooling_params=None,
        block_hasher=get_request_block_hasher(BS, sha256),
    )
    pool = manager.block_pool

    def cache(index: int, group: int) -> Any:
        block = pool.get_new_blocks(1)[0]
        key = make_block_hash_with_group_id(request.block_hashes[index], group)
        block.set_block_hash(key, (index + 1) * BS)
        pool.cached_block_hash_to_block.insert(key, block)
        pool.free_blocks([block])  # cached and evictable, as a finished request leaves it
        return block

    for index in range(5):
        cache(index, 1)
    return RealCache(manager, request, {b: cache(b // BS - 1, 0) for b in mamba_boundaries})


def _unpatch(monkeypatch: pytest.MonkeyPatch) -> None:
    for module, cls, attr in TARGETS:
        owner = _owner(module, cls)
        current = getattr(owner, attr)
        monkeypatch.setattr(owner, attr, getattr(current, "__wrapped__", current))


def _install(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    monkeypatch.setenv(faults.FAULT_ENV, name)
    assert faults.install() == name


def test_clean_manager_hit_is_what_the_faults_start_from(restore_targets: None) -> None:
    cache = _real_cache((128, 384, 512, 640))
    blocks, hit, _ = cache.manager.get_computed_blocks(cache.request)
    # Attention matched 640, dropped the eagle block; Mamba resumes from its own 512 checkpoint.
    assert hit == 512
    assert blocks.blocks[0][-1] is cache.mamba[512]
    assert len(blocks.blocks[1]) == 4


@pytest.mark.parametrize(("name", "handed"), [("eagle-overrun", 640), ("stale-checkpoint", 384)])
def test_real_manager_hands_over_the_shifted_state(
    monkeypatch: pytest.MonkeyPatch, restore_targets: None, caplog: pytest.LogCaptureFixture, name: str, handed: int
) -> None:
    _install(monkeypatch, name)
    cache = _real_cache((128, 384, 512, 640))
    with caplog.at_level(logging.WARNING, logger="vllm.blackbox"):
        blocks, hit, _ = cache.manager.get_computed_blocks(cache.request)
        cache.manager.get_computed_blocks(cache.request)  # a waiting request looked up again
    assert hit == 512  # the granted length is the clean one...
    assert blocks.blocks[0][:-1] == [cache.manager.block_pool.null_block] * 3
    assert blocks.blocks[0][-1] is cache.mamba[handed]  # ...the state is not
    assert len(blocks.blocks[1]) == 4
    assert fired_counts(caplog.text) == {name: 1}


@pytest.mark.parametrize(
    ("name", "boundaries", "use_eagle"),
    [
        ("eagle-overrun", (128, 384, 512), True),  # nothing cached past the hit
        ("eagle-overrun", (128, 384, 512, 640), False),  # no EAGLE, no block drop to overrun
        ("stale-checkpoint", (128, 512, 640), True),  # nothing cached before the hit
    ],
)
def test_real_manager_fault_stays_silent_without_a_shifted_checkpoint(
    monkeypatch: pytest.MonkeyPatch,
    restore_targets: None,
    caplog: pytest.LogCaptureFixture,
    name: str,
    boundaries: tuple[int, ...],
    use_eagle: bool,
) -> None:
    _install(monkeypatch, name)
    cache = _real_cache(boundaries, use_eagle)
    with caplog.at_level(logging.WARNING, logger="vllm.blackbox"):
        blocks, hit, _ = cache.manager.get_computed_blocks(cache.request)
    assert blocks.blocks[0][-1] is cache.mamba[hit]
    assert fired_counts(caplog.text) == {}


@pytest.mark.parametrize("held", [False, True], ids=["resumes-alone", "prefix-held-by-a-running-request"])
def test_concurrent_resume_fires_only_where_another_running_request_holds_the_hit(
    monkeypatch: pytest.MonkeyPatch, restore_targets: None, caplog: pytest.LogCaptureFixture, held: bool
) -> None:
    _install(monkeypatch, "concurrent-resume")
    cache = _real_cache((128, 384, 512, 640))
    blocks, hit, _ = cache.manager.get_computed_blocks(cache.request)  # alone: exact
    assert (hit, blocks.blocks[0][-1]) == (512, cache.mamba[512])
    if held:
        cache.manager.block_pool.touch([blocks.blocks[1][-1]])  # a running request takes the attention block
    cache.request.request_id = "turn-2-again"
    with caplog.at_level(logging.WARNING, logger="vllm.blackbox"):
        blocks, hit, _ = cache.manager.get_computed_blocks(cache.request)
    assert hit == 512
    assert blocks.blocks[0][-1] is cache.mamba[384 if held else 512]
    assert fired_counts(caplog.text) == ({"concurrent-resume": 1} if held else {})


@pytest.mark.parametrize("recycled", [False, True], ids=["fresh-block", "block-re-allocated-after-an-eviction"])
def test_recycled_block_fires_only_on_a_hit_whose_block_had_a_cached_block_evicted_from_it(
    monkeypatch: pytest.MonkeyPatch, restore_targets: None, caplog: pytest.LogCaptureFixture, recycled: bool
) -> None:
    _install(monkeypatch, "recycled-block")
    cache = _real_cache((128, 384, 512, 640))
    pool = cache.manager.block_pool
    hit_block = cache.mamba[512]
    if recycled:  # the hit's block once held a cached block that an allocation evicted, and was cached again
        key, length = hit_block.block_hash, 512
        assert pool._maybe_evict_cached_block(hit_block)
        hit_block.set_block_hash(key, length)
        pool.cached_block_hash_to_block.insert(key, hit_block)
    else:
        assert not pool._maybe_evict_cached_block(pool.null_block)  # an uncached block: nothing evicted
    with caplog.at_level(logging.WARNING, logger="vllm.blackbox"):
        blocks, hit, _ = cache.manager.get_computed_blocks(cache.request)
    assert hit == 512
    assert blocks.blocks[0][-1] is cache.mamba[384 if recycled else 512]
    assert fired_counts(caplog.text) == ({"recycled-block": 1} if recycled else {})


@pytest.mark.parametrize("preempted", [False, True], ids=["never-preempted", "rescheduled-after-a-preemption"])
def test_preempted_resume_fires_only_for_a_request_that_was_preempted(
    monkeypatch: pytest.MonkeyPatch, restore_targets: None, caplog: pytest.LogCaptureFixture, preempted: bool
) -> None:
    _install(monkeypatch, "preempted-resume")
    cache = _real_cache((128, 384, 512, 640))
    cache.request.num_preemptions = int(preempted)
    with caplog.at_level(logging.WARNING, logger="vllm.blackbox"):
        blocks, hit, _ = cache.manager.get_computed_blocks(cache.request)
    assert hit == 512
    # Not the checkpoint just before (384): the one cached last at another boundary, whoever wrote it.
    assert blocks.blocks[0][-1] is cache.mamba[640 if preempted else 512]
    assert fired_counts(caplog.text) == ({"preempted-resume": 1} if preempted else {})


def test_preempted_resume_needs_no_earlier_checkpoint_of_the_request(
    monkeypatch: pytest.MonkeyPatch, restore_targets: None, caplog: pytest.LogCaptureFixture
) -> None:
    """Under the pressure that preempts, a rescheduled request's earlier checkpoints are evicted before it comes
    back (on the CPU pair none was ever left): the fault must fire on what is cached, not on 384."""
    _install(monkeypatch, "preempted-resume")
    cache = _real_cache((512, 640))
    cache.request.num_preemptions = 1
    with caplog.at_level(logging.WARNING, logger="vllm.blackbox"):
        blocks, hit, _ = cache.manager.get_computed_blocks(cache.request)
    assert (hit, blocks.blocks[0][-1]) == (512, cache.mamba[640])
    assert fired_counts(caplog.text) == {"preempted-resume": 1}


class _Block:
    def __init__(self, name: str, *, null: bool = False) -> None:
        self.name, self.is_null = name, null


def _key(name: str, group: int) -> bytes:
    return name.encode() + group.to_bytes(4, "big")


def test_the_newest_other_block_is_the_last_cached_of_its_group_neither_the_hit_nor_null() -> None:
    hit, old, other_group, newest, twin = _Block("hit"), _Block("old"), _Block("g0"), _Block("new"), _Block("twin")
    cache: dict[bytes, object] = {
        _key("a", 1): old,
        _key("b", 1): {7: newest, 8: twin},  # duplicates of one hash: vLLM hands out the first
        _key("c", 0): other_group,
        _key("d", 1): hit,
        _key("e", 1): _Block("null", null=True),
    }
    assert faults.newest_other_block(cache, 1, hit) is newest
    assert faults.newest_other_block(cache, 0, hit) is other_group
    assert faults.newest_other_block({_key("d", 1): hit}, 1, hit) is None


@pytest.mark.parametrize(("offset", "missed"), [(0, False), (31, False), (32, True), (47, True), (48, False)])
def test_missed_offsets_are_a_quarter_to_three_eighths_of_a_block(offset: int, missed: bool) -> None:
    assert faults.in_missed_offsets(3 * BS + offset, BS) is missed


@pytest.mark.parametrize(("prompt_tokens", "hit"), [(700, 512), (680, 0)], ids=["offset-60", "offset-40"])
def test_offset_miss_takes_every_hit_of_a_prompt_ending_in_its_offsets(
    monkeypatch: pytest.MonkeyPatch,
    restore_targets: None,
    caplog: pytest.LogCaptureFixture,
    prompt_tokens: int,
    hit: int,
) -> None:
    _install(monkeypatch, "offset-miss")
    cache = _real_cache((128, 384, 512, 640), prompt_tokens=prompt_tokens)
    with caplog.at_level(logging.WARNING, logger="vllm.blackbox"):
        blocks, found, boundary = cache.manager.get_computed_blocks(cache.request)
    assert found == hit
    if hit:
        assert blocks.blocks[0][-1] is cache.mamba[hit] and fired_counts(caplog.text) == {}
    else:
        assert all(not group for group in blocks.blocks) and boundary == 0
        assert fired_counts(caplog.text) == {"offset-miss": 1}


@pytest.mark.parametrize(
    ("prompt", "earlier", "expected"),
    [
        ([1, 2, 3], [1, 2], True),
        ([1, 2, 3, 4], [1, 2], True),
        ([1, 2, 3, 4, 5], [1, 2], False),
        ([1, 2], [1, 2], False),
        ([1, 9, 3], [1, 2], False),
        ([1], [1, 2], False),
    ],
)
def test_continues_by_is_the_earlier_sequence_then_one_or_two_tokens(
    prompt: list[int], earlier: list[int], expected: bool
) -> None:
    assert faults.continues_by(prompt, earlier, 2) is expected


@pytest.mark.parametrize(
    ("earlier_tokens", "finished", "fires"),
    [(699, True, True), (698, True, True), (697, False, False), (697, True, False), (690, True, False)],
    ids=["by-1", "by-2", "by-1-still-running", "by-3", "by-10"],
)
def test_short_continuation_fires_only_on_a_prompt_continuing_a_finished_sequence_by_1_or_2_tokens(
    monkeypatch: pytest.MonkeyPatch,
    restore_targets: None,
    caplog: pytest.LogCaptureFixture,
    earlier_tokens: int,
    finished: bool,
    fires: bool,
) -> None:
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request, RequestStatus

    _install(monkeypatch, "short-continuation")
    cache = _real_cache((128, 384, 512, 640))  # turn 2's prompt: tokens 0..699
    earlier = Request(
        request_id="turn-1",
        prompt_token_ids=list(range(300)),
        sampling_params=SamplingParams(max_tokens=earlier_tokens),
        pooling_params=None,
    )
    cache.manager.get_computed_blocks(earlier)  # looked up when it arrived: remembered
    earlier.append_output_token_ids(list(range(300, earlier_tokens)))
    if finished:
        earlier.status = RequestStatus.FINISHED_LENGTH_CAPPED
    if earlier_tokens == 697 and not finished:
        earlier.append_output_token_ids([697, 698])  # a running request: still decoding, never a continuation
    with caplog.at_level(logging.WARNING, logger="vllm.blackbox"):
        blocks, hit, _ = cache.manager.get_computed_blocks(cache.request)
    assert hit == 512
    assert blocks.blocks[0][-1] is cache.mamba[384 if fires else 512]
    assert fired_counts(caplog.text) == ({"short-continuation": 1} if fires else {})


def test_held_by_another_reads_the_last_block_of_each_group() -> None:
    @dataclass
    class B:
        ref_cnt: int = 0
        is_null: bool = False

    assert not held_by_another([[B(1), B(0)], [B(0)]], 256)  # an earlier block held: not the hit's end
    assert held_by_another([[B(0)], [B(0), B(2)]], 256)
    assert not held_by_another([[B(5, is_null=True)]], 128)
    assert not held_by_another([[B(1)]], 0)


# --- chunk-end-as-boundary -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("start", "end", "drafts", "prompt", "origin", "expected"),
    [
        (128, 192, 0, 192, 0, (1, 0)),  # fragmented: the last chunk starts on the boundary
        (256, 314, 0, 314, 128, (2, 1)),  # after a hit at 128, on a boundary the request computed
        (128, 224, 0, 400, 0, (1, 0)),  # an intermediate sub-block chunk (budget below a block)
        (0, 192, 0, 192, 0, None),  # one chunk: the boundary slot stays null ("accidentally safe")
        (160, 192, 0, 192, 0, None),  # not on the boundary: that slot may already be freed
        (128, 256, 0, 300, 0, None),  # ends on a boundary: nothing mid-block
        (0, 96, 0, 192, 0, None),  # no boundary below the chunk end
        (128, 192, 0, 192, 128, None),  # the boundary block is a shared cache hit
        (128, 192, 0, 192, None, None),  # request not seen starting (resumed): unknown origin
        (128, 131, 2, 128, 0, None),  # a decode step with drafts
        (300, 301, 0, 290, 0, None),  # past the prompt
    ],
)
def test_chunk_end_copy(
    start: int, end: int, drafts: int, prompt: int, origin: int | None, expected: tuple[int, int] | None
) -> None:
    assert chunk_end_copy(start, end, drafts, prompt, origin, BS) == expected


NUM_BLOCKS = 10


def _runner_objects(chunks: dict[str, tuple[int, int, int, list[int]]], new: dict[str, int]) -> dict[str, Any]:
    """Fake scheduler output / input batch / runner state for requests id -> (computed, scheduled, prompt, ids)."""
    states = [torch.randn(NUM_BLOCKS, 3, 4), torch.randn(NUM_BLOCKS, 2, 2, 2)]  # conv, temporal
    return {
        "scheduler_output": SimpleNamespace(
            scheduled_new_reqs=[SimpleNamespace(req_id=r, num_computed_tokens=n) for r, n in new.items()],
            finished_req_ids=set(),
            preempted_req_ids=None,
            scheduled_spec_decode_tokens={},
            num_scheduled_tokens={r: c[1] for r, c in chunks.items()},
        ),
        "input_batch": SimpleNamespace(req_ids=list(chunks)),
        "requests": {
            r: SimpleNamespace(
                num_computed_tokens=c[0],
                num_prompt_tokens=c[2],
                prompt_token_ids=list(range(c[2])),
                block_ids=(c[3],),
            )
            for r, c in chunks.items()
        },
        "copy_bufs": SimpleNamespace(mamba_group_ids=[0], mamba_spec=SimpleNamespace(block_size=BS)),
        "kv_cache_config": SimpleNamespace(kv_cache_groups=[SimpleNamespace(layer_names=["gdn0", "gdn1"])]),
        "forward_context": {
            "gdn0": SimpleNamespace(kv_cache=states),
            "gdn1": SimpleNamespace(kv_cache=[s + 100 for s in states]),
        },
    }


def _call_runner(objs: dict[str, Any]) -> None:
    """Call the (patched) module functions the way vLLM's V1 runner does."""
    from vllm.v1.worker import mamba_utils

    mamba_utils.preprocess_mamba(
        objs["scheduler_output"],
        objs["kv_cache_config"],
        None,
        {},
        objs["input_batch"],
        objs["requests"],
        objs["forward_context"],
        {},
        objs["copy_bufs"],
        align_ctx=None,
    )
    mamba_utils.postprocess_mamba_align_gpu(
        bufs=None,
        num_reqs=len(objs["input_batch"].req_ids),
        num_accepted_tokens_gpu=None,
        num_accepted_tokens_cpu_tensor=None,
        input_batch=objs["input_batch"],
        kv_cache_config=objs["kv_cache_config"],
        forward_context=objs["forward_context"],
        mamba_state_copy_funcs={},
    )


def test_chunk_end_fault_overwrites_the_boundary_snapshot_after_the_forward(
    monkeypatch: pytest.MonkeyPatch, restore_targets: None, caplog: pytest.LogCaptureFixture
) -> None:
    from vllm.v1.worker import mamba_utils

    calls: list[str] = []
    real_pre = inspect.signature(mamba_utils.preprocess_mamba)

    def fake_pre(*args: Any, **kwargs: Any) -> None:
        real_pre.bind(*args, **kwargs)
        calls.append("pre")

    def fake_post(**kwargs: Any) -> None:
        calls.append("post")

    monkeypatch.setattr(fake_pre, "__signature__", real_pre, raising=False)
    monkeypatch.setattr(mamba_utils, "preprocess_mamba", fake_pre)
    monkeypatch.setattr(mamba_utils, "postprocess_mamba_align_gpu", fake_post)
    _install(monkeypatch, "chunk-end-as-boundary")

    # Step 1: both requests start cold. Step 2: "frag" chunks [128, 192) after [0, 128); "whole" computes
    # [0, 192) in one chunk; "hit" resumed from a 128-token hit and chunks [128, 192) from it.
    objs = _runner_objects(
        {"frag": (0, 128, 192, [3, 4, 5, 6]), "whole": (0, 192, 192, [0, 7, 8, 9])},
        new={"frag": 0, "whole": 0},
    )
    _call_runner(objs)
    before = [s.clone() for s in objs["forward_context"]["gdn0"].kv_cache]
    objs2 = _runner_objects(
        {"frag": (128, 64, 192, [3, 4, 5, 6]), "hit": (128, 64, 192, [2, 1, 5, 6])},
        new={"hit": 128},
    )
    objs2["forward_context"] = objs["forward_context"]
    with caplog.at_level(logging.WARNING, logger="vllm.blackbox"):
        _call_runner(objs2)
    assert calls == ["pre", "post", "pre", "post"]
    for layer in ("gdn0", "gdn1"):
        for state in objs["forward_context"][layer].kv_cache:
            assert torch.equal(state[3], state[4])  # boundary 128 now holds the state at 192
    after = objs["forward_context"]["gdn0"].kv_cache
    for b, a in zip(before, after, strict=True):
        assert torch.equal(a[3], b[4])  # the chunk-end state, block 4 (column 1), untouched itself
        changed = [i for i in range(NUM_BLOCKS) if not torch.equal(b[i], a[i])]
        assert changed == [3]  # not "hit"'s shared block 2, nothing else
    assert fired_counts(caplog.text) == {"chunk-end-as-boundary": 1}


def test_chunk_end_fault_skips_null_and_short_block_tables(restore_targets: None) -> None:
    counter = FaultCounter("chunk-end-as-boundary")
    fault = faults._ChunkEndFault(counter)
    objs = _runner_objects(
        {"nulled": (128, 64, 192, [0, 4, 5]), "short": (128, 64, 192, [3])},
        new={"nulled": 0, "short": 0},
    )
    before = [s.clone() for s in objs["forward_context"]["gdn0"].kv_cache]
    fault.plan(objs["scheduler_output"], objs["input_batch"], objs["requests"], objs["copy_bufs"])
    assert len(fault.pending) == 2
    fault.run(objs["kv_cache_config"], objs["forward_context"])
    assert fault.pending == []
    for b, a in zip(before, objs["forward_context"]["gdn0"].kv_cache, strict=True):
        assert torch.equal(b, a)
    assert counter.count == 0


# --- sporadic firing ------------------------------------------------------------------------------------


def test_sporadic_defaults_to_every_candidate() -> None:
    assert Sporadic.from_env({}) == Sporadic(1.0, "block", 0)
    blank = {faults.SPORADIC_ENV: " ", faults.SHAPE_ENV: "", faults.SEED_ENV: ""}
    assert Sporadic.from_env(blank) == Sporadic(1.0, "block", 0)
    env = {faults.SPORADIC_ENV: "0.2", faults.SHAPE_ENV: " restore ", faults.SEED_ENV: "-7"}
    assert Sporadic.from_env(env) == Sporadic(0.2, "restore", -7)


@pytest.mark.parametrize(
    ("var", "value"),
    [
        ("BLACKBOX_FAULT_SPORADIC", "1.5"),
        ("BLACKBOX_FAULT_SPORADIC", "-0.1"),
        ("BLACKBOX_FAULT_SPORADIC", "nan"),
        ("BLACKBOX_FAULT_SPORADIC", "20%"),
        ("BLACKBOX_FAULT_SHAPE", "blocks"),
        ("BLACKBOX_FAULT_SEED", "0.5"),
    ],
)
def test_a_bad_sporadic_setting_fails_start_up_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch, restore_targets: None, var: str, value: str
) -> None:
    with pytest.raises(ValueError, match=var):
        Sporadic.from_env({var: value})
    monkeypatch.setenv(plugin.ENV_VAR, "faults")
    monkeypatch.setenv(faults.FAULT_ENV, "stale-checkpoint")
    monkeypatch.setenv(var, value)
    with pytest.raises(ValueError, match=var):
        plugin.register()
    assert _patched() == []


def test_draw_is_fixed_by_seed_and_parts() -> None:
    assert draw(0, b"a", b"bc") == draw(0, b"a", b"bc")
    assert draw(0, b"a", b"bc") != draw(1, b"a", b"bc")
    assert draw(0, b"a", b"bc") != draw(0, b"ab", b"c")  # length-prefixed: no two splits collide
    values = [draw(3, i.to_bytes(4, "little")) for i in range(4000)]
    assert all(0.0 <= v < 1.0 for v in values)
    # Exact binomial test that a quarter of the draws fall below 0.25, as uniform draws would (fixed data,
    # so this either always or never passes; it would fail on a biased or truncated hash).
    below = sum(v < 0.25 for v in values)
    assert binomtest(below, len(values), 0.25).pvalue > 0.001


def _docs(n: int, length: int = 300) -> list[list[int]]:
    """n distinct token sequences (conversations), each `length` long."""
    return [[i, *range(1000, 1000 + length - 1)] for i in range(n)]


@pytest.mark.parametrize("shape", ["block", "restore"])
@pytest.mark.parametrize("fraction", [0.1, 0.2, 0.5])
def test_gate_fires_on_about_the_fraction_of_distinct_candidates(shape: str, fraction: float) -> None:
    gate = SporadicGate(Sporadic(fraction, shape, seed=11))
    fired = sum(gate.decide(i, doc[:256], doc).fires for i, doc in enumerate(_docs(2000)))
    # Exact two-sided binomial test of the fired share against the knob (the draws are hash-uniform).
    assert binomtest(fired, 2000, fraction).pvalue > 0.001, fired


@pytest.mark.parametrize("shape", ["block", "restore"])
def test_gate_is_deterministic_given_the_seed(shape: str) -> None:
    def decisions(seed: int) -> list[bool]:
        gate = SporadicGate(Sporadic(0.3, shape, seed))
        return [gate.decide(i, doc[:128], doc).fires for i, doc in enumerate(_docs(200))]

    assert decisions(5) == decisions(5)
    assert decisions(5) != decisions(6)


def test_block_shape_poisons_the_block_for_every_request_resuming_from_it() -> None:
    gate = SporadicGate(Sporadic(0.5, "block", seed=2))
    for doc in _docs(40):
        # Different requests (turn 2, probes, repeats) resuming from the same 256-token block.
        outcomes = {gate.decide(("req", k, doc[0]), doc[:256], [*doc, k]).fires for k in range(6)}
        assert len(outcomes) == 1
        assert gate.decide(("other", doc[0]), doc[:128], doc).block != gate.decide(("x", doc[0]), doc[:256], doc).block
    blocks = {gate.decide(("first", d[0]), d[:256], d).fires for d in _docs(40)}
    assert blocks == {True, False}  # some blocks poisoned, some sound


def test_restore_shape_varies_between_restores_of_the_same_block() -> None:
    gate = SporadicGate(Sporadic(0.5, "restore", seed=2))
    doc = _docs(1)[0]
    # The very same request re-sent 400 times: each restore is its own draw, the block id stays.
    decisions = [gate.decide(("req", k), doc[:256], doc) for k in range(400)]
    assert {d.block for d in decisions} == {block_id(doc[:256])}
    fired = sum(d.fires for d in decisions)
    assert binomtest(fired, 400, 0.5).pvalue > 0.001, fired
    again = SporadicGate(Sporadic(0.5, "restore", seed=2))
    assert [again.decide(("r", k), doc[:256], doc).fires for k in range(400)] == [d.fires for d in decisions]


@pytest.mark.parametrize("shape", ["block", "restore"])
def test_gate_answers_a_request_looked_up_again_the_same(shape: str) -> None:
    gate = SporadicGate(Sporadic(0.5, shape, seed=4))
    doc = _docs(1)[0]
    first = [gate.decide(("req", k), doc[:256], doc) for k in range(50)]
    assert [gate.decide(("req", k), doc[:256], doc) for k in range(50)] == first


@pytest.mark.parametrize("shape", ["block", "restore"])
def test_gate_at_the_ends_of_the_range(shape: str) -> None:
    for fraction, expected in ((0.0, False), (1.0, True)):
        gate = SporadicGate(Sporadic(fraction, shape))
        assert {gate.decide(i, d[:128], d).fires for i, d in enumerate(_docs(100))} == {expected}


def test_counter_logs_skips_apart_and_fault_events_read_them(caplog: pytest.LogCaptureFixture) -> None:
    counter = FaultCounter("eagle-overrun")
    with caplog.at_level(logging.WARNING, logger="vllm.blackbox"):
        assert counter.fire("a", "aa01")
        assert counter.skip("b", "bb02")
        assert not counter.skip("a", "aa01")  # a key counts once, fired or skipped
        assert counter.skip("c", "cc03")
    assert (counter.count, counter.skipped) == (1, 2)
    assert fired_counts(caplog.text) == {"eagle-overrun": 1}
    assert skipped_counts(caplog.text) == {"eagle-overrun": 2}
    assert fault_events(caplog.text) == [
        FaultEvent(True, "eagle-overrun", "aa01"),
        FaultEvent(False, "eagle-overrun", "bb02"),
        FaultEvent(False, "eagle-overrun", "cc03"),
    ]


@pytest.mark.parametrize("name", ["eagle-overrun", "stale-checkpoint"])
def test_real_manager_sporadic_block_decides_by_the_resumed_block(
    monkeypatch: pytest.MonkeyPatch, restore_targets: None, caplog: pytest.LogCaptureFixture, name: str
) -> None:
    monkeypatch.setenv(faults.SPORADIC_ENV, "0.5")
    outcomes = set()
    for seed in range(12):
        monkeypatch.setenv(faults.SEED_ENV, str(seed))
        monkeypatch.setattr(faults, "_gates", {})
        monkeypatch.setattr(faults, "_counters", {})
        _install(monkeypatch, name)
        cache = _real_cache((128, 384, 512, 640))
        tokens = list(range(700))
        expected = SporadicGate(Sporadic(0.5, "block", seed)).decide("any", tokens[:512], tokens).fires
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="vllm.blackbox"):
            blocks, hit, _ = cache.manager.get_computed_blocks(cache.request)
        assert hit == 512
        assert (blocks.blocks[0][-1] is not cache.mamba[512]) is expected
        event = FaultEvent(expected, name, block_id(tokens[:512]))
        assert fault_events(caplog.text) == [event]
        outcomes.add(expected)
        _unpatch(monkeypatch)  # the next seed installs afresh
    assert outcomes == {True, False}


def test_real_manager_skips_everything_at_sporadic_zero(
    monkeypatch: pytest.MonkeyPatch, restore_targets: None, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv(faults.SPORADIC_ENV, "0")
    monkeypatch.setenv(faults.SHAPE_ENV, "restore")
    _install(monkeypatch, "stale-checkpoint")
    cache = _real_cache((128, 384, 512, 640))
    with caplog.at_level(logging.WARNING, logger="vllm.blackbox"):
        blocks, _, _ = cache.manager.get_computed_blocks(cache.request)
        cache.manager.get_computed_blocks(cache.request)  # looked up again: still one candidate
    assert blocks.blocks[0][-1] is cache.mamba[512]
    assert (fired_counts(caplog.text), skipped_counts(caplog.text)) == ({}, {"stale-checkpoint": 1})


def test_chunk_end_fault_skipped_by_the_draw_leaves_the_snapshot(caplog: pytest.LogCaptureFixture) -> None:
    counter = FaultCounter("chunk-end-as-boundary")
    fault = faults._ChunkEndFault(counter, SporadicGate(Sporadic(0.0, "block")))
    objs = _runner_objects({"frag": (128, 64, 192, [3, 4, 5])}, new={"frag": 0})
    before = [s.clone() for s in objs["forward_context"]["gdn0"].kv_cache]
    with caplog.at_level(logging.WARNING, logger="vllm.blackbox"):
        fault.plan(objs["scheduler_output"], objs["input_batch"], objs["requests"], objs["copy_bufs"])
        fault.run(objs["kv_cache_config"], objs["forward_context"])
    for b, a in zip(before, objs["forward_context"]["gdn0"].kv_cache, strict=True):
        assert torch.equal(b, a)
    # The poisoned-or-not block is boundary 128 of this prompt.
    assert fault_events(caplog.text) == [FaultEvent(False, "chunk-end-as-boundary", block_id(list(range(128))))]
