"""The checks before the workload, on hand-built facts: one model on every arm, and each server in its role."""

from __future__ import annotations

from dataclasses import replace

from blackbox import comparability
from blackbox.comparability import ArmFacts
from blackbox.history import Arm, Exchange, TokenLogprob
from blackbox.metrics import parse

HARD = 2.0
ANSWER = tuple(TokenLogprob(w, -0.1, ((w, -0.1), ("x", -5.0))) for w in ("once", "upon", "a", "time"))
TREATMENT_CACHE = {"block_size": "128", "enable_prefix_caching": "True", "mamba_cache_mode": "align",
                   "mamba_ssm_cache_dtype": "float32", "num_gpu_blocks": "8192"}  # fmt: skip


def _metrics(cache: dict[str, str], drafts: bool) -> str:
    labels = ",".join(f'{k}="{v}"' for k, v in cache.items())
    lines = ["# TYPE vllm:cache_config_info gauge", f"vllm:cache_config_info{{{labels}}} 1.0"]
    if drafts:
        lines += ["# TYPE vllm:spec_decode_num_drafts counter", "vllm:spec_decode_num_drafts_total 0.0"]
    return "\n".join(lines) + "\n"


def _facts(arm: str, port: int, cache: dict[str, str], drafts: bool, **changes: object) -> ArmFacts:
    answer = Exchange(-1, arm, "comparability", "c", tokens=ANSWER, cached_tokens=0)
    facts = ArmFacts(arm, f"http://127.0.0.1:{port}", "tiny", 4096, (1, 2, 3), answer, parse(_metrics(cache, drafts)))
    return replace(facts, **changes)  # type: ignore[arg-type]


def _trio(**reference_changes: object) -> dict[str, ArmFacts]:
    control_cache = {**TREATMENT_CACHE, "enable_prefix_caching": "False", "mamba_cache_mode": "none"}
    reference_cache = {**TREATMENT_CACHE, "num_gpu_blocks": "16384"}  # capacity differs: the drafter takes memory
    return {
        Arm.TREATMENT: _facts(Arm.TREATMENT, 8000, TREATMENT_CACHE, drafts=True),
        Arm.CONTROL: _facts(Arm.CONTROL, 8001, control_cache, drafts=True),
        Arm.REFERENCE: _facts(Arm.REFERENCE, 8002, reference_cache, drafts=False, **reference_changes),
    }


def _by_check(facts: dict[str, ArmFacts]) -> dict[str, tuple[str, str | None, str]]:
    return {f.check: (f.status.value, f.error_class, f.reason) for f in comparability.check(facts, HARD)}


def test_three_servers_of_one_model_in_their_roles_pass() -> None:
    found = _by_check(_trio())
    assert found["comparability"][:2] == ("PASS", None), found
    assert found["roles"][:2] == ("PASS", None), found


def test_one_server_given_twice_is_a_usage_error() -> None:
    facts = _trio()
    facts[Arm.REFERENCE] = replace(facts[Arm.REFERENCE], url="http://localhost:8000/")  # the treatment, spelt otherwise
    status, error, reason = _by_check(facts)["comparability"]
    assert (status, error) == ("ERROR", "UsageError") and "treatment and reference are one server" in reason


def test_another_model_or_tokenizer_is_a_usage_error() -> None:
    status, error, reason = _by_check(_trio(model="other", token_ids=(9, 9)))["comparability"]
    assert (status, error) == ("ERROR", "UsageError")
    assert "the reference serves 'other'" in reason and "tokenizes a fixed text differently" in reason


def test_a_reference_caching_another_ssm_dtype_is_a_role_error() -> None:
    """Its hits would deviate from recomputation by another amount than the treatment's, and a correct treatment
    would read as corrupt (or a corrupt one as clean) against that yardstick."""
    cache = {**TREATMENT_CACHE, "mamba_ssm_cache_dtype": "bfloat16"}
    facts = _trio()
    facts[Arm.REFERENCE] = _facts(Arm.REFERENCE, 8002, cache, drafts=False)
    status, error, reason = _by_check(facts)["roles"]
    assert (status, error) == ("ERROR", "UsageError")
    assert "mamba_ssm_cache_dtype=bfloat16, the treatment float32" in reason


def test_a_setting_only_one_side_publishes_is_not_compared() -> None:
    cache = {k: v for k, v in TREATMENT_CACHE.items() if k != "mamba_ssm_cache_dtype"}
    facts = _trio()
    facts[Arm.REFERENCE] = _facts(Arm.REFERENCE, 8002, cache, drafts=False)
    assert _by_check(facts)["roles"][:2] == ("PASS", None)


def test_a_reference_with_speculative_decoding_is_a_role_error() -> None:
    facts = _trio()
    facts[Arm.REFERENCE] = _facts(Arm.REFERENCE, 8002, TREATMENT_CACHE, drafts=True)
    status, error, reason = _by_check(facts)["roles"]
    assert (status, error) == ("ERROR", "UsageError") and "the reference runs speculative decoding" in reason
