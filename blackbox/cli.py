"""`blackbox run` against live endpoints, `blackbox demo` on a CPU pair it launches itself.

Exit codes: 0 pass, 1 corruption (only), 2 not exercised or unknown, 3 usage or configuration error,
4 endpoint or infrastructure (a deadline too), 5 internal error (a blackbox bug), 6 the run folder could not be
written, 130 interrupted (SIGINT or SIGTERM).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import signal
import sys
import tempfile
import threading
import traceback
from collections.abc import Coroutine, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

from blackbox import errors, guard, html_report, inputs, probes
from blackbox.config import GRADERS, Grading, RaceSettings, RunConfig
from blackbox.engine import RunResult, rejudge, run
from blackbox.report import ProgressLine, summary
from blackbox.secrets import Redactor
from blackbox.store import RunStore, new_run_id, write_traceback
from blackbox.workload import MAX_RESUMES, Shape

__all__ = ["main"]

DEFAULT_DETECT = 0.34  # the fraction of decode-region hits a default 32-conversation run's PASS covers


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        self.print_usage(sys.stderr)
        self.exit(errors.UsageError.exit_code, f"{self.prog}: error: {message}\n")


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--conversations", type=int, default=32, help="seeded conversations (default 32)")
    p.add_argument(
        "--reference-ratio",
        type=int,
        default=RunConfig.reference_ratio,
        help="the reference runs this many times the treatment's conversations (default 2): a larger yardstick "
        "lets the logprob grader see corruption in fewer hits",
    )
    p.add_argument(
        "--detect",
        type=float,
        nargs="?",
        const=DEFAULT_DETECT,
        metavar="Q",
        help="stop when the answer is known: conversations in rounds, a look after each, until corruption is "
        "established (FAIL) or a PASS could have seen it in a fraction Q of decode-region hits (default "
        f"{DEFAULT_DETECT}, what a 32-conversation run covers), or the budget ends it (UNKNOWN); replaces "
        "--conversations",
    )
    p.add_argument(
        "--round",
        type=int,
        default=RunConfig.round_conversations,
        help=f"conversations per round with --detect (default {RunConfig.round_conversations})",
    )
    p.add_argument(
        "--max-conversations",
        type=int,
        default=RunConfig.max_conversations,
        help=f"the budget with --detect (default {RunConfig.max_conversations}); alpha is spent over its looks",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("runs"), help="parent folder of run folders (default runs/)")
    p.add_argument("--concurrency", type=int, default=8, help="conversations in flight (default 8)")
    p.add_argument("--block-size", type=int, help="override the block size read from vllm:cache_config_info")
    p.add_argument("--prompt-blocks", type=int, default=Shape.prompt_blocks, help="turn-1 prompt length in blocks")
    p.add_argument("--answer-blocks", type=int, default=Shape.answer_blocks, help="turn-1 answer length in blocks")
    p.add_argument(
        "--resumes",
        type=int,
        default=Shape.resumes,
        help="decode-written boundaries each multi-turn conversation resumes from (default 1, at most "
        f"{MAX_RESUMES}); the logprob grader scores a conversation by its largest deviation",
    )
    p.add_argument("--grader", action="append", choices=GRADERS, help="grade with these only (default: auto)")
    p.add_argument("--alpha", type=float, default=Grading.alpha, help="significance level (default 0.01)")
    p.add_argument("--min-trigger-fraction", type=float, default=Grading.min_trigger_fraction)
    p.add_argument(
        "--compare-tokens",
        type=int,
        default=Grading.compare_tokens,
        help="answer positions compared, hit against recomputation (default: the first token and the first "
        "verification step, 2 + the treatment's speculative tokens, 4 if its /metrics does not say; later ones "
        "drift apart on GPUs under speculative decoding)",
    )
    p.add_argument(
        "--probe",
        action="append",
        choices=[*probes.PROBES, probes.ALL],
        help="; ".join(f"{p.name}: {p.about}" for p in probes.PROBES.values())
        + f". Repeat for several; {probes.all_help()}.",
    )
    p.add_argument("--racers", type=int, default=RaceSettings.racers, help="identical prompts per cold-race round")
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        help="the treatment's step budget, when its /server_info is not exposed (cold-race trigger proof)",
    )
    p.add_argument(
        "--request-timeout",
        type=float,
        default=RunConfig.timeout_s,
        help="seconds to wait for one chat completion (default 300); /health, /metrics etc. wait at most 30",
    )
    p.add_argument("--deadline", type=float, help="seconds for the whole run; past it the verdict is DeadlineExceeded")
    p.add_argument(
        "--heartbeat",
        type=float,
        default=RunConfig.heartbeat_s,
        help="print a line when a request has waited this many seconds (default 15)",
    )
    p.add_argument(
        "--scrape-interval",
        type=float,
        default=RunConfig.scrape_s,
        help="read every server's /metrics this often during the run to catch restarts (default 5; 0: off)",
    )


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="blackbox", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    r = sub.add_parser("run", help="test live treatment and control endpoints")
    r.add_argument("--treatment", required=True, help="URL of the server under test (prefix caching + spec decode)")
    r.add_argument(
        "--control",
        help="URL of the same model with prefix caching off; without it (a staging smoke test) the treatment's own "
        "answers with a fresh cache_salt are the control",
    )
    r.add_argument("--reference", help="URL of the treatment's config without speculative decoding (logprob grader)")
    r.add_argument("--model", help="served model name (default: the first one each server lists)")
    r.add_argument(
        "--treatment-metrics",
        action="append",
        metavar="URL",
        help="a /metrics URL of one replica behind the treatment's router (repeat for each; they are summed); "
        "per-request cached_tokens remain the trigger's ground truth",
    )
    r.add_argument(
        "--api-key-env",
        help="name of the environment variable holding the API key (default BLACKBOX_API_KEY; "
        "a warning is printed when a variable named here is unset)",
    )
    r.add_argument("--api-key-file", help="read the API key from this file instead (one line)")
    _common(r)
    g = sub.add_parser("grade", help="re-judge a stored run folder offline (no servers needed); rewrites report.html")
    # No --alpha here: choosing the significance level after seeing the data would void it.
    g.add_argument("run_dir", type=Path)
    rp = sub.add_parser(
        "report", help="write report.html for stored run folders; several: also one page comparing them"
    )
    rp.add_argument("run_dirs", type=Path, nargs="+", metavar="RUN_DIR")
    rp.add_argument(
        "--out",
        type=Path,
        default=Path("blackbox-runs.html"),
        help="the comparison page, when several folders are given (default blackbox-runs.html)",
    )
    d = sub.add_parser("demo", help="build the tiny model, launch the CPU pair, run, print the verdict, stop")
    d.add_argument("--profile", default="cpu-tiny")
    d.add_argument("--no-reference", action="store_true", help="launch treatment and control only")
    d.add_argument("--fault", help="start the treatment with an injected fault (see servers/vllm_plugin)")
    d.add_argument("--base-port", type=int, default=8100)
    d.add_argument("--cache-dir", type=Path, default=Path(os.environ.get("BLACKBOX_CACHE", ".blackbox-cache")))
    _common(d)
    d.set_defaults(conversations=24)
    return parser


def _config(args: argparse.Namespace, urls: dict[str, str | None], model: str | None) -> RunConfig:
    shape = Shape(prompt_blocks=args.prompt_blocks, answer_blocks=args.answer_blocks, resumes=args.resumes)
    grading = Grading(
        alpha=args.alpha,
        min_trigger_fraction=args.min_trigger_fraction,
        graders=tuple(args.grader or ()),
        compare_tokens=args.compare_tokens,
    )
    return RunConfig(
        treatment=urls["treatment"] or "",
        control=urls["control"],
        reference=urls.get("reference"),
        model=model,
        conversations=args.conversations,
        detect=args.detect,
        round_conversations=args.round,
        max_conversations=args.max_conversations,
        reference_ratio=args.reference_ratio,
        seed=args.seed,
        concurrency=args.concurrency,
        block_size=args.block_size,
        api_key_env=getattr(args, "api_key_env", None) or "BLACKBOX_API_KEY",
        shape=shape,
        grading=grading,
        probes=probes.expand(args.probe or ("multiturn",)),
        race=RaceSettings(racers=args.racers),
        max_num_batched_tokens=args.max_num_batched_tokens,
        treatment_metrics=tuple(getattr(args, "treatment_metrics", None) or ()),
        api_key_file=getattr(args, "api_key_file", None),
        deadline_s=args.deadline,
        heartbeat_s=args.heartbeat,
        scrape_s=args.scrape_interval,
        timeout_s=args.request_timeout,
    )


def _check(args: argparse.Namespace) -> None:
    """Flags that RunConfig does not see, checked before any folder is made or server contacted."""
    inputs.check_out_dir(args.out)
    for flag in ("conversations", "concurrency", "racers", "prompt_blocks", "answer_blocks", "resumes", "round"):
        inputs.positive(f"--{flag.replace('_', '-')}", getattr(args, flag))
    inputs.positive("--block-size", args.block_size)
    inputs.positive("--max-num-batched-tokens", args.max_num_batched_tokens)
    inputs.positive("--max-conversations", args.max_conversations)
    if args.detect is not None:
        inputs.probability("--detect", args.detect)
    inputs.probability("--alpha", args.alpha)
    inputs.probability("--min-trigger-fraction", args.min_trigger_fraction, closed=True)


def _warn_key(config: RunConfig, named: bool) -> None:
    """An unset variable the user named means requests go without a key: say so before the 401s do."""
    if named and not config.api_key_file and config.api_key is None:
        print(
            f"blackbox: warning: ${config.api_key_env} (named by --api-key-env) is not set; "
            "requests are sent without an API key",
            file=sys.stderr,
        )


def execute(config: RunConfig, out: Path, command: Sequence[str], log_dir: Path | None = None) -> RunResult:
    """One run into a new folder under `out`. Whatever happens after the folder exists, verdict.json is
    written (disk permitting) and the result says how the run ended."""
    redact = Redactor(config.api_key)
    try:
        store = RunStore(out, new_run_id(config.seed), redact)
    except OSError as exc:
        raise errors.StorageError(
            f"cannot create a run folder under {out}: {exc.strerror or type(exc).__name__}",
            hint="free disk space or fix the folder's permissions (--out DIR)",
        ) from exc
    try:
        store.write_text("command.txt", shlex.join(command) + "\n")
        result = asyncio.run(_signalled(run(config, store, ProgressLine())))
        if log_dir is not None:
            store.copy_logs(log_dir)
        store.write_text("summary.txt", summary(result) + "\n")
        html_report.write_quietly(store.path, redact)
        return result
    finally:
        store.close()


async def _signalled(work: Coroutine[Any, Any, RunResult]) -> RunResult:
    """SIGINT and SIGTERM cancel the run, which then ends as `Interrupted` with its verdict written."""
    task = asyncio.current_task()
    assert task is not None
    with guard.cancel_on_signals(task):
        return await work


def _run(args: argparse.Namespace) -> int:
    urls = {"treatment": args.treatment, "control": args.control, "reference": args.reference}
    config = _config(args, urls, args.model)
    _check(args)
    _warn_key(config, named=args.api_key_env is not None)
    _Console.redact = Redactor(config.api_key)
    result = execute(config, args.out, ["blackbox", *sys.argv[1:]])
    print(_Console.redact(summary(result)))
    return result.verdict.exit_code


def _demo(args: argparse.Namespace) -> int:
    from servers.launch import Fleet
    from servers.profiles import build_specs

    roles = ("treatment", "control") if args.no_reference else ("treatment", "control", "reference")
    _check(args)
    inputs.positive("--base-port", args.base_port, minimum=1024)
    inputs.positive("--base-port", 65536 - args.base_port - len(roles))
    log_dir = args.out / f"servers-{new_run_id(args.seed)}"
    print(
        f"blackbox demo: building the model and starting {', '.join(roles)} ({args.profile}); server logs in {log_dir}",
        file=sys.stderr,
    )
    try:
        specs = build_specs(args.profile, roles, base_port=args.base_port, cache_dir=args.cache_dir, fault=args.fault)
    except ValueError as exc:
        raise errors.UsageError(str(exc), hint="see `blackbox demo --help`") from exc
    with Fleet(specs, log_dir) as fleet, fleet.handle_signals():
        fleet.start()
        print(
            "servers up: " + ", ".join(f"{r} {u} ({fleet.startup_s[r]:.0f} s)" for r, u in fleet.urls.items()),
            file=sys.stderr,
        )
        config = _config(args, dict(fleet.urls), None)
        result = execute(config, args.out, ["blackbox", *sys.argv[1:]], log_dir)
    print(summary(result))
    return result.verdict.exit_code


def _grade(args: argparse.Namespace) -> int:
    if not args.run_dir.is_dir():
        raise errors.UsageError(f"{args.run_dir} is not a folder", hint="pass a folder under runs/")
    stopped = guard.unfinished(args.run_dir) if (args.run_dir / "config.json").is_file() else None
    if stopped is not None:
        raise stopped
    missing = [f for f in ("config.json", "geometry.json", "exchanges.jsonl") if not (args.run_dir / f).is_file()]
    if missing:
        raise errors.UsageError(
            f"{args.run_dir} is not a blackbox run folder (no {', '.join(missing)})",
            hint="pass a folder under runs/ that a `blackbox run` wrote",
        )
    try:
        again = rejudge(args.run_dir)
    except errors.BlackboxError:
        raise
    except Exception as exc:
        text = "".join(traceback.format_exception(exc))
        kept = write_traceback(args.run_dir, text, Redactor(), "traceback-grade.txt")
        raise errors.InternalError(
            f"blackbox itself failed while grading: {type(exc).__name__}",
            hint=f"a bug in blackbox: the traceback is in {kept or 'no file (the folder is not writable)'}",
        ) from exc
    html_report.write_quietly(args.run_dir, regraded=again.verdict)
    print(summary(RunResult(again.verdict, again.history, again.grades, args.run_dir, 0.0)))
    return again.verdict.exit_code


def _report(args: argparse.Namespace) -> int:
    for run_dir in args.run_dirs:
        if not run_dir.is_dir() or not any((run_dir / f).is_file() for f in ("verdict.json", "config.json")):
            raise errors.UsageError(
                f"{run_dir} is not a blackbox run folder (no verdict.json or config.json)",
                hint="pass folders under runs/ that a `blackbox run` wrote",
            )
    try:
        if len(args.run_dirs) == 1:
            print(html_report.write(args.run_dirs[0]))
        else:
            page = html_report.compare(args.run_dirs, args.out)
            print("\n".join(str(d / html_report.REPORT) for d in args.run_dirs))
            print(page)
    except OSError as exc:
        raise errors.StorageError(
            f"cannot write the report: {exc.strerror or exc}", hint="check the folder's permissions (--out PATH)"
        ) from exc
    return 0


class _Console:
    """What the terminal gets passes the same redactor as the run folder."""

    redact = Redactor()


def _stop_on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt  # outside a run's event loop SIGTERM stops like Ctrl-C does


def _internal(exc: Exception) -> int:
    """The last resort: an exception outside any run. One line on the terminal, the traceback in a file."""
    text = "".join(traceback.format_exception(exc))
    fd, name = tempfile.mkstemp(prefix="blackbox-traceback-", suffix=".txt")
    with os.fdopen(fd, "w") as f:
        f.write(_Console.redact(text))
    error = errors.InternalError(
        f"blackbox itself failed: {type(exc).__name__}", hint=f"a bug in blackbox: the traceback is in {name}"
    )
    print(f"blackbox: {error.title}: {_Console.redact(str(error))}", file=sys.stderr)
    return error.exit_code


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    commands = {"run": _run, "demo": _demo, "grade": _grade, "report": _report}
    _Console.redact = Redactor()
    previous = signal.signal(signal.SIGTERM, _stop_on_sigterm) if _main_thread() else None
    try:
        return commands[args.command](args)
    except errors.BlackboxError as exc:
        print(f"blackbox: {exc.title}: {_Console.redact(str(exc))}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("blackbox: Interrupted: what was recorded is in the run folder", file=sys.stderr)
        return errors.Interrupted.exit_code
    except Exception as exc:
        return _internal(exc)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


if __name__ == "__main__":
    sys.exit(main())
