"""One server under test, over HTTP. Requests return records; only readiness and discovery raise.

Each request carries an `X-Blackbox-Case` header so a server log line can be matched to the run's history.
The API key is sent but never stored: recorded requests hold the body only, and every message and body that is
kept passes the run's redactor first (a server may echo the request headers into an error body).

Retries (tenacity): connection errors, 429 (after its `Retry-After`) and 503, at most `ATTEMPTS` tries within
`RETRY_BUDGET_S` seconds; every retry is reported to the run's `Watch` (retries.jsonl). Other 4xx are not retried:
asking again cannot fix a wrong key, URL or body. A read timeout is not retried either: the server may still be
working on the request, and a second copy would change what its cache holds.
"""

from __future__ import annotations

import asyncio
import dataclasses
import email.utils
import time
from collections.abc import Mapping, Sequence
from typing import Any

import httpx
from tenacity import AsyncRetrying, RetryCallState, wait_exponential

from blackbox.errors import BlackboxError, ConfigMismatch, EndpointError
from blackbox.history import Exchange, TokenLogprob
from blackbox.metrics import MetricsSnapshot, combine, is_vllm, parse
from blackbox.server_info import ServerInfo, server_info
from blackbox.watch import Watch

__all__ = ["ATTEMPTS", "RETRY_BUDGET_S", "Endpoint", "parse_chat"]

CASE_HEADER = "X-Blackbox-Case"
_TRANSIENT = (
    httpx.ConnectError,
    httpx.ReadError,
    httpx.WriteError,
    httpx.RemoteProtocolError,
    httpx.ConnectTimeout,
    httpx.PoolTimeout,
)
RETRY_STATUS = frozenset({429, 503})
ATTEMPTS = 4
RETRY_BUDGET_S = 60.0
CONTROL_TIMEOUT_S = 30.0  # /health, /v1/models, /metrics, /tokenize: fast on any live server
_BODY_CHARS = 300


class Endpoint:
    def __init__(
        self,
        arm: str,
        base_url: str,
        *,
        api_key: str | None = None,
        model: str | None = None,
        timeout_s: float = 300.0,
        transport: httpx.AsyncBaseTransport | None = None,
        watch: Watch | None = None,
        key_source: str = "",
        metrics_urls: Sequence[str] = (),
    ) -> None:
        self.arm = arm
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.timeout_s = timeout_s
        self.watch = watch or Watch()
        self.key_source = key_source  # how the key is given, for the hint on a 401 (never the key)
        self.scrapes: list[MetricsSnapshot] = []  # every /metrics read, without its text, for restart detection
        self._scrape_lock = asyncio.Lock()
        # Replicas behind a router: their /metrics summed stand for the one endpoint the requests go to.
        self.metrics_urls = tuple(metrics_urls)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.AsyncClient(base_url=self.base_url, headers=headers, timeout=timeout_s, transport=transport)

    @property
    def where(self) -> str:
        return f"{self.arm} at {self.base_url}"

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> Endpoint:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def ready(self) -> str:
        """Check /health, /v1/models and that /metrics is vLLM's; resolve and return the served model name."""
        await self._get("/health")
        models = (await self._get_json("/v1/models")).get("data") or []
        names = [str(m["id"]) for m in models if isinstance(m, dict) and m.get("id")]
        if not names:
            raise EndpointError(f"{self.where} serves no model (/v1/models is empty)", hint="check the server log")
        if self.model is not None and self.model not in names:
            raise ConfigMismatch(
                f"{self.where} does not serve model {self.model!r} (it serves {', '.join(map(repr, names))})",
                hint=f"pass --model {names[0]}, or point --{self.arm} at the server that serves {self.model}",
            )
        if not is_vllm(await self.metrics()):
            raise ConfigMismatch(
                f"{self.where}: /metrics has no vllm:* series; is this a vLLM server?",
                hint="blackbox reads vLLM's prefix-cache and speculative-decoding counters: point "
                f"--{self.arm} at a vLLM OpenAI-compatible server (its root URL, e.g. http://host:8000)",
            )
        self.model = self.model or names[0]
        return self.model

    async def max_model_len(self) -> int | None:
        for m in (await self._get_json("/v1/models")).get("data") or []:
            if m.get("id") == self.model and isinstance(m.get("max_model_len"), int):
                return int(m["max_model_len"])
        return None

    async def metrics(self) -> MetricsSnapshot:
        """Parse /metrics (summed over `metrics_urls` when given), keep a text-less copy in `scrapes` and report
        it to the watch (scrapes.jsonl). One scrape at a time per server, so `scrapes` is in the order of the
        states it shows (periodic scrapes go on while the settled one is read)."""
        async with self._scrape_lock:
            return await self._scrape()

    async def _scrape(self) -> MetricsSnapshot:
        # A /metrics that answered before and now 404s is gone mid-run (EndpointError); one that never answered
        # means this is not a vLLM server (ConfigMismatch, like any first 404).
        gone = self._metrics_gone_hint() if self.scrapes else ""
        try:
            pages = [(await self._get(path, missing_hint=gone), path) for path in (self.metrics_urls or ("/metrics",))]
            at = self.watch.since_start()  # when the page arrived
            snaps = [parse(r.text, source=f"{self.where}{p}" if p.startswith("/") else p, at=at) for r, p in pages]
            snap = snaps[0] if len(snaps) == 1 else combine(snaps)
        except BlackboxError as exc:
            self.watch.on_scrape(self.arm, {"at": round(self.watch.since_start(), 3), "error": exc.message})
            raise
        changed = not self.scrapes or self.scrapes[-1].created != snap.created
        self.scrapes.append(dataclasses.replace(snap, text="", info={}))
        self.watch.on_scrape(self.arm, snap.compact(with_created=changed))
        return snap

    def _metrics_gone_hint(self) -> str:
        return "/metrics answered earlier in this run: did the server restart or get replaced mid-run?"

    async def info(self, snapshot: MetricsSnapshot | None = None) -> ServerInfo:
        """Its vLLM release and the cache settings it tells (never raises: what it hides becomes a note)."""
        return await server_info(self._http, snapshot)

    async def count_tokens(self, messages: Sequence[Mapping[str, str]], *, generation_prompt: bool = True) -> int:
        body = {"model": self.model, "messages": list(messages), "add_generation_prompt": generation_prompt}
        data = await self._post_json("/tokenize", body)
        count = data.get("count")
        if not isinstance(count, int):
            raise EndpointError(f"{self.where}/tokenize returned no count: {self._snippet(str(data))}")
        return count

    async def tokenize(self, text: str) -> list[int]:
        """Token ids of a plain text (no chat template): a fingerprint of the tokenizer."""
        data = await self._post_json("/tokenize", {"model": self.model, "prompt": text, "add_special_tokens": False})
        ids = data.get("tokens")
        if not isinstance(ids, list):
            raise EndpointError(f"{self.arm}: /tokenize returned no tokens: {str(data)[:200]}")
        return [int(i) for i in ids]

    async def chat(self, body: Mapping[str, Any], *, conversation: int, kind: str) -> Exchange:
        """POST /v1/chat/completions; transport faults and bad responses come back as an Exchange with error."""
        case_id = f"c{conversation:03d}-{self.arm}-{kind}"
        request = {"model": self.model, **body}
        started, started_s = time.monotonic(), self.watch.since_start()
        status: int | None = None
        outcome: dict[str, Any]
        path = "/v1/chat/completions"
        try:
            response = await self._send("POST", path, json=request, case_id=case_id, timeout=self.timeout_s)
            status = response.status_code
            if status != 200:
                raise EndpointError(self._status_message(response, f"POST {path}"))
            payload = response.json()
            outcome = {"response": self.watch.redact.data(payload), **parse_chat(payload)}
        except EndpointError as exc:
            outcome = {"error": str(exc)}
        except httpx.HTTPError as exc:
            outcome = {"error": self._transport_message(exc, f"POST {path}", self.timeout_s)}
        except ValueError as exc:
            outcome = {"error": self._not_json_message(response, f"POST {path}", exc)}
        except (LookupError, TypeError, AttributeError) as exc:
            outcome = {
                "error": f"{self.where} answered POST {path} with a malformed chat completion "
                f"({type(exc).__name__}: {self.watch.redact(str(exc))[:200]})"
            }
        return Exchange(
            conversation,
            self.arm,
            kind,
            case_id,
            elapsed_s=time.monotonic() - started,
            request=request,
            status_code=status,
            started_s=started_s,
            **outcome,
        )

    # --- transport ------------------------------------------------------------------------------------------

    async def _send(
        self, method: str, path: str, *, case_id: str = "", timeout: float | None = None, **kw: Any
    ) -> httpx.Response:
        """One request with bounded retries; returns the last response (maybe a 429/503) or raises the last
        transport error."""
        headers = {CASE_HEADER: case_id} if case_id else {}
        limit = timeout if timeout is not None else min(self.timeout_s, CONTROL_TIMEOUT_S)
        what = f"{method} {path}" + (f" [{case_id}]" if case_id else "")

        def record(state: RetryCallState, **extra: Any) -> None:
            reason = _reason(state)
            self.watch.on_retry(
                {
                    "at": round(self.watch.since_start(), 3),
                    "server": self.arm,
                    "url": self.base_url,
                    "request": what,
                    "attempt": state.attempt_number,
                    "reason": self.watch.redact(reason)[:200],
                    **extra,
                }
            )

        def stop(state: RetryCallState) -> bool:
            next_wait = _wait(state)
            return state.attempt_number >= ATTEMPTS or (state.seconds_since_start or 0.0) + next_wait > RETRY_BUDGET_S

        def give_up(state: RetryCallState) -> httpx.Response:
            assert state.outcome is not None
            if state.attempt_number > 1 or _retryable(state):
                record(state, gave_up=True, elapsed_s=round(state.seconds_since_start or 0.0, 3))
            return state.outcome.result()  # the last response, or the last transport error raised

        retrying = AsyncRetrying(
            retry=_retryable,
            stop=stop,
            wait=_wait,
            before_sleep=lambda state: record(state, wait_s=round(_wait(state), 3)),
            retry_error_callback=give_up,
            sleep=lambda seconds: _sleep(seconds),
        )
        with self.watch.waiting(f"{self.arm} ({self.base_url})", what, limit):
            result: httpx.Response = await retrying(
                self._http.request, method, path, headers=headers, timeout=limit, **kw
            )
        return result

    async def _get(self, path: str, *, missing_hint: str = "") -> httpx.Response:
        try:
            response = await self._send("GET", path)
        except httpx.HTTPError as exc:
            raise EndpointError(
                self._transport_message(exc, f"GET {path}", min(self.timeout_s, CONTROL_TIMEOUT_S)),
                hint=_transport_hint(exc),
            ) from exc
        if response.status_code != 200:
            self._raise_status(response, f"GET {path}", missing_hint)
        return response

    async def _get_json(self, path: str) -> dict[str, Any]:
        return self._json(await self._get(path), f"GET {path}")

    async def _post_json(self, path: str, body: Mapping[str, Any]) -> dict[str, Any]:
        try:
            response = await self._send("POST", path, json=dict(body))
        except httpx.HTTPError as exc:
            raise EndpointError(
                self._transport_message(exc, f"POST {path}", min(self.timeout_s, CONTROL_TIMEOUT_S)),
                hint=_transport_hint(exc),
            ) from exc
        if response.status_code != 200:
            self._raise_status(response, f"POST {path}")
        return self._json(response, f"POST {path}")

    def _json(self, response: httpx.Response, what: str) -> dict[str, Any]:
        try:
            data = response.json()
        except ValueError as exc:
            raise EndpointError(self._not_json_message(response, what, exc), hint="is this a vLLM server?") from exc
        if not isinstance(data, dict):
            raise EndpointError(f"{self.where}: {what} returned JSON {type(data).__name__}, not an object")
        return data

    # --- messages: server, problem, fix ---------------------------------------------------------------------

    def _snippet(self, text: str) -> str:
        # Redact before cutting, so a key split by the cut cannot leak its first half.
        return repr(self.watch.redact(text)[:_BODY_CHARS])

    def _status_message(self, response: httpx.Response, what: str) -> str:
        status = response.status_code
        base = f"{self.where} answered {what} with HTTP {status}"
        if status in (401, 403):
            return f"{base}: is the API key right? ({self.key_source or 'no key sent'})"
        if status == 404:
            return f"{base}: pass the server root as the URL (no /v1 suffix), and check it is a vLLM server"
        if status in RETRY_STATUS:
            return f"{base} after {ATTEMPTS} attempts or {RETRY_BUDGET_S:g} s of retries: the server is overloaded"
        return f"{base}: {self._snippet(response.text)}"

    def _raise_status(self, response: httpx.Response, what: str, missing_hint: str = "") -> None:
        message = self._status_message(response, what)
        if response.status_code in (401, 403):
            raise ConfigMismatch(
                message, hint="set the key's variable (--api-key-env NAME) or pass --api-key-file PATH"
            )
        if response.status_code == 404:
            if missing_hint:
                raise EndpointError(message, hint=missing_hint)
            raise ConfigMismatch(message, hint=f"e.g. --{self.arm} http://host:8000, not http://host:8000/v1")
        raise EndpointError(message, hint="check the server log")

    def _transport_message(self, exc: httpx.HTTPError, what: str, limit: float) -> str:
        if isinstance(exc, httpx.TimeoutException) and not isinstance(exc, httpx.ConnectTimeout):
            return (
                f"{self.where} did not answer {what} within {limit:g} s ({type(exc).__name__}): "
                "raise --request-timeout, or check that the server is not stuck"
            )
        detail = self.watch.redact(str(exc))[:200] or "no detail"
        return f"{self.where}: {what} failed: {type(exc).__name__}: {detail}"

    def _not_json_message(self, response: httpx.Response, what: str, exc: Exception) -> str:
        return (
            f"{self.where} answered {what} with a body that is not JSON, maybe truncated "
            f"({type(exc).__name__}; {len(response.content)} bytes): {self._snippet(response.text)}"
        )


def _transport_hint(exc: httpx.HTTPError) -> str:
    if isinstance(exc, httpx.TimeoutException) and not isinstance(exc, httpx.ConnectTimeout):
        return "the server took the connection but did not answer: check its log (stuck, overloaded, still loading?)"
    return "is the server up and the URL right?"


async def _sleep(seconds: float) -> None:
    await asyncio.sleep(seconds)  # looked up per call, so tests can take the wait out


def _retryable(state: RetryCallState) -> bool:
    outcome = state.outcome
    if outcome is None:
        return False
    if outcome.failed:
        return isinstance(outcome.exception(), _TRANSIENT)
    return bool(outcome.result().status_code in RETRY_STATUS)


def _wait(state: RetryCallState) -> float:
    """Exponential backoff, or the server's Retry-After on a 429/503 that sends one."""
    backoff = float(wait_exponential(multiplier=0.5, max=8)(state))
    outcome = state.outcome
    if outcome is None or outcome.failed:
        return backoff
    after = retry_after(outcome.result().headers.get("retry-after"))
    return backoff if after is None else after


def retry_after(value: str | None) -> float | None:
    """Seconds from a Retry-After header: delta-seconds or an HTTP date."""
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


def _reason(state: RetryCallState) -> str:
    outcome = state.outcome
    if outcome is None:
        return "unknown"
    if outcome.failed:
        exc = outcome.exception()
        return f"{type(exc).__name__}: {exc}"
    response = outcome.result()
    after = response.headers.get("retry-after")
    return f"HTTP {response.status_code}" + (f" (Retry-After: {after})" if after else "")


def parse_chat(payload: Mapping[str, Any]) -> dict[str, Any]:
    """The fields graders read from a chat completion. Raises LookupError, TypeError or AttributeError on a
    malformed one."""
    choice = payload["choices"][0]
    usage = payload.get("usage") or {}
    details = usage.get("prompt_tokens_details") or {}
    content = choice["message"].get("content") or ""
    if not isinstance(content, str):
        raise TypeError(f"message.content is {type(content).__name__}, not a string")
    logprobs = (choice.get("logprobs") or {}).get("content") or []
    tokens = tuple(
        TokenLogprob(
            str(t["token"]),
            float(t["logprob"]),
            tuple((str(a["token"]), float(a["logprob"])) for a in t.get("top_logprobs") or ()),
        )
        for t in logprobs
    )
    cached = details.get("cached_tokens")
    return {
        "text": content,
        "tokens": tokens,
        "prompt_tokens": usage.get("prompt_tokens"),
        "cached_tokens": int(cached) if cached is not None else None,
        "completion_tokens": usage.get("completion_tokens"),
        "finish_reason": choice.get("finish_reason"),
    }


async def gather_bounded(limit: int, *coros: Any) -> list[Any]:
    sem = asyncio.Semaphore(limit)

    async def run(c: Any) -> Any:
        async with sem:
            return await c

    return await asyncio.gather(*(run(c) for c in coros))
