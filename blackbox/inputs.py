"""Command-line input checked before anything runs: a bad value is a `UsageError` (exit 3), never a traceback.

Messages quote what was wrong and say what would be right; they never echo an API key (see `blackbox.secrets`).
"""

from __future__ import annotations

import math
import os
import tempfile
from pathlib import Path
from urllib.parse import urlsplit

import httpx

from blackbox.errors import UsageError

__all__ = ["check_out_dir", "check_url", "positive", "probability"]

_HELP = "see `blackbox run --help`"


def check_url(flag: str, url: str, *, root: bool = True) -> str:
    """An http(s) URL with a host and a valid port, of a server root unless `root` is False (a /metrics URL);
    returns it without a trailing slash."""
    example = "e.g. http://127.0.0.1:8000"
    try:
        parts = urlsplit(url)
        port = parts.port  # raises on a port out of range or not a number
        httpx.URL(url)  # what the client will build; rejects what urlsplit lets through (e.g. port 0 forms)
    except (ValueError, httpx.InvalidURL) as exc:
        raise UsageError(f"{flag} {url!r} is not a valid URL: {exc}", hint=example) from exc
    if parts.scheme not in ("http", "https"):
        raise UsageError(f"{flag} must be an http(s) URL, got {url!r}", hint=example)
    if not parts.hostname:
        raise UsageError(f"{flag} {url!r} has no host", hint=example)
    if port is not None and not 1 <= port <= 65535:
        raise UsageError(f"{flag} {url!r}: port {port} is outside 1-65535", hint=example)
    if parts.username is not None or parts.password is not None:
        raise UsageError(
            f"{flag} must not carry credentials in the URL (they would be stored in the run folder)",
            hint="pass the key with --api-key-env NAME or --api-key-file PATH",
        )
    if parts.query or parts.fragment:
        raise UsageError(f"{flag} {url!r} must not have a query or fragment", hint=example)
    path = parts.path.rstrip("/")
    if root and path.endswith("/v1"):
        server_root = url[: url.rstrip("/").rfind("/v1")]
        raise UsageError(
            f"{flag} {url!r} ends in /v1, but blackbox adds /v1/chat/completions itself",
            hint=f"pass the server root: {flag} {server_root}",
        )
    return url.rstrip("/")


def check_out_dir(out: Path) -> None:
    """--out must be a folder blackbox can create run folders in (created if missing)."""
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out} is a file, not a folder", hint="pass a folder for the run folders")
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=out, prefix=".blackbox-write-check-"):
            pass
    except OSError as exc:
        raise UsageError(
            f"--out {out} is not writable: {exc.strerror or type(exc).__name__}",
            hint="pass a folder you can write to (--out DIR)",
        ) from exc
    if not os.access(out, os.W_OK | os.X_OK):
        raise UsageError(f"--out {out} is not writable", hint="pass a folder you can write to (--out DIR)")


def positive(flag: str, value: float | None, *, minimum: float = 1) -> None:
    if value is not None and not (math.isfinite(value) and value >= minimum):
        raise UsageError(f"{flag} must be at least {minimum:g}, got {value!r}", hint=_HELP)


def probability(flag: str, value: float | None, *, closed: bool = False) -> None:
    ok = value is None or (math.isfinite(value) and 0 < value < 1) or (closed and value == 1)
    if not ok:
        raise UsageError(f"{flag} must be between 0 and 1, got {value!r}", hint=_HELP)
