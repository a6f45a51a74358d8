"""How a run ends when it does not end by itself: the deadline, SIGINT/SIGTERM, and exceptions nobody expected.

Each becomes a `BlackboxError` with its own class and exit code (`Interrupted` 130, `DeadlineExceeded` 4,
`InternalError` 5, `StorageError` 6), so the engine can write `verdict.json` whatever happened and exit 1 stays
reserved for `CorruptionDetected`. The traceback of an internal error goes to the run folder, not the terminal.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import threading
import traceback
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any, TypeVar

from blackbox import errors
from blackbox.secrets import Redactor
from blackbox.store import write_traceback
from blackbox.watch import Heartbeat, Watch, stderr_line

if TYPE_CHECKING:
    from blackbox.config import RunConfig
    from blackbox.store import RunStore

__all__ = ["Progress", "as_error", "cancel_on_signals", "key_source", "unfinished", "watch", "within"]

T = TypeVar("T")
_STOPPED = ("Interrupted", "DeadlineExceeded")


class _Signals:
    last: str | None = None  # the signal that cancelled the run, for the verdict's message


class Progress:
    """Passes progress on, keeping the last note so a stopped run can say what it was doing."""

    def __init__(self, inner: Callable[[int, int, str], None]) -> None:
        self.inner = inner
        self.last = "starting"

    def __call__(self, done: int, total: int, note: str) -> None:
        self.last = note if not total else f"{note} ({done}/{total} conversations)"
        self.inner(done, total, note)


class _Deadline(Exception):
    """Raised by `within` only: a TimeoutError from deeper down is not the run's deadline."""


def key_source(config: RunConfig) -> str:
    """How the key is supplied, for the hint on a 401. Never the key."""
    if config.api_key_file:
        return f"the key comes from --api-key-file {config.api_key_file}"
    if config.api_key:
        return f"the key comes from ${config.api_key_env}"
    return f"no key sent: ${config.api_key_env} is not set"


def watch(config: RunConfig, store: RunStore, write: Callable[[str], None] = stderr_line) -> Watch:
    return Watch(
        heartbeat=Heartbeat(config.heartbeat_s, lambda line: write(store.redact(line))),
        scrape_s=config.scrape_s,
        redact=store.redact,
        on_retry=lambda record: store.append_jsonl("retries.jsonl", record),
        on_scrape=lambda arm, record: store.append_jsonl(f"metrics/{arm}-scrapes.jsonl", record),
    )


async def within(work: Awaitable[T], seconds: float | None) -> T:
    """Await `work`, cancelling it at the deadline (raising `_Deadline`) or when this task is cancelled; either
    way `work` has finished its clean-up (endpoints closed) when this returns."""
    task = asyncio.ensure_future(work)
    try:
        done, _ = await asyncio.wait({task}, timeout=seconds)
    except asyncio.CancelledError:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise
    if task in done:
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    raise _Deadline


def as_error(exc: BaseException, config: RunConfig, progress: Progress, recorded: int) -> errors.BlackboxError | None:
    """The run's ending as a BlackboxError; None for what must propagate (SystemExit and the like)."""
    doing = f"while {progress.last}; {recorded} requests recorded in exchanges.jsonl"
    if isinstance(exc, errors.BlackboxError):
        return exc
    if isinstance(exc, _Deadline):
        return errors.DeadlineExceeded(
            f"the run did not finish within --deadline {config.deadline_s:g} s ({doing})",
            hint="raise --deadline, lower --conversations, or check why the servers are slow (heartbeat lines)",
        )
    if isinstance(exc, (asyncio.CancelledError, KeyboardInterrupt)):
        by = _Signals.last or "cancellation"
        return errors.Interrupted(
            f"interrupted by {by} ({doing})", hint="nothing was graded; re-run the command in command.txt"
        )
    if isinstance(exc, Exception):
        where = traceback.extract_tb(exc.__traceback__)[-1:] if exc.__traceback__ else []
        at = f" at {Path(where[0].filename).name}:{where[0].lineno}" if where else ""
        return errors.InternalError(
            f"blackbox itself failed: {type(exc).__name__}{at} ({doing})",
            hint="a bug in blackbox: the traceback is in traceback.txt in the run folder; please report it",
        )
    return None


def keep_traceback(folder: Path, exc: BaseException, error: errors.BlackboxError, redact: Redactor) -> None:
    if isinstance(error, errors.InternalError):
        write_traceback(folder, "".join(traceback.format_exception(exc)), redact)


@contextlib.contextmanager
def cancel_on_signals(task: asyncio.Task[Any]) -> Iterator[None]:
    """SIGINT and SIGTERM cancel the run's task (it then writes an `Interrupted` verdict); a second signal
    stops at once. Outside the main thread (signals cannot be caught there) this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    loop = asyncio.get_running_loop()
    _Signals.last = None

    def handle(signum: int, frame: FrameType | None) -> None:
        if _Signals.last is not None:
            raise KeyboardInterrupt
        _Signals.last = signal.Signals(signum).name
        loop.call_soon_threadsafe(task.cancel)

    previous = {s: signal.signal(s, handle) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def unfinished(run_dir: Path) -> errors.BlackboxError | None:
    """Why a stored run cannot be graded, if it stopped before its counters were read; None if it can be."""
    verdict_file = run_dir / "verdict.json"
    complete = (run_dir / "metrics" / "treatment-after.prom").is_file()
    try:
        stored = json.loads(verdict_file.read_text()) if verdict_file.is_file() else None
    except (OSError, ValueError):
        stored = None
    if stored is None:
        if complete:
            return None
        return errors.Interrupted(
            f"{run_dir} has no verdict.json: the run was killed before it finished (SIGKILL, power loss?); "
            "nothing to grade",
            hint="re-run the command in command.txt",
        )
    name = str(stored.get("error_class") or "")
    if complete and name not in _STOPPED:
        return None
    cls = getattr(errors, name, None)
    if not (isinstance(cls, type) and issubclass(cls, errors.BlackboxError)):
        cls = errors.Interrupted
    what = "was interrupted" if cls is errors.Interrupted else f"stopped before it finished ({name})"
    return cls(
        f"{run_dir}: the run {what}: {stored.get('reason', 'no reason stored')}; nothing to grade",
        hint=str(stored.get("hint") or "re-run the command in command.txt"),
    )
