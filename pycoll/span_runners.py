"""Calls of a new length that run on a plan made for another length of their family and size span: which plans'
fast paths take any length, under what condition, and the inline runners' forms that patch the call's lengths
into a kernel program made once (``Executor`` asks here after a new shape's first call; ``PlanCache.run_spanned``
runs them)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional

from .algorithms import slots
from .algorithms import cost as cost_model
from .algorithms.base import Call
from .algorithms.registry import size_span, span_chooser
from .composed import SMP_BYTES
from .inline_runners import Runner, _Oneshot, _Slots, fast_call, oneshot_kernel, oneshot_tail, slots_kernel, slots_tail

if TYPE_CHECKING:  # annotations only: the executor runs these
    from .executor import Executor
    from .plans import Plan


def keep(x: "Executor", label: str, plan: "Plan", call: Call, sized: tuple[tuple, int], composed: bool = False) -> None:
    """After a new shape's first call ran on its plan's fast path: that path, where it takes any length, as the runner
    of every later call of the family (``sized``: the call's ``resize_key``) whose size lies in this call's size span
    (``registry.size_span``), so that such a call needs no plan of its own; and of another span's calls while the
    same choice holds there. Only where the algorithm chosen for this size holds for the whole span
    (``registry.span_choice``); a composed call: where the whole span is within PYCOLL_SMP_BYTES."""
    if not plan.resizable():  # its views a part of an argument, its counts not uniform, a user-defined op, ...
        return
    spanning = getattr(plan.fast, "spanning", None)
    runner = plan.inline
    if spanning is None and runner and plan.fast and type(runner) in _MAKERS:
        make = _MAKERS[type(runner)]

        def spanning(call: Call, scale: int) -> Any:
            return make(x, plan, runner, call, scale)
    if spanning is None:
        return
    if composed:
        def holds(nbytes: int) -> bool:  # a whole span within the limit (the closure declines once it changes)
            return size_span(nbytes)[1] <= SMP_BYTES.get()
    else:
        algo, layout, model, choice = plan.algo, x.comm._layout, cost_model.current(), span_chooser(call)
        if algo is None or plan.algo_for != x.choice_key() or choice(call.size_bytes, layout, model) is not algo:
            return

        def holds(nbytes: int) -> bool:  # the same algorithm chosen for that span's every size
            return choice(nbytes, layout, model) is algo
    key = x.cache.span_key(label, sized, call.size_bytes)
    if key is None or key in x.cache.unspanned:
        return
    run = spanning(call, sized[1])
    if run:
        x.cache.keep_span(key, run, holds)
    else:  # not tried again for this span: a failed try costs a kernel program's probes
        x.cache.unspanned.add(key)


class _OneshotSpan(Runner):
    """A one-shot Allreduce plan's fast path for every length of its size span (``keep``): the kernel takes
    the length from its buffers, and the signature it posts carries each call's own count."""

    def __init__(self, x: Executor, plan: Plan, runner: Any, scale: int) -> None:
        super().__init__(x, plan)
        self.prep, self.scale, self.at = runner.prep, scale, scale
        self.sig_array = runner.prep.sig.copy()  # its own words, patched call by call
        self.kernel = oneshot_kernel(x, self.prep, self.sig_array)

    @classmethod
    def make(cls, x: Executor, plan: Plan, runner: Any, call: Any, scale: int) -> Any:
        """The function (args, scale) -> bool that runs a call of the span, or None."""
        if plan.sig.count % scale:
            return None
        me = cls(x, plan, runner, scale)
        fast = fast_call(x, plan, me, me.kernel)
        if not fast:
            return None
        per, unit, slot = plan.sig.count // scale, call.size_bytes // scale, runner.prep.arena.slot_bytes
        sig, words = me.sig_array, me.prep.words

        def run(args: tuple, at: int) -> bool:
            if unit * at > slot:
                return False
            if at != me.at:
                me.at, sig[2] = at, per * at
                me.words = (words[0], words[1], per * at, words[3])
            return fast(args)

        return run

    def tail(self, x: Executor, plan: Plan, arena: Any, opno: int, status: int, send: Any, recv: Any) -> None:
        def rested() -> tuple[Any, Any, tuple]:  # whole: it ran at this scale
            return (*plan.scaled_call(send, recv, self.at, self.scale), self.words)

        oneshot_tail(x, self, arena, opno, status, send, recv, rested)


class _SlotsSpan:
    """A ``slots`` plan's fast path for every length of its size span (``keep``): its program patched for
    each call's scale (``slots.Span``); a late peer's rest runs the call as its own length makes it."""

    def __init__(self, runner: Any, span: Any) -> None:
        self.label, self.one_sided, self.span = runner.label, runner.one_sided, span

    @classmethod
    def make(cls, x: Executor, plan: Plan, runner: Any, call: Any, scale: int) -> Any:
        """The function (args, scale) -> bool that runs a call of the span, or None where the program is not linear."""
        span = slots.Span.of(runner.prep, plan, call, scale, x.comm._rank)
        if span is None:
            return None
        fast = fast_call(x, plan, cls(runner, span), slots_kernel(span.prep), lags=True)
        if not fast:
            return None
        scaled = span.scaled

        def run(args: tuple, at: int) -> bool:
            return scaled(at) and fast(args)

        return run

    def tail(self, x: Executor, plan: Plan, arena: Any, opno: int, status: int, send: Any, recv: Any) -> None:
        span = self.span
        call, sig = plan.scaled_call(send, recv, span.at, span.scale)  # whole: it ran at this scale
        slots_tail(x, self.label, sig, span.prep, self.one_sided, arena, opno, status, call)


_MAKERS: dict[type, Callable[..., Optional[Callable[[tuple, int], bool]]]] = {
    _Oneshot: _OneshotSpan.make,
    _Slots: _SlotsSpan.make,
}
