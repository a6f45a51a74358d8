"""A vLLM general plugin for GPU runs: `kill -USR1 <pid>` dumps every thread's Python stack to stderr.

Registered by servers/gpu/device.sh (entry point ``blackbox_diag``) so that a server which crawls can be
asked where it spends its time without py-spy or gdb, which the GPU machine lacks. Idempotent: vLLM calls
plugins in every process, sometimes more than once.
"""

from __future__ import annotations

import faulthandler
import signal
import sys

_registered = False


def register() -> None:
    global _registered
    if _registered:
        return
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True, chain=False)
    _registered = True
