"""The API key: where it may come from, and the redaction that keeps it out of everything blackbox writes.

The key is read from an environment variable (named, never given, on the command line) or from a file. Every
text blackbox stores or prints passes through `Redactor`, so a server that echoes request headers into an error
body cannot leak the key into the run folder or the console.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from blackbox.errors import UsageError

__all__ = ["MASK", "Redactor", "check_env_name", "read_key"]

MASK = "[REDACTED]"
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")


def check_env_name(name: str) -> None:
    """The name goes into replay scripts as `${NAME}`; anything but an identifier could run code there.
    The message never echoes the value: it may be the key itself, passed by mistake."""
    if not _ENV_NAME.fullmatch(name):
        raise UsageError(
            "--api-key-env must name an environment variable (letters, digits, _; not starting with a digit)",
            hint="export the key, e.g. `export BLACKBOX_API_KEY=...`, and pass its name; or use --api-key-file",
        )


def read_key(env_name: str, key_file: str | None) -> str | None:
    """The key, from the file if one is named, else from the variable; None when neither gives one."""
    if key_file:
        try:
            text = Path(key_file).read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise UsageError(
                f"cannot read --api-key-file {key_file}: {type(exc).__name__}", hint="check the path and permissions"
            ) from exc
        if not text or "\n" in text:
            raise UsageError(
                f"--api-key-file {key_file} must hold the key on one line", hint="write only the key into the file"
            )
        return text
    return os.environ.get(env_name) or None


@dataclass(frozen=True)
class Redactor:
    """Replaces the key, and its JSON-escaped form, with MASK."""

    key: str | None = None

    def __call__(self, text: str) -> str:
        if not self.key:
            return text
        text = text.replace(self.key, MASK)
        escaped = json.dumps(self.key)[1:-1]
        return text.replace(escaped, MASK) if escaped != self.key else text

    def data(self, value: Any) -> Any:
        """The same over a JSON-like value, keys and strings alike."""
        if not self.key:
            return value
        if isinstance(value, str):
            return self(value)
        if isinstance(value, dict):
            return {self(str(k)) if isinstance(k, str) else k: self.data(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [self.data(v) for v in value]
        return value
