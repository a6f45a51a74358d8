"""The HTTP client against httpx.MockTransport: requests come back as records, only readiness raises."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import httpx
import pytest
import tenacity

from blackbox import client, errors, store
from blackbox.client import Endpoint
from blackbox.history import Kind
from blackbox.secrets import Redactor
from blackbox.watch import Heartbeat, Watch

KEY = "sk-very-secret-0123456789"
Handler = Callable[[httpx.Request], httpx.Response]

CHAT: dict[str, Any] = {
    "id": "chatcmpl-1",
    "object": "chat.completion",
    "model": "tiny",
    "choices": [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "alpha bravo"},
            "logprobs": {
                "content": [
                    {
                        "token": "alpha",
                        "logprob": -0.01,
                        "bytes": [97, 108, 112, 104, 97],
                        "top_logprobs": [{"token": "alpha", "logprob": -0.01}, {"token": "zulu", "logprob": -4.6}],
                    },
                    {"token": "bravo", "logprob": -0.5, "bytes": None, "top_logprobs": []},
                ]
            },
            "finish_reason": "length",
        }
    ],
    "usage": {
        "prompt_tokens": 368,
        "completion_tokens": 2,
        "total_tokens": 370,
        "prompt_tokens_details": {"cached_tokens": 256},
    },
}

MODELS: dict[str, Any] = {"object": "list", "data": [{"id": "tiny", "object": "model", "max_model_len": 4096}]}


@pytest.fixture(autouse=True)
def no_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    """Retries keep their count but not their sleeps, so the suite stays fast."""
    monkeypatch.setattr(client, "wait_exponential", lambda **_: tenacity.wait_none())


def endpoint(handler: Handler, **kw: Any) -> Endpoint:
    return Endpoint("treatment", "http://server:8000/", transport=httpx.MockTransport(handler), **kw)


def respond(payload: Any, status: int = 200) -> Handler:
    return lambda request: httpx.Response(status, json=payload)


async def chat(handler: Handler, **kw: Any) -> Any:
    async with endpoint(handler, model="tiny", **kw) as ep:
        return await ep.chat({"messages": [{"role": "user", "content": "hi"}]}, conversation=3, kind=Kind.TURN2)


# --- chat ---------------------------------------------------------------------------------------------------


async def test_chat_parses_text_logprobs_and_cached_tokens() -> None:
    e = await chat(respond(CHAT))
    assert e.ok and e.error is None
    assert (e.conversation, e.arm, e.kind, e.case_id) == (3, "treatment", Kind.TURN2, "c003-treatment-turn2")
    assert e.text == "alpha bravo"
    assert [(t.token, t.logprob) for t in e.tokens] == [("alpha", -0.01), ("bravo", -0.5)]
    assert e.tokens[0].top == (("alpha", -0.01), ("zulu", -4.6))
    assert e.tokens[0].margin == pytest.approx(4.59)
    assert e.tokens[1].top == () and e.tokens[1].margin is None
    assert (e.prompt_tokens, e.cached_tokens, e.completion_tokens) == (368, 256, 2)
    assert e.finish_reason == "length"
    assert e.status_code == 200
    assert e.request == {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
    assert e.response == CHAT


@pytest.mark.parametrize("usage", [{"prompt_tokens": 368, "prompt_tokens_details": None}, {"prompt_tokens": 368}, None])
async def test_chat_without_prompt_tokens_details_has_no_cached_tokens(usage: Any) -> None:
    e = await chat(respond({**CHAT, "usage": usage}))
    assert e.ok
    assert e.cached_tokens is None


async def test_chat_with_zero_cached_tokens_is_zero_not_none() -> None:
    usage = {**CHAT["usage"], "prompt_tokens_details": {"cached_tokens": 0}}
    assert (await chat(respond({**CHAT, "usage": usage}))).cached_tokens == 0


async def test_chat_without_logprobs_has_no_tokens() -> None:
    choice = {**CHAT["choices"][0], "logprobs": None}
    e = await chat(respond({**CHAT, "choices": [choice]}))
    assert e.ok and e.tokens == ()


async def test_http_500_is_recorded_not_raised() -> None:
    e = await chat(respond({"error": "engine dead"}, status=500))
    assert not e.ok
    assert e.status_code == 500
    assert "HTTP 500" in e.error and "engine dead" in e.error
    assert e.response is None
    assert e.request["model"] == "tiny"


async def test_non_json_is_recorded_not_raised() -> None:
    e = await chat(lambda request: httpx.Response(200, text="<html>gateway</html>"))
    assert not e.ok
    assert e.status_code == 200


def _choice(**message: Any) -> dict[str, Any]:
    return {**CHAT, "choices": [{"index": 0, "message": message, "finish_reason": "stop"}]}


@pytest.mark.parametrize(
    "payload",
    [
        {"id": "x", "usage": CHAT["usage"]},  # no choices
        {**CHAT, "choices": []},
        {**CHAT, "choices": None},
        _choice(role="assistant", content=["alpha"]),  # content not a string
        _choice(role="assistant", content={"text": "alpha"}),
        {**CHAT, "choices": [{"index": 0, "message": "alpha"}]},  # message not an object
        {**CHAT, "choices": [{"index": 0}]},  # no message
        {**CHAT, "choices": [{**CHAT["choices"][0], "logprobs": {"content": [{"token": "a", "logprob": None}]}}]},
        {**CHAT, "choices": [{**CHAT["choices"][0], "logprobs": {"content": [{"logprob": -1.0}]}}]},
        [CHAT],  # not an object
        "alpha",
    ],
)
async def test_a_malformed_body_is_recorded_not_raised(payload: Any) -> None:
    e = await chat(respond(payload))
    assert not e.ok
    assert e.error
    assert e.tokens == ()


async def test_a_null_content_reads_as_empty_text() -> None:
    e = await chat(respond(_choice(role="assistant", content=None)))
    assert e.ok and e.text == ""


async def test_connect_errors_are_retried_then_recorded() -> None:
    calls = 0

    def refuse(request: httpx.Request) -> httpx.Response:
        nonlocal calls
        calls += 1
        raise httpx.ConnectError("connection refused", request=request)

    e = await chat(refuse)
    assert calls == client.ATTEMPTS
    assert not e.ok and "ConnectError" in e.error
    assert e.status_code is None


async def test_a_transient_error_then_success_is_ok() -> None:
    calls = 0

    def flaky(request: httpx.Request) -> httpx.Response:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise httpx.RemoteProtocolError("peer closed", request=request)
        return httpx.Response(200, json=CHAT)

    assert (await chat(flaky)).ok
    assert calls == 2


# --- headers and secrets ------------------------------------------------------------------------------------


async def test_case_header_and_key_are_sent_but_the_key_is_never_recorded() -> None:
    seen: list[httpx.Request] = []

    def capture(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json=CHAT)

    e = await chat(capture, api_key=KEY)
    [request] = seen
    assert request.headers["X-Blackbox-Case"] == "c003-treatment-turn2"
    assert request.headers["Authorization"] == f"Bearer {KEY}"
    assert request.url == "http://server:8000/v1/chat/completions"
    assert json.loads(request.content)["model"] == "tiny"
    assert KEY not in json.dumps(e.to_json())
    command = store.curl_command("http://server:8000", e, "BLACKBOX_API_KEY")
    assert KEY not in command
    assert "${BLACKBOX_API_KEY:-}" in command
    assert "X-Blackbox-Case: c003-treatment-turn2" in command


async def test_no_key_no_authorization_header() -> None:
    seen: list[httpx.Request] = []

    def capture(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json=CHAT)

    await chat(capture)
    assert "Authorization" not in seen[0].headers


# --- readiness and discovery --------------------------------------------------------------------------------


VLLM_METRICS = 'vllm:num_requests_running{engine="0"} 0.0\n'


def server(models: Any = MODELS, health: int = 200, metrics_text: str = VLLM_METRICS) -> Handler:
    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/health":
            return httpx.Response(health)
        if request.url.path == "/v1/models":
            return httpx.Response(200, json=models)
        if request.url.path == "/metrics":
            return httpx.Response(200, text=metrics_text)
        if request.url.path == "/tokenize":
            body = json.loads(request.content)
            return httpx.Response(200, json={"count": 7 * len(body["messages"]), "max_model_len": 4096})
        return httpx.Response(404)

    return handle


async def test_ready_resolves_the_served_model() -> None:
    async with endpoint(server()) as ep:
        assert await ep.ready() == "tiny"
        assert ep.model == "tiny"
        assert await ep.max_model_len() == 4096
    async with endpoint(server(), model="tiny") as ep:
        assert await ep.ready() == "tiny"


async def test_ready_names_the_fix_when_the_model_is_not_served() -> None:
    async with endpoint(server(), model="Qwen/Qwen3-Next-80B") as ep:
        with pytest.raises(errors.ConfigMismatch) as info:  # a configuration mismatch: exit 3, not 4
            await ep.ready()
    assert info.value.exit_code == 3
    assert "does not serve model 'Qwen/Qwen3-Next-80B'" in str(info.value)
    assert "--model tiny" in info.value.hint


async def test_ready_with_no_model_served_is_an_endpoint_error() -> None:
    async with endpoint(server(models={"data": []})) as ep:
        with pytest.raises(errors.EndpointError, match="serves no model"):
            await ep.ready()


async def test_unhealthy_server_is_an_endpoint_error() -> None:
    async with endpoint(server(health=503)) as ep:
        with pytest.raises(errors.EndpointError, match="GET /health with HTTP 503"):
            await ep.ready()


async def test_connect_error_on_health_is_an_endpoint_error() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    async with endpoint(refuse) as ep:
        with pytest.raises(errors.EndpointError) as info:
            await ep.ready()
    assert "treatment at http://server:8000: GET /health failed: ConnectError" in str(info.value)
    assert "ConnectError" in str(info.value)
    assert "is the server up" in info.value.hint


async def test_models_that_are_not_json_is_an_endpoint_error() -> None:
    def handle(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, text="ok" if request.url.path == "/health" else "<html>")

    async with endpoint(handle) as ep:
        with pytest.raises(errors.EndpointError, match="not JSON"):
            await ep.ready()


async def test_metrics_are_parsed_and_malformed_metrics_raise() -> None:
    text = '# TYPE vllm:prefix_cache_hits_total counter\nvllm:prefix_cache_hits_total{engine="0"} 5.0\n'
    async with endpoint(server(metrics_text=text)) as ep:
        assert (await ep.metrics()).value("vllm:prefix_cache_hits") == 5
    async with endpoint(server(metrics_text="<html>nope</html>")) as ep:
        with pytest.raises(errors.EndpointError):
            await ep.metrics()


async def test_count_tokens_posts_the_messages() -> None:
    async with endpoint(server(), model="tiny") as ep:
        assert await ep.count_tokens([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]) == 14
    async with endpoint(respond({"tokens": [1, 2]}), model="tiny") as ep:
        with pytest.raises(errors.EndpointError, match="no count"):
            await ep.count_tokens([{"role": "user", "content": "a"}])


async def test_gather_bounded_keeps_order_and_limit() -> None:
    running = peak = 0

    async def job(i: int) -> int:
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        running -= 1
        return i

    assert await client.gather_bounded(2, *(job(i) for i in range(6))) == list(range(6))
    assert peak == 2


# --- retries: 429 (Retry-After), 503 and connection errors only, bounded and reported ---------------------------


def watched(**kw: Any) -> tuple[Watch, list[dict[str, Any]], list[str]]:
    retries: list[dict[str, Any]] = []
    lines: list[str] = []
    watch = Watch(on_retry=lambda r: retries.append(dict(r)), **kw)
    return watch, retries, lines


def sequence(*replies: httpx.Response) -> Handler:
    calls = iter(replies)
    return lambda request: next(calls)


async def test_a_429_is_retried_after_its_retry_after_then_answers(monkeypatch: pytest.MonkeyPatch) -> None:
    slept: list[float] = []

    async def sleep(s: float) -> None:
        slept.append(s)

    monkeypatch.setattr(client, "_sleep", sleep)  # keep the suite fast, and see the wait
    watch, retries, _ = watched()
    handler = sequence(httpx.Response(429, headers={"Retry-After": "2"}), httpx.Response(200, json=CHAT))
    e = await chat(handler, watch=watch)
    assert e.ok
    assert slept == [2.0]
    assert [(r["attempt"], r["reason"], r["wait_s"]) for r in retries] == [(1, "HTTP 429 (Retry-After: 2)", 2.0)]
    assert retries[0]["request"] == "POST /v1/chat/completions [c003-treatment-turn2]"


async def test_a_503_is_retried_a_bounded_number_of_times() -> None:
    watch, retries, _ = watched()
    calls = 0

    def unavailable(request: httpx.Request) -> httpx.Response:
        nonlocal calls
        calls += 1
        return httpx.Response(503)

    e = await chat(unavailable, watch=watch)
    assert calls == client.ATTEMPTS
    assert not e.ok and "HTTP 503 after 4 attempts" in (e.error or "")
    assert retries[-1]["gave_up"] and len(retries) == client.ATTEMPTS


async def test_a_retry_after_past_the_budget_gives_up_at_once() -> None:
    watch, retries, _ = watched()
    e = await chat(sequence(httpx.Response(429, headers={"Retry-After": "999"})), watch=watch)
    assert not e.ok
    assert [r["attempt"] for r in retries] == [1] and retries[0]["gave_up"]


@pytest.mark.parametrize("status", [400, 401, 403, 404, 422])
async def test_other_4xx_are_not_retried(status: int) -> None:
    watch, retries, _ = watched()
    calls = 0

    def refuse(request: httpx.Request) -> httpx.Response:
        nonlocal calls
        calls += 1
        return httpx.Response(status, text="no")

    e = await chat(refuse, watch=watch)
    assert calls == 1 and retries == [] and not e.ok


def test_retry_after_reads_seconds_and_dates() -> None:
    assert client.retry_after("7") == 7.0
    assert client.retry_after(None) is None and client.retry_after("soon") is None
    assert client.retry_after("Wed, 21 Oct 2015 07:28:00 GMT") == 0.0  # in the past: now


# --- messages name the server, the problem and the fix; bodies are redacted before they are cut --------------


async def test_401_names_the_key_source_and_is_a_config_mismatch() -> None:
    async with endpoint(respond({}, 401), key_source="no key sent: $K is not set") as ep:
        with pytest.raises(errors.ConfigMismatch, match=r"HTTP 401: is the API key right\? \(no key sent: \$K"):
            await ep.ready()


async def test_404_suggests_the_server_root() -> None:
    async with endpoint(respond({}, 404)) as ep:
        with pytest.raises(errors.ConfigMismatch, match=r"no /v1 suffix") as info:
            await ep.ready()
    assert "http://host:8000, not http://host:8000/v1" in info.value.hint


async def test_a_server_without_vllm_metrics_is_not_vllm() -> None:
    async with endpoint(server(metrics_text="http_requests_total 3\n")) as ep:
        with pytest.raises(errors.ConfigMismatch, match=r"is this a vLLM server\?"):
            await ep.ready()


async def test_a_key_echoed_in_an_error_body_is_redacted_before_the_body_is_cut() -> None:
    # The key straddles the 300-character cut: cutting first would keep its first half.
    body = "x" * 290 + f"Authorization: Bearer {KEY}"
    watch = Watch(redact=Redactor(KEY))
    e = await chat(lambda r: httpx.Response(500, text=body), api_key=KEY, watch=watch)
    assert e.error and KEY[:8] not in e.error and "HTTP 500" in e.error


async def test_a_slow_request_gets_a_heartbeat_naming_server_request_and_wait() -> None:
    lines: list[str] = []
    watch = Watch(heartbeat=Heartbeat(0.05, lines.append))

    async def slow(request: httpx.Request) -> httpx.Response:
        await asyncio.sleep(0.3)
        return httpx.Response(200, json=CHAT)

    async with endpoint(slow, model="tiny", watch=watch) as ep, watch.running([]):
        await ep.chat({"messages": []}, conversation=1, kind=Kind.TURN1)
    assert lines, "no heartbeat"
    assert lines[0].startswith(
        "blackbox: still waiting on treatment (http://server:8000) for POST /v1/chat/completions "
        "[c001-treatment-turn1]: "
    )
    assert "s so far (timeout 300 s)" in lines[0]


async def test_a_server_with_no_metrics_page_is_not_vllm_but_one_that_lost_it_mid_run_is_an_endpoint_error() -> None:
    gone = False

    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/metrics" and gone:
            return httpx.Response(404)
        return server()(request)

    async with endpoint(lambda r: httpx.Response(404) if r.url.path == "/metrics" else server()(r)) as ep:
        with pytest.raises(errors.ConfigMismatch, match="GET /metrics with HTTP 404"):
            await ep.ready()
    async with endpoint(handle) as ep:
        await ep.ready()
        gone = True
        with pytest.raises(errors.EndpointError) as info:
            await ep.metrics()
    assert type(info.value) is errors.EndpointError
    assert "answered earlier in this run" in info.value.hint
