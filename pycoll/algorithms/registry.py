"""The algorithm registry and the selection among registered algorithms, with the PYCOLL_ALGO override."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable, Optional

from ..config import str_param
from ..errors import InvalidArgumentError
from .base import Call, Schedule, Steps

log = logging.getLogger("pycoll")

ALGO = str_param(
    "PYCOLL_ALGO",
    "",
    "Force algorithms per collective, e.g. `allreduce:ring,broadcast:chain`; an algorithm that refuses a call falls back to the default.",
)

COLLECTIVES = (
    "allreduce",
    "reduce_scatter",
    "allgather",
    "broadcast",
    "reduce",
    "alltoall",
    "gather",
    "scatter",
    "barrier",
)

Refusal = Callable[[Call, int], Optional[str]]


@dataclass(frozen=True)
class Algorithm:
    """A registered algorithm: how to run it, what it costs, and when it declines a call."""

    collective: str
    name: str
    description: str
    steps: str  # latency term: number of sequential message steps, in p = ranks
    bytes: str  # bandwidth term: bytes each rank sends, in n = message bytes
    run: Callable[[Steps, Call], Schedule]
    refuse: Optional[Refusal] = None

    def refusal(self, call: Call, size: int) -> Optional[str]:
        return self.refuse(call, size) if self.refuse else None


ALGORITHMS: dict[str, dict[str, Algorithm]] = {c: {} for c in COLLECTIVES}


def register(
    collective: str, name: str, description: str, *, steps: str, bytes: str, refuse: Optional[Refusal] = None
) -> Callable[[Callable[[Steps, Call], Schedule]], Callable[[Steps, Call], Schedule]]:
    """Decorator: add an algorithm under ``collective``/``name`` (registration order is preference order)."""

    def wrap(fn: Callable[[Steps, Call], Schedule]) -> Callable[[Steps, Call], Schedule]:
        table = ALGORITHMS[collective]
        if name in table:
            raise ValueError(f"algorithm {collective}:{name} registered twice")
        table[name] = Algorithm(collective, name, description, steps, bytes, fn, refuse)
        return fn

    return wrap


@lru_cache(maxsize=8)
def parse_override(text: str) -> dict[str, str]:
    """``"allreduce:ring,allgather:ring"`` -> {collective: algorithm}; names are checked."""
    chosen: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        coll, sep, name = item.partition(":")
        coll, name = coll.strip().lower(), name.strip().lower()
        if not sep or coll not in ALGORITHMS:
            raise InvalidArgumentError(
                f"PYCOLL_ALGO entry {item!r} must be collective:algorithm with a collective among {', '.join(COLLECTIVES)}"
            )
        if name not in ALGORITHMS[coll]:
            raise InvalidArgumentError(
                f"PYCOLL_ALGO asks for {coll}:{name}, but {coll} has only: {', '.join(ALGORITHMS[coll])}"
            )
        chosen[coll] = name
    return chosen


def select(call: Call, size: int) -> Algorithm:
    """The algorithm for this call: the override if it accepts, else the first registered that accepts."""
    table = ALGORITHMS[call.coll]
    forced = parse_override(ALGO.get()).get(call.coll)
    if forced is not None:
        algo = table[forced]
        reason = algo.refusal(call, size)
        if reason is None:
            return algo
        log.warning("PYCOLL_ALGO %s:%s declined this call (%s); using the default", call.coll, forced, reason)
    for algo in table.values():
        reason = algo.refusal(call, size)
        if reason is None:
            log.debug("%s: %s selected for %d bytes on %d ranks", call.coll, algo.name, call.nbytes, size)
            return algo
        log.debug("%s: %s declined: %s", call.coll, algo.name, reason)
    raise InvalidArgumentError(f"no {call.coll} algorithm accepts this call")  # pragma: no cover - defaults accept all
