"""Start, watch and stop a fleet of vLLM servers, one process group each.

    with Fleet(build_specs("cpu-tiny", cache_dir=cache), log_dir) as fleet:
        fleet.start()
        fleet.urls   # {"treatment": "http://127.0.0.1:8100", "control": ...}

Every server logs to `<log_dir>/<role>.log`; `<log_dir>/pids.json` names the PIDs, ports and commands, so a
fleet left behind by a killed parent can be stopped by hand (`kill -TERM -<pgid>`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

import httpx
import psutil

from blackbox import errors
from servers.profiles import PROFILES, ROLES, ServerSpec, build_specs, shares_a_gpu

__all__ = ["Fleet", "ServerStartError", "Shutdown", "log_tail", "main", "port_free"]

STOP_GRACE_S = 20.0
LOG_TAIL_LINES = 40
POLL_S = 0.5


class ServerStartError(errors.ServerStartError):
    """A server could not start: its port was taken, it exited, or it never became ready (exit code 4)."""

    def __init__(
        self,
        message: str,
        *,
        role: str,
        port: int | None = None,
        returncode: int | None = None,
        log_path: Path | None = None,
        log_tail: str = "",
        hint: str = "",
    ) -> None:
        self.role = role
        self.port = port
        self.returncode = returncode
        self.log_path = log_path
        self.log_tail = log_tail
        super().__init__(message, hint=hint)

    def __str__(self) -> str:
        parts = [self.message]
        if self.log_tail:
            parts.append(f"--- last lines of {self.log_path} ---\n{self.log_tail.rstrip()}\n---")
        if self.hint:
            parts.append(f"  -> {self.hint}")
        return "\n".join(parts)


class Shutdown(KeyboardInterrupt):
    """SIGINT or SIGTERM arrived while the fleet was running."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def port_free(port: int, host: str = "127.0.0.1") -> bool:
    """Whether a server could listen on `host:port` now (SO_REUSEADDR, as uvicorn binds)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    """The last `lines` lines of a log, or "" if it cannot be read."""
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 256 * 1024))
            data = f.read()
    except OSError:
        return ""
    return "\n".join(data.decode("utf-8", "replace").splitlines()[-lines:])


@dataclass
class _Server:
    spec: ServerSpec
    log_path: Path
    proc: subprocess.Popen[bytes]
    started: float
    ready_s: float | None = None
    peak_rss: int = 0
    tree: dict[int, psutil.Process] = field(default_factory=dict)


class Fleet:
    """Servers started together and stopped together; a context manager that always stops them."""

    def __init__(self, specs: Sequence[ServerSpec], log_dir: Path) -> None:
        _check_unique(specs)
        self.specs = list(specs)
        self.log_dir = Path(log_dir)
        self.urls: dict[str, str] = {s.role: s.url for s in self.specs}
        self.startup_s: dict[str, float] = {}
        self._servers: dict[str, _Server] = {}
        self._lock = threading.Lock()
        self._sampler: threading.Thread | None = None
        self._sampling = threading.Event()
        self._stopping = False
        self._kill_now = False

    def __enter__(self) -> Fleet:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    @property
    def pids(self) -> dict[str, int]:
        return {role: s.proc.pid for role, s in self._servers.items()}

    def start(self, timeout_s: float = 600, one_by_one: bool | None = None) -> None:
        """Start every server and return once each answers /health and lists its model.

        `one_by_one` starts each server once the one before it is ready; the default does so exactly when
        two servers share a GPU (vLLM sizes its KV cache from the memory free while it profiles, which a
        neighbour starting at the same time would change). Raises ServerStartError (after stopping
        everything) if a port is taken, a server exits, or `timeout_s` (for the whole fleet) passes first.
        """
        self._check_ports()
        self.log_dir.mkdir(parents=True, exist_ok=True)
        sequential = shares_a_gpu(self.specs) if one_by_one is None else one_by_one
        deadline = time.monotonic() + timeout_s
        try:
            waves = [[spec] for spec in self.specs] if sequential else [self.specs]
            for wave in waves:
                for spec in wave:
                    self._spawn(spec)
                self._write_pids()
                if self._sampler is None:
                    self._start_sampler()
                self._wait_ready(timeout_s, deadline, [spec.role for spec in wave])
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """SIGTERM each process group, SIGKILL what is left after ~20 s. Safe to call more than once."""
        with self._lock:
            if self._stopping:
                return
            self._stopping = True
        try:
            self._sampling.set()
            if self._sampler is not None:
                self._sampler.join(timeout=5)
            live = [s for s in self._servers.values() if s.proc.poll() is None or _alive(s.tree.values())]
            for server in live:
                self._snapshot_tree(server)
                _signal_group(server.proc.pid, signal.SIGTERM)
            deadline = time.monotonic() + STOP_GRACE_S
            while any(self._running(s) for s in live) and time.monotonic() < deadline and not self._kill_now:
                time.sleep(0.1)
            for server in live:
                if self._running(server):
                    _signal_group(server.proc.pid, signal.SIGKILL)
                    for proc in _alive(server.tree.values()):
                        with contextlib.suppress(psutil.Error):
                            proc.kill()
            deadline = time.monotonic() + 5  # SIGKILL is not instant either
            while any(self._running(s) for s in live) and time.monotonic() < deadline:
                time.sleep(0.05)
        finally:
            with self._lock:
                self._stopping = False
                self._kill_now = False

    def rss_bytes(self) -> dict[str, int]:
        """Peak resident memory per server, summed over its process tree, sampled twice a second.

        Pages shared between the processes of a tree count once per process, so this overstates what the
        server costs the machine (two CPU tiny-model servers at 2.9 GiB each raised used memory by 3 GiB)."""
        for server in self._servers.values():
            self._sample(server)
        return {role: s.peak_rss for role, s in self._servers.items()}

    def exited(self) -> dict[str, int]:
        """Servers that have exited since start, with their exit codes."""
        codes = {role: s.proc.poll() for role, s in self._servers.items()}
        return {role: code for role, code in codes.items() if code is not None}

    def log_path(self, role: str) -> Path:
        return self.log_dir / f"{role}.log"

    @contextlib.contextmanager
    def handle_signals(self) -> Iterator[None]:
        """While inside, SIGINT and SIGTERM raise Shutdown (so `with Fleet` stops the servers); a second
        signal during stop() skips the grace period. The previous handlers come back on exit."""

        def handler(signum: int, frame: FrameType | None) -> None:
            if self._stopping:
                self._kill_now = True
                return
            raise Shutdown(signum)

        previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, old in previous.items():
                signal.signal(sig, old)

    def _check_ports(self) -> None:
        for spec in self.specs:
            if not port_free(spec.port):
                raise ServerStartError(
                    f"port {spec.port} on 127.0.0.1 is taken; the {spec.role} server cannot listen there",
                    role=spec.role,
                    port=spec.port,
                    hint=_port_hint(spec.port),
                )

    def _spawn(self, spec: ServerSpec) -> None:
        log_path = self.log_path(spec.role)
        env = {**os.environ, **spec.env, "PYTHONUNBUFFERED": "1"}
        with log_path.open("wb") as log:
            proc = subprocess.Popen(
                spec.argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,  # own process group: stop() signals the engine core too
            )
        self._servers[spec.role] = _Server(spec, log_path, proc, time.monotonic())

    def _write_pids(self) -> None:
        record = {
            role: {
                "pid": s.proc.pid,
                "pgid": s.proc.pid,
                "port": s.spec.port,
                "url": s.spec.url,
                "log": str(s.log_path),
                "argv": s.spec.argv,
                "env": dict(s.spec.env),
            }
            for role, s in self._servers.items()
        }
        (self.log_dir / "pids.json").write_text(json.dumps(record, indent=2) + "\n")

    def _wait_ready(self, timeout_s: float, deadline: float, roles: Sequence[str]) -> None:
        pending = {role: self._servers[role] for role in roles}
        with httpx.Client(timeout=httpx.Timeout(5.0)) as client:
            while pending:
                for role, server in list(pending.items()):
                    code = server.proc.poll()
                    if code is not None:
                        message = f"the {role} server exited with code {code} during start-up"
                        raise self._start_error(server, message, returncode=code)
                    if _ready(client, server.spec):
                        if _listens(self._snapshot_tree(server), server.spec.port) is False:
                            raise self._start_error(
                                server,
                                f"port {server.spec.port} answers as a {server.spec.served_model_name!r} server, but "
                                f"not from the {role} server started here: another server took the port between "
                                "the check and this start",
                                hint=_port_hint(server.spec.port),
                            )
                        server.ready_s = time.monotonic() - server.started
                        self.startup_s[role] = server.ready_s
                        del pending[role]
                if pending and time.monotonic() > deadline:
                    role, server = next(iter(pending.items()))
                    raise self._start_error(
                        server,
                        f"the {role} server was not ready after {timeout_s:.0f} s",
                        hint="pass a larger --timeout if the log shows progress, else fix what it reports",
                    )
                if pending:
                    time.sleep(POLL_S)

    def _start_error(
        self, server: _Server, message: str, *, returncode: int | None = None, hint: str = ""
    ) -> ServerStartError:
        time.sleep(0.2)  # let the last lines reach the log
        return ServerStartError(
            f"{message} (port {server.spec.port}, log {server.log_path})",
            role=server.spec.role,
            port=server.spec.port,
            returncode=returncode,
            log_path=server.log_path,
            log_tail=log_tail(server.log_path),
            hint=hint or f"read the log tail above; the full command is in {self.log_dir / 'pids.json'}",
        )

    def _start_sampler(self) -> None:
        self._sampling.clear()
        self._sampler = threading.Thread(target=self._sample_loop, name="fleet-rss", daemon=True)
        self._sampler.start()

    def _sample_loop(self) -> None:
        while not self._sampling.wait(POLL_S):
            for server in list(self._servers.values()):
                self._sample(server)

    def _sample(self, server: _Server) -> None:
        if server.proc.poll() is not None:  # its PID may belong to someone else now
            return
        total = 0
        for proc in self._snapshot_tree(server):
            with contextlib.suppress(psutil.Error):
                total += proc.memory_info().rss
        server.peak_rss = max(server.peak_rss, total)

    def _snapshot_tree(self, server: _Server) -> list[psutil.Process]:
        """The server's live process tree, also remembered so stop() can reach children that left it."""
        try:
            root = psutil.Process(server.proc.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.Error:
            return []
        for proc in procs:
            server.tree.setdefault(proc.pid, proc)
        return procs

    def _running(self, server: _Server) -> bool:
        return server.proc.poll() is None or bool(_alive(server.tree.values()))


def _check_unique(specs: Sequence[ServerSpec]) -> None:
    for attr in ("role", "port"):
        values = [getattr(s, attr) for s in specs]
        if len(set(values)) != len(values):
            raise ValueError(f"two servers share a {attr} in {values}: give each server its own")


def _ready(client: httpx.Client, spec: ServerSpec) -> bool:
    try:
        if client.get(f"{spec.url}/health").status_code != 200:
            return False
        models = client.get(f"{spec.url}/v1/models")
        return models.status_code == 200 and spec.served_model_name in _model_ids(models.json())
    except (httpx.HTTPError, ValueError):
        return False


def _port_hint(port: int) -> str:
    return f"stop what listens there (ss -ltnp 'sport = :{port}') or pass another --base-port"


def _listens(procs: Sequence[psutil.Process], port: int) -> bool | None:
    """Whether one of a server's processes listens on `port` (None: cannot tell). Two launches that check the same
    free ports at once both pass the check; the one whose server loses the bind would otherwise take the other's
    same-named server, answering on its port, for its own."""
    if not procs:
        return None
    denied = False
    for proc in procs:
        try:
            connections = proc.net_connections(kind="tcp")
        except psutil.AccessDenied:
            denied = True
            continue
        except psutil.Error:
            continue
        if any(c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port for c in connections):
            return True
    return None if denied else False


def _model_ids(body: Any) -> set[str]:
    data = body.get("data", []) if isinstance(body, dict) else []
    return {str(m.get("id")) for m in data if isinstance(m, dict)}


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _alive(procs: Any) -> list[psutil.Process]:
    """The processes still running; a zombie nobody reaps yet counts as gone."""
    alive = []
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                alive.append(proc)
    return alive


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m servers.launch",
        description="Start the treatment/control/reference vLLM servers of a profile and keep them up "
        "until Ctrl-C or SIGTERM. Arguments after `--` go to every server.",
    )
    p.add_argument("--profile", required=True, choices=sorted(PROFILES))
    p.add_argument("--roles", default="treatment,control", help=f"comma-separated, of {', '.join(ROLES)}")
    p.add_argument("--fault", help="fault to inject into the treatment (servers/vllm_plugin)")
    p.add_argument("--model", help="model id or path (required by --profile custom)")
    p.add_argument("--tp", type=int, help="tensor parallel size per server")
    p.add_argument("--gpus", help="comma-separated GPU ids to take per role in order (default 0..n-1)")
    p.add_argument("--speculative-config", help="JSON overriding the profile's speculative config")
    p.add_argument("--base-port", type=int, default=8100)
    p.add_argument("--log-dir", type=Path)
    p.add_argument("--cache-dir", type=Path)
    p.add_argument("--timeout", type=float, default=600, help="seconds to wait for every server")
    p.add_argument(
        "--one-by-one",
        action="store_true",
        help="start each server once the previous one is ready (the default when servers share a GPU)",
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in args_list:
        cut = args_list.index("--")
        args_list, extra = args_list[:cut], args_list[cut + 1 :]
    args = _parser().parse_args(args_list)
    cache_dir = args.cache_dir or Path(os.environ.get("BLACKBOX_CACHE", ".blackbox-cache"))
    log_dir = args.log_dir or Path("runs") / f"servers-{datetime.now():%Y%m%d-%H%M%S}"
    try:
        specs = build_specs(
            args.profile,
            [r.strip() for r in args.roles.split(",") if r.strip()],
            model=args.model,
            tensor_parallel=args.tp,
            base_port=args.base_port,
            gpus=[int(g) for g in args.gpus.split(",")] if args.gpus else None,
            cache_dir=cache_dir,
            fault=args.fault,
            extra_args=extra,
            speculative_config=json.loads(args.speculative_config) if args.speculative_config else None,
        )
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 3
    return _serve(Fleet(specs, log_dir), args.timeout, True if args.one_by_one else None)


def _serve(fleet: Fleet, timeout_s: float, one_by_one: bool | None = None) -> int:
    try:
        with fleet.handle_signals(), fleet:  # handlers stay while fleet.__exit__ stops
            print(f"starting {', '.join(fleet.urls)}; logs in {fleet.log_dir}", flush=True)
            fleet.start(timeout_s, one_by_one)
            rss = fleet.rss_bytes()
            for role, url in fleet.urls.items():
                up, gib = fleet.startup_s[role], rss[role] / 2**30
                print(f"{role:<10} {url}  up in {up:.1f} s, rss {gib:.2f} GiB")
            print("Ctrl-C or SIGTERM stops them.", flush=True)
            while not (dead := fleet.exited()):
                time.sleep(1)
            for role, code in dead.items():
                tail = log_tail(fleet.log_path(role))
                print(f"error: the {role} server exited with code {code}\n{tail}", file=sys.stderr)
            return 4
    except ServerStartError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 4
    except Shutdown as exc:
        peaks = ", ".join(f"{role} {n / 2**30:.2f} GiB" for role, n in fleet.rss_bytes().items())
        print(f"stopped ({exc}); peak rss {peaks}", file=sys.stderr)
        return 128 + exc.signum


if __name__ == "__main__":
    sys.exit(main())
