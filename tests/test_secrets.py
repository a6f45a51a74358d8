"""Where the API key may come from, and the redaction every stored or printed text passes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from blackbox import errors
from blackbox.secrets import MASK, Redactor, check_env_name, read_key

KEY = "sk-live-0123456789abcdef"


@pytest.mark.parametrize("name", ["BLACKBOX_API_KEY", "_k", "a1", "OPENAI_API_KEY"])
def test_identifiers_are_accepted(name: str) -> None:
    check_env_name(name)


@pytest.mark.parametrize("name", ["X:-$(touch f)}", "1ABC", "", "A B", "A-B", KEY, "A}", "A\nB"])
def test_anything_else_is_a_usage_error_that_does_not_echo_the_value(name: str) -> None:
    with pytest.raises(errors.UsageError) as info:
        check_env_name(name)
    assert info.value.exit_code == 3
    if name:
        assert name not in str(info.value)  # it may be the key itself, passed by mistake


def test_the_key_comes_from_the_file_when_one_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("K", "from-env")
    key_file = tmp_path / "key"
    key_file.write_text(f"  {KEY}\n")
    assert read_key("K", str(key_file)) == KEY
    assert read_key("K", None) == "from-env"
    monkeypatch.delenv("K")
    assert read_key("K", None) is None


@pytest.mark.parametrize("content", ["", "\n", "one\ntwo\n"])
def test_an_empty_or_multi_line_key_file_is_a_usage_error(tmp_path: Path, content: str) -> None:
    key_file = tmp_path / "key"
    key_file.write_text(content)
    with pytest.raises(errors.UsageError, match="must hold the key on one line"):
        read_key("K", str(key_file))


def test_a_missing_key_file_is_a_usage_error(tmp_path: Path) -> None:
    with pytest.raises(errors.UsageError, match=r"cannot read --api-key-file .*FileNotFoundError"):
        read_key("K", str(tmp_path / "nope"))


def test_redaction_covers_plain_and_json_escaped_forms() -> None:
    odd = 'k"ey\\with-quote'
    redact = Redactor(odd)
    assert redact(f"Bearer {odd}") == f"Bearer {MASK}"
    assert odd not in redact(json.dumps({"h": f"Bearer {odd}"}))
    assert json.dumps(odd)[1:-1] not in redact(json.dumps({"h": f"Bearer {odd}"}))
    assert Redactor(None)("nothing to hide") == "nothing to hide"


def test_redaction_of_nested_data() -> None:
    data = {"headers": {"authorization": f"Bearer {KEY}"}, "list": [KEY, 3, None], KEY: "as a key"}
    out = Redactor(KEY).data(data)
    assert KEY not in json.dumps(out)
    assert out["list"][1:] == [3, None]
