"""A composed call's plan as one closure (``Plan.fast``): what decided to compose it rechecked from the environment's
words, then this rank's part of the composition (``pycoll.composed``) on the call's buffers; and for the calls whose
parts take any length, that closure as the runner of other lengths of its size span (``span_runners``)."""

from __future__ import annotations

import weakref
from typing import Any, Callable, Optional

from .algorithms import cost as cost_model
from .algorithms.base import Call
from .algorithms.check import CHECK_CALLS
from .algorithms.registry import ALGO, LINK_TOLERANCE, REPRODUCIBLE, size_span
from .composed import SEGMENTS, SMP_BYTES, SPANNED, HostComposition
from .composed_failures import guarded
from .config import _ENV_BYTES


def plan_closure(comp: HostComposition, label: str, plan: Any, call: Call, ran: Callable[[str, int], None]) -> Any:
    """A plan's composed call as one closure (``Plan.fast``), for a call of it just composed within
    PYCOLL_SMP_BYTES: what decided to compose it (``HostComposition.takes``, a forced algorithm, the checks,
    reproducibility) depends on the plan's shape and on environment words the closure rechecks, so a call only
    rebinds its views and runs the composition, and ``ran(collective, bytes)`` records it; the closure declines
    (False, nothing done) once any of them changed. A larger call, composed because the cost model priced it so, also
    declines once the model in force or PYCOLL_LINK_TOLERANCE changed."""
    env, c = _ENV_BYTES, comp.comm
    if env is None:
        return False
    priced = call.size_bytes > SMP_BYTES.get()
    model = cost_model._current if priced else None
    if priced and model is None:
        return False
    keys = (ALGO.env_key, CHECK_CALLS.env_key, REPRODUCIBLE.env_key, SMP_BYTES.env_key, LINK_TOLERANCE.env_key,
            SEGMENTS.env_key)
    ka, kc, kr, ks, kt, kg = keys
    va, vc, vr, vs, vt, vg = (env.get(k) for k in keys)
    mine, coll, nbytes = c._reproducible, call.coll, call.size_bytes
    views, make_call, live, run = plan.views, plan.make_call, c._live, comp.run
    part, host, leaders, column, enter = comp.part_of(call), comp.host_comm, comp.leaders, comp.column, comp.enter

    def fast(args: tuple, size: int = nbytes) -> bool:
        if (env.get(ka) != va or env.get(kc) != vc or env.get(kr) != vr or env.get(ks) != vs or env.get(kt) != vt
                or env.get(kg) != vg
                or c._reproducible is not mine or (model is not None and cost_model._current is not model)):
            return False
        bound = views(args)
        if bound is None:
            return False  # the buffers overlap: the checks name it
        live(label, numbered=True)
        if part is not None:
            enter()
            guarded(c, label, (host, leaders, column), part, *bound)
        else:
            run(make_call(*bound), label)
        ran(coll, size)
        return True

    if part is not None and coll in SPANNED and not priced:
        fast.spanning = _spanning(fast)  # type: ignore[attr-defined]
    return fast


def _spanning(fast: Callable[..., bool]) -> Callable[[Call, int], Any]:
    """For a composed call within PYCOLL_SMP_BYTES whose parts take any length (``composed.SPANNED``): its closure
    as the runner of every length of its size span (``span_runners.keep``), where the whole span is within that limit
    too: this rank's part takes its buffers' lengths as they come (the closure declines once PYCOLL_SMP_BYTES
    changes). A block collective's call whose blocks would not be whole at its scale takes the checks, which name it."""
    ref = weakref.ref(fast)  # the closure holds this function: a strong reference would make a cycle

    def spanning(call: Call, scale: int) -> Optional[Callable[[tuple, int], bool]]:
        unit, run = call.size_bytes // scale, ref()
        if run is None or size_span(call.size_bytes)[1] > SMP_BYTES.get():
            return None
        blocks = [c[0] for c in (call.counts, call.send_counts) if c]
        if not blocks:
            return lambda args, at: run(args, unit * at)
        return lambda args, at: all(b * at % scale == 0 for b in blocks) and run(args, unit * at)

    return spanning
