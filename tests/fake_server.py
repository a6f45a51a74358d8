"""A vLLM-shaped HTTP server that injects transport faults, for the reliability tests.

It speaks just enough HTTP/1.1 (keep-alive, Content-Length) to be driven by blackbox, simulates a prefix cache
(per cache_salt, whole 16-token blocks, the answer's tokens cached too) and answers needle questions from the
conversation, so that without faults a run over a treatment/control pair of these is PASS: every fault test
then proves the fault, not the fake, is what kept the run from passing. It is no stand-in for vLLM when judging
the tester's verdicts (the real CPU pair does that); it exists for what a real server will not do on demand:
hang, drop a connection, truncate a body, restart, lose /metrics, echo the API key.

Faults are functions of (path, request number on that path) returning an `Action`, or None for normal service.
Binds 127.0.0.1 only, on a port in the reliability tests' range.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

BLOCK = 16
MODEL = "fake-model"
PORTS = range(8520, 8600)  # this helper's share of the reliability worktree's range (8500-8599)


@dataclass(frozen=True)
class Reply:
    status: int = 200
    body: bytes = b""
    headers: tuple[tuple[str, str], ...] = (("Content-Type", "application/json"),)


@dataclass(frozen=True)
class Hang:
    """Never answer (until the client gives up or the server stops)."""


@dataclass(frozen=True)
class Slow:
    seconds: float
    then: Any = None  # an Action, or None: the normal reply


@dataclass(frozen=True)
class Close:
    """Close the connection without a response."""


@dataclass(frozen=True)
class CutBody:
    """Announce the whole body, send part of it, close: a connection dropped mid-response."""

    keep: float = 0.5


@dataclass(frozen=True)
class Kill:
    """Stop the whole server now: this connection and every later one fail (a server killed mid-run)."""


Action = Reply | Hang | Slow | Close | CutBody | Kill
Fault = Callable[[str, int, dict[str, str]], Action | None]


def json_reply(payload: Any, status: int = 200, headers: tuple[tuple[str, str], ...] = ()) -> Reply:
    return Reply(status, json.dumps(payload).encode(), (("Content-Type", "application/json"), *headers))


def tokens(messages: list[dict[str, str]], generation_prompt: bool = True) -> list[str]:
    out: list[str] = []
    for m in messages:
        out += [f"<{m.get('role', 'user')}>", *str(m.get("content") or "").split()]
    return [*out, "<assistant>"] if generation_prompt else out


@dataclass
class Counters:
    queries: float = 1000.0  # a server that has served before the run: counters do not start at zero
    hits: float = 200.0
    drafts: float = 50.0
    draft_tokens: float = 100.0
    accepted: float = 70.0
    created: float = 1.75e9
    start_time: float = 1.75e9


@dataclass
class FakeVLLM:
    """One fake server. `caching` False makes it a control (no cache, cache_config says so)."""

    caching: bool = True
    speculative: bool = True  # False: a reference (no spec-decode counters on /metrics)
    fault: Fault | None = None
    typed: bool = True  # False: /metrics without # TYPE lines
    echo_headers: bool = True  # error bodies (and one field of every answer) echo the request headers
    metrics_override: Callable[[int, Counters], str | None] | None = None  # (scrape number, counters) -> text
    counters: Counters = field(default_factory=Counters)
    calls: dict[str, int] = field(default_factory=dict)
    port: int = 0
    _cache: dict[str, list[list[str]]] = field(default_factory=dict)
    _loop: asyncio.AbstractEventLoop | None = None
    _server: asyncio.base_events.Server | None = None
    _writers: set[asyncio.StreamWriter] = field(default_factory=set)
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)
    _stop_event: asyncio.Event | None = None
    _thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # --- lifecycle ----------------------------------------------------------------------------------------

    def start(self) -> FakeVLLM:
        ready = threading.Event()

        def serve() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            for port in PORTS:
                try:
                    self._server = loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", port))
                except OSError:
                    continue
                self.port = port
                break
            ready.set()
            loop.run_forever()
            loop.close()

        self._thread = threading.Thread(target=serve, daemon=True)
        self._thread.start()
        ready.wait(10)
        assert self.port, f"no free port in {PORTS}"
        return self

    def stop(self) -> None:
        loop = self._loop
        if loop is None or not loop.is_running():
            return
        asyncio.run_coroutine_threadsafe(self._shutdown(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        if self._thread is not None:
            self._thread.join(10)

    async def _shutdown(self) -> None:
        self._stopped().set()  # hanging and slow handlers return at once, instead of being cancelled mid-await
        if self._server is not None:
            self._server.close()
        for w in list(self._writers):
            w.close()
        self._writers.clear()
        current = asyncio.current_task()
        pending = [t for t in self._tasks if t is not current]
        if pending:
            await asyncio.wait(pending, timeout=2)

    def _stopped(self) -> asyncio.Event:
        if self._stop_event is None:
            self._stop_event = asyncio.Event()
        return self._stop_event

    async def _pause(self, seconds: float) -> bool:
        """Sleep, unless the server stops first; True when it stopped."""
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._stopped().wait(), seconds)
        return self._stopped().is_set()

    def __enter__(self) -> FakeVLLM:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- HTTP ---------------------------------------------------------------------------------------------

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                method, path, _ = lines[0].split(" ", 2)
                headers = {k.strip().lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines[1:] if ":" in ln)}
                body = await reader.readexactly(int(headers.get("content-length", "0") or 0))
                if self._stopped().is_set():  # a connection accepted while the server was being killed
                    break
                if not await self._respond(writer, method, path.split("?")[0], headers, body):
                    break
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError, ValueError):
            pass
        finally:
            self._tasks.discard(task)
            self._writers.discard(writer)
            with contextlib.suppress(Exception):
                writer.close()

    async def _respond(
        self, writer: asyncio.StreamWriter, method: str, path: str, headers: dict[str, str], body: bytes
    ) -> bool:
        n = self.calls.get(path, 0) + 1
        self.calls[path] = n
        action = self.fault(path, n, headers) if self.fault else None
        while isinstance(action, Slow):
            if await self._pause(action.seconds):
                return False
            action = action.then
        if isinstance(action, Hang):
            await self._pause(3600)
            return False
        if isinstance(action, Close):
            return False
        if isinstance(action, Kill):
            await self._shutdown()
            return False
        reply = action if isinstance(action, Reply) else await self.serve(method, path, headers, body)
        if isinstance(action, Reply) and reply.status != 200 and self.echo_headers and not reply.body:
            reply = Reply(reply.status, self._echo(reply.status, headers), reply.headers)
        if isinstance(action, CutBody):
            full = (await self.serve(method, path, headers, body)).body
            writer.write(self._head(200, len(full), ()) + full[: int(len(full) * action.keep)])
            await writer.drain()
            return False
        writer.write(self._head(reply.status, len(reply.body), reply.headers) + reply.body)
        await writer.drain()
        return True

    @staticmethod
    def _head(status: int, length: int, headers: tuple[tuple[str, str], ...]) -> bytes:
        lines = [f"HTTP/1.1 {status} X", f"Content-Length: {length}", "Connection: keep-alive"]
        lines += [f"{k}: {v}" for k, v in headers]
        return ("\r\n".join(lines) + "\r\n\r\n").encode()

    def _echo(self, status: int, headers: dict[str, str]) -> bytes:
        """What some gateways do on an error: echo the request, headers and all (the key with them)."""
        return json.dumps({"error": {"code": status, "message": "request failed", "request_headers": headers}}).encode()

    # --- the vLLM surface ---------------------------------------------------------------------------------

    async def serve(self, method: str, path: str, headers: dict[str, str], body: bytes) -> Reply:
        """The normal answer; a proxy overrides this to forward instead."""
        return self._serve(method, path, headers, body)

    def _serve(self, method: str, path: str, headers: dict[str, str], body: bytes) -> Reply:
        if path == "/health":
            return Reply(200, b"", ())
        if path == "/v1/models":
            return json_reply({"object": "list", "data": [{"id": MODEL, "object": "model", "max_model_len": 4096}]})
        if path == "/metrics":
            return Reply(200, self.metrics_text().encode(), (("Content-Type", "text/plain"),))
        if path == "/tokenize" and method == "POST":
            req = json.loads(body)
            if "prompt" in req:  # a plain text (the comparability fingerprint): one id per word
                count = len(str(req["prompt"]).split())
                return json_reply({"count": count, "max_model_len": 4096, "tokens": list(range(count))})
            count = len(tokens(req["messages"], req.get("add_generation_prompt", True)))
            return json_reply({"count": count, "max_model_len": 4096, "tokens": list(range(count))})
        if path == "/v1/chat/completions" and method == "POST":
            return json_reply(self._chat(json.loads(body), headers))
        return json_reply({"error": f"no route {method} {path}"}, 404)

    def _chat(self, req: dict[str, Any], headers: dict[str, str]) -> dict[str, Any]:
        messages = req["messages"]
        prompt = tokens(messages)
        salt = str(req.get("cache_salt", ""))
        cached = 0
        if self.caching:
            for seen in self._cache.get(salt, []):
                common = 0
                for a, b in zip(seen, prompt, strict=False):
                    if a != b:
                        break
                    common += 1
                cached = max(cached, min(common, len(prompt) - 1) // BLOCK * BLOCK)
        words = _answer(messages, int(req.get("max_tokens") or 16))
        if self.caching:
            self._cache.setdefault(salt, []).append(prompt + words)
        c = self.counters
        c.queries += len(prompt)
        c.hits += cached
        c.drafts += len(words) // 2
        c.draft_tokens += len(words)
        c.accepted += len(words) // 2
        logprobs = [
            {
                "token": w,
                "logprob": -0.01,
                "top_logprobs": [{"token": w, "logprob": -0.01}, {"token": "zz", "logprob": -5}],
            }
            for w in words
        ]
        out: dict[str, Any] = {
            "id": "chatcmpl-fake",
            "object": "chat.completion",
            "model": MODEL,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": " ".join(words)},
                    "logprobs": {"content": logprobs},
                    "finish_reason": "length",
                }
            ],
            "usage": {
                "prompt_tokens": len(prompt),
                "completion_tokens": len(words),
                "prompt_tokens_details": {"cached_tokens": cached},
            },
        }
        if self.echo_headers:
            out["system_fingerprint"] = headers.get("authorization", "")
        return out

    def metrics_text(self) -> str:
        n = self.calls.get("/metrics", 0)
        if self.metrics_override is not None:
            text = self.metrics_override(n, self.counters)
            if text is not None:
                return text
        return render_metrics(self.counters, caching=self.caching, typed=self.typed, speculative=self.speculative)


def _answer(messages: list[dict[str, str]], max_tokens: int) -> list[str]:
    """The needle when asked for one (found in the conversation), else `max_tokens` words of the prompt."""
    last = str(messages[-1].get("content") or "")
    asked = re.search(r"what is the code of (\S+) \?", last)
    if asked:
        everything = " ".join(str(m.get("content") or "") for m in messages)
        found = re.search(rf"the code of {re.escape(asked.group(1))} is (.+?) \.", everything)
        if found:
            return found.group(1).split()[:max_tokens]
    source = last.split() or ["ok"]
    return [source[i % len(source)] for i in range(max_tokens)]


def render_metrics(c: Counters, *, caching: bool = True, typed: bool = True, speculative: bool = True) -> str:
    labels = 'engine="0",model_name="fake-model"'
    lines: list[str] = []

    def counter(name: str, value: float) -> None:
        if typed:
            lines.append(f"# TYPE {name}_total counter")
        lines.append(f"{name}_total{{{labels}}} {value}")
        if typed:
            lines.append(f"# TYPE {name}_created gauge")
        lines.append(f"{name}_created{{{labels}}} {c.created}")

    counter("vllm:prefix_cache_queries", c.queries)
    counter("vllm:prefix_cache_hits", c.hits if caching else 0.0)
    if speculative:
        counter("vllm:spec_decode_num_drafts", c.drafts)
        counter("vllm:spec_decode_num_draft_tokens", c.draft_tokens)
        counter("vllm:spec_decode_num_accepted_tokens", c.accepted)
    if typed:
        lines.append("# TYPE vllm:cache_config_info gauge")
    lines.append(
        f'vllm:cache_config_info{{block_size="{BLOCK}",enable_prefix_caching="{caching}",'
        f'mamba_cache_mode="{"align" if caching else "none"}"}} 1.0'
    )
    if typed:
        lines.append("# TYPE process_start_time_seconds gauge")
    lines.append(f"process_start_time_seconds {c.start_time}")
    return "\n".join(lines) + "\n"


def free_port() -> int:
    """A port in this helper's range that nothing listens on (for 'connection refused')."""
    for port in PORTS:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise AssertionError(f"no free port in {PORTS}")


def wait_for(predicate: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.05)


@dataclass
class Proxy(FakeVLLM):
    """A fault-injecting proxy in front of a real server: the same faults, every other request forwarded.
    `rewrite_metrics(scrape number, text)` may change the real /metrics page on its way back."""

    upstream: str = ""
    rewrite_metrics: Callable[[int, str], str] | None = None

    async def serve(self, method: str, path: str, headers: dict[str, str], body: bytes) -> Reply:
        import httpx

        keep = {k: v for k, v in headers.items() if k not in ("host", "content-length", "connection")}
        async with httpx.AsyncClient(base_url=self.upstream, timeout=600) as http:
            r = await http.request(method, path, headers=keep, content=body)
        content = r.content
        if path == "/metrics" and self.rewrite_metrics is not None:
            content = self.rewrite_metrics(self.calls.get("/metrics", 0), r.text).encode()
        return Reply(r.status_code, content, (("Content-Type", r.headers.get("content-type", "text/plain")),))
