"""`blackbox run` against live endpoints, `blackbox demo` on a CPU pair it launches itself.

Exit codes: 0 pass, 1 corruption, 2 not exercised or unknown, 3 usage or config error, 4 endpoint or infrastructure.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

from blackbox import errors
from blackbox.config import GRADERS, PROBES, Grading, RunConfig
from blackbox.engine import RunResult, judge, run
from blackbox.race import RaceSettings
from blackbox.report import ProgressLine, summary
from blackbox.store import RunStore, load_history, load_preflight, new_run_id
from blackbox.workload import Shape

__all__ = ["main"]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        self.print_usage(sys.stderr)
        self.exit(errors.UsageError.exit_code, f"{self.prog}: error: {message}\n")


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--conversations", type=int, default=32, help="seeded conversations (default 32)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("runs"), help="parent folder of run folders (default runs/)")
    p.add_argument("--concurrency", type=int, default=8, help="conversations in flight (default 8)")
    p.add_argument("--block-size", type=int, help="override the block size read from vllm:cache_config_info")
    p.add_argument("--prompt-blocks", type=int, default=Shape.prompt_blocks, help="turn-1 prompt length in blocks")
    p.add_argument("--answer-blocks", type=int, default=Shape.answer_blocks, help="turn-1 answer length in blocks")
    p.add_argument("--grader", action="append", choices=GRADERS, help="grade with these only (default: auto)")
    p.add_argument("--alpha", type=float, default=Grading.alpha, help="significance level (default 0.01)")
    p.add_argument("--min-trigger-fraction", type=float, default=Grading.min_trigger_fraction)
    p.add_argument(
        "--probe",
        action="append",
        choices=PROBES,
        help="multiturn (default): decode-written blocks re-used by turn 2; cold-race: concurrent cold "
        "prefills under a small step budget (A1). Repeat for both.",
    )
    p.add_argument("--racers", type=int, default=RaceSettings.racers, help="identical prompts per cold-race round")
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        help="the treatment's step budget, when its /server_info is not exposed (cold-race trigger proof)",
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
    r.add_argument("--api-key-env", default="BLACKBOX_API_KEY", help="environment variable holding the API key")
    _common(r)
    g = sub.add_parser("grade", help="re-judge a stored run folder offline (no servers needed)")
    # No --alpha here: choosing the significance level after seeing the data would void it.
    g.add_argument("run_dir", type=Path)
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
    shape = Shape(prompt_blocks=args.prompt_blocks, answer_blocks=args.answer_blocks)
    grading = Grading(
        alpha=args.alpha, min_trigger_fraction=args.min_trigger_fraction, graders=tuple(args.grader or ())
    )
    return RunConfig(
        treatment=urls["treatment"] or "",
        control=urls["control"],
        reference=urls.get("reference"),
        model=model,
        conversations=args.conversations,
        seed=args.seed,
        concurrency=args.concurrency,
        block_size=args.block_size,
        api_key_env=getattr(args, "api_key_env", "BLACKBOX_API_KEY"),
        shape=shape,
        grading=grading,
        probes=tuple(dict.fromkeys(args.probe or ("multiturn",))),
        race=RaceSettings(racers=args.racers),
        max_num_batched_tokens=args.max_num_batched_tokens,
        treatment_metrics=tuple(getattr(args, "treatment_metrics", None) or ()),
    )


def execute(config: RunConfig, out: Path, command: Sequence[str], log_dir: Path | None = None) -> RunResult:
    store = RunStore(out, new_run_id(config.seed))
    try:
        store.write_text("command.txt", shlex.join(command) + "\n")
        result = asyncio.run(run(config, store, ProgressLine()))
        if log_dir is not None:
            store.copy_logs(log_dir)
        store.write_text("summary.txt", summary(result) + "\n")
        return result
    finally:
        store.close()


def _run(args: argparse.Namespace) -> int:
    urls = {"treatment": args.treatment, "control": args.control, "reference": args.reference}
    config = _config(args, urls, args.model)
    result = execute(config, args.out, ["blackbox", *sys.argv[1:]])
    print(summary(result))
    return result.verdict.exit_code


def _demo(args: argparse.Namespace) -> int:
    from servers.launch import Fleet
    from servers.profiles import build_specs

    roles = ("treatment", "control") if args.no_reference else ("treatment", "control", "reference")
    args.out.mkdir(parents=True, exist_ok=True)
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
    missing = [f for f in ("config.json", "geometry.json", "exchanges.jsonl") if not (args.run_dir / f).is_file()]
    if missing:
        raise errors.UsageError(
            f"{args.run_dir} is not a blackbox run folder (no {', '.join(missing)})",
            hint="pass a folder under runs/ that a `blackbox run` wrote",
        )
    data, history = load_history(args.run_dir)
    config = RunConfig.from_json(data)
    verdict, grades = judge(history, config, load_preflight(args.run_dir))
    print(summary(RunResult(verdict, history, grades, args.run_dir, 0.0)))
    return verdict.exit_code


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    commands = {"run": _run, "demo": _demo, "grade": _grade}
    try:
        return commands[args.command](args)
    except errors.BlackboxError as exc:
        print(f"blackbox: {exc.title}: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("blackbox: interrupted; what was recorded is in the run folder", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
