"""One server under test, over HTTP. Requests return records; only readiness and discovery raise.

Each request carries an `X-Blackbox-Case` header so a server log line can be matched to the run's history.
The API key is sent but never stored: recorded requests hold the body only.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from typing import Any

import httpx
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_attempt, wait_exponential

from blackbox.errors import EndpointError
from blackbox.history import Exchange, TokenLogprob
from blackbox.metrics import MetricsSnapshot, combine, parse

__all__ = ["Endpoint", "parse_chat"]

CASE_HEADER = "X-Blackbox-Case"
_TRANSIENT = (httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError, httpx.ConnectTimeout)


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
        metrics_urls: Sequence[str] = (),
    ) -> None:
        self.arm = arm
        self.base_url = base_url.rstrip("/")
        self.model = model
        # Replicas behind a router: their /metrics summed stand for the one endpoint the requests go to.
        self.metrics_urls = tuple(metrics_urls)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.AsyncClient(base_url=self.base_url, headers=headers, timeout=timeout_s, transport=transport)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> Endpoint:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def ready(self) -> str:
        """Check /health and /v1/models; resolve and return the served model name."""
        await self._get("/health")
        models = (await self._get_json("/v1/models")).get("data") or []
        names = [str(m["id"]) for m in models if isinstance(m, dict) and m.get("id")]
        if not names:
            raise EndpointError(f"{self.arm} at {self.base_url} serves no model", hint="check the server log")
        if self.model is None:
            self.model = names[0]
            return names[0]
        if self.model not in names:
            raise EndpointError(
                f"{self.arm} at {self.base_url} does not serve model {self.model!r} (it serves {names})",
                hint=f"pass --model {names[0]} or point at the right server",
            )
        return self.model

    async def max_model_len(self) -> int | None:
        for m in (await self._get_json("/v1/models")).get("data") or []:
            if m.get("id") == self.model and isinstance(m.get("max_model_len"), int):
                return int(m["max_model_len"])
        return None

    async def metrics(self) -> MetricsSnapshot:
        if not self.metrics_urls:
            return parse((await self._get("/metrics")).text)
        return combine([parse((await self._get(url)).text) for url in self.metrics_urls])

    async def count_tokens(self, messages: Sequence[Mapping[str, str]], *, generation_prompt: bool = True) -> int:
        body = {"model": self.model, "messages": list(messages), "add_generation_prompt": generation_prompt}
        data = await self._post_json("/tokenize", body)
        count = data.get("count")
        if not isinstance(count, int):
            raise EndpointError(f"{self.arm}: /tokenize returned no count: {str(data)[:200]}")
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
        started = time.monotonic()
        status: int | None = None
        outcome: dict[str, Any]
        try:
            response = await self._send("POST", "/v1/chat/completions", json=request, case_id=case_id)
            status = response.status_code
            if status != 200:
                raise EndpointError(f"HTTP {status}: {response.text[:300]}")
            payload = response.json()
            outcome = {"response": payload, **parse_chat(payload)}
        except (httpx.HTTPError, EndpointError, ValueError, LookupError, TypeError, AttributeError) as exc:
            outcome = {"error": f"{type(exc).__name__}: {exc}"}
        return Exchange(
            conversation,
            self.arm,
            kind,
            case_id,
            elapsed_s=time.monotonic() - started,
            request=request,
            status_code=status,
            **outcome,
        )

    async def _send(self, method: str, path: str, *, case_id: str = "", **kw: Any) -> httpx.Response:
        headers = {CASE_HEADER: case_id} if case_id else {}
        async for attempt in AsyncRetrying(
            retry=retry_if_exception_type(_TRANSIENT),
            stop=stop_after_attempt(3),
            wait=wait_exponential(multiplier=0.5, max=4),
            reraise=True,
        ):
            with attempt:
                return await self._http.request(method, path, headers=headers, **kw)
        raise AssertionError("unreachable")

    async def _get(self, path: str) -> httpx.Response:
        try:
            response = await self._send("GET", path)
        except httpx.HTTPError as exc:
            raise EndpointError(
                f"{self.arm} at {self.base_url}{path}: {type(exc).__name__}: {exc}",
                hint="is the server up and the URL right?",
            ) from exc
        if response.status_code != 200:
            raise EndpointError(f"{self.arm} at {self.base_url}{path}: HTTP {response.status_code}")
        return response

    async def _get_json(self, path: str) -> dict[str, Any]:
        return _json(await self._get(path), f"{self.arm} {path}")

    async def _post_json(self, path: str, body: Mapping[str, Any]) -> dict[str, Any]:
        try:
            response = await self._send("POST", path, json=dict(body))
        except httpx.HTTPError as exc:
            raise EndpointError(f"{self.arm} at {self.base_url}{path}: {type(exc).__name__}: {exc}") from exc
        if response.status_code != 200:
            raise EndpointError(
                f"{self.arm} at {self.base_url}{path}: HTTP {response.status_code}: {response.text[:200]}"
            )
        return _json(response, f"{self.arm} {path}")


def _json(response: httpx.Response, what: str) -> dict[str, Any]:
    try:
        data = response.json()
    except ValueError as exc:
        raise EndpointError(f"{what}: response is not JSON: {response.text[:200]!r}") from exc
    if not isinstance(data, dict):
        raise EndpointError(f"{what}: expected a JSON object, got {type(data).__name__}")
    return data


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
