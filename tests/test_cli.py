"""The CLI's contract without a server: bad input and dead endpoints get their own exit codes and lose nothing."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from blackbox.cli import main


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_bad_url_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["run", "--treatment", "localhost:8000", "--control", "http://127.0.0.1:1", "--out", str(tmp_path)])
    assert code == 3
    err = capsys.readouterr().err
    assert "UsageError" in err and "--treatment must be an http(s) URL" in err


def test_unknown_flag_exits_3(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["run", "--treatment", "http://x", "--control", "http://y", "--bogus"])
    assert exc.value.code == 3
    assert "unrecognized arguments: --bogus" in capsys.readouterr().err


def test_zero_conversations_is_a_usage_error(tmp_path: Path) -> None:
    url = "http://127.0.0.1:1"
    assert main(["run", "--treatment", url, "--control", url, "--conversations", "0", "--out", str(tmp_path)]) == 3


def test_a_reference_ratio_below_one_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["run", "--treatment", "http://127.0.0.1:9", "--reference-ratio", "0", "--out", str(tmp_path)])
    assert code == 3
    assert "--reference-ratio must be at least 1" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_the_single_endpoint_summary_says_what_recall_cannot_see(tmp_path: Path) -> None:
    from blackbox.engine import RunResult
    from blackbox.report import summary
    from blackbox.verdict import Finding, merge

    import histories as h

    alone = h.history([h.plan(0)], h.resumed(0, "treatment"))
    text = summary(RunResult(merge([Finding.passed("endpoints", "ok")]), alone, None, tmp_path, 1.0))
    assert "single endpoint" in text and "sees only corruption that loses a needle" in text


def test_unreachable_endpoint_is_exit_4_with_a_stored_verdict(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"http://127.0.0.1:{_free_port()}"
    code = main(["run", "--treatment", url, "--control", url, "--conversations", "1", "--out", str(tmp_path)])
    assert code == 4
    (run,) = list(tmp_path.iterdir())
    verdict = json.loads((run / "verdict.json").read_text())
    assert verdict["status"] == "ERROR" and verdict["error_class"] == "EndpointError"
    assert (run / "config.json").is_file() and (run / "command.txt").is_file()
    out = capsys.readouterr().out
    assert "is the server up and the URL right?" in out
    # Every run ends with its report.html, whatever the verdict, and the console says where it is.
    assert '<span id="verdict">ERROR</span>' in (run / "report.html").read_text()
    assert f"report: {run / 'report.html'}" in out


def test_api_key_never_reaches_the_run_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BLACKBOX_API_KEY", "sk-very-secret-123")
    url = f"http://127.0.0.1:{_free_port()}"
    main(["run", "--treatment", url, "--control", url, "--conversations", "1", "--out", str(tmp_path)])
    for path in tmp_path.rglob("*"):
        if path.is_file():
            assert "sk-very-secret-123" not in path.read_text()


def test_demo_rejects_an_unknown_profile(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--profile", "no-such-profile", "--out", str(tmp_path)]) == 3
    assert "no-such-profile" in capsys.readouterr().err


def test_grade_refuses_a_folder_that_is_not_a_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["grade", str(tmp_path)]) == 3
    assert "not a blackbox run folder" in capsys.readouterr().err


def test_grade_names_what_a_partial_run_folder_lacks(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # A run that was cut short (or copied without its config) must not end in a traceback.
    (tmp_path / "exchanges.jsonl").write_text("")
    (tmp_path / "geometry.json").write_text('{"block_size": 16}')
    assert main(["grade", str(tmp_path)]) == 3
    assert "(no config.json)" in capsys.readouterr().err
