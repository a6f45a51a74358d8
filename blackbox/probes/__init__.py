"""The probes, one module each (see `base.Probe`), and the registry the engine and the front ends iterate."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from blackbox.errors import UsageError
from blackbox.probes.base import Probe
from blackbox.probes.cold_race import COLD_RACE
from blackbox.probes.held_prefix import HELD_PREFIX
from blackbox.probes.hit_geometry import HIT_GEOMETRY
from blackbox.probes.load import LOAD
from blackbox.probes.multiturn import MULTITURN
from blackbox.probes.preemption import PREEMPTION
from blackbox.probes.short_followup import SHORT_FOLLOW_UP

__all__ = ["ALL", "IN_ALL", "PROBES", "Probe", "all_help", "expand", "selected"]

# In the order they run and report (a run of several drives each in turn on the same servers).
PROBES: Mapping[str, Probe] = {
    p.name: p for p in (MULTITURN, COLD_RACE, HELD_PREFIX, SHORT_FOLLOW_UP, LOAD, PREEMPTION, HIT_GEOMETRY)
}
ALL = "all"  # --probe all: every probe that needs no servers launched for it (see Probe.launched_for)
IN_ALL = tuple(n for n, p in PROBES.items() if p.launched_for is None)


def expand(names: Iterable[str]) -> tuple[str, ...]:
    """--probe values as probe names in the order given, `all` expanded in place, repeats dropped (the engine
    runs them in registry order whatever the order here)."""
    out: list[str] = []
    for name in names:
        if name not in PROBES and name != ALL:
            raise UsageError(f"unknown probe {name!r}; choose from {', '.join(PROBES)} or {ALL}")
        out.extend(IN_ALL if name == ALL else (name,))
    return tuple(dict.fromkeys(out))


def all_help() -> str:
    """What `all` means, for --help: the probes it leaves out and why."""
    left = [f"{n} ({p.launched_for})" for n, p in PROBES.items() if p.launched_for is not None]
    return f"{ALL}: every probe" + (f" but {', '.join(left)}" if left else "")


def selected(names: Sequence[str]) -> list[Probe]:
    """The registered probes among `names`, in registry order."""
    return [p for n, p in PROBES.items() if n in names]
