"""The one execution path of a communicator's collectives: plans cached by call shape (``pycoll.plans``), selection,
inline arena runs.

``Comm`` checks a call's arguments once per call *shape* (the buffers' types, shapes, strides, dtypes, the counts,
op and root) and hands the call here. A repeated shape skips the checks: its plan rebinds the flat views onto the
new buffers (any address: a fresh array, a view, an mpi4py buffer spec all hit) and, where the chosen algorithm
has an inline form on the host arena, runs it as one compiled kernel call; otherwise the call runs as a schedule
on the progress engine. Every collective goes through ``Executor.run``/``Executor.start``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional

from . import arrays, composed_plans, derived_buffers, exchanged, paired, solo, span_runners
from .algorithms.base import Call, Steps
from .algorithms.check import CHECK_CALLS, verify_call
from .algorithms.registry import ALGO, select
from .algorithms import arena_jit
from .algorithms.registry import REDUCTIONS, last_choice, parse_override
from .algorithms import cost as cost_model
from .composed import SMP_BYTES, HostComposition
from .errors import InvalidArgumentError
from .inline_runners import INLINE
from .memory import backend
from .p2p_protocol import Schedule, Sig
from .plans import Plan, PlanCache, resize_key, shape_key
from .request import Request
from .transport.arena import fold_seq

if TYPE_CHECKING:
    from .comm import Comm

_PLANS = 64  # plans kept per communicator (oldest dropped first)
_FAST_SPIN_S = 50e-6  # how long an inline arena call spins for its peers before it waits as a schedule
# where ranks outnumber cores: a fifth of a microsecond, then the kernel gives the core away (arena_jit.YIELDS)
_OVERSUBSCRIBED_SPIN_S = 0.2e-6
# Ranks that outnumber the cores spin only briefly (the peer they wait for may need the core), then yield the core and
# call the kernel again for this long before the call waits as a schedule: a schedule costs tens of microseconds.
_YIELD_RETRY_S = 1e-3
_COMPOSED_WHY = ("a call on each host's communicator and one among the hosts' first ranks (PYCOLL_SMP_BYTES, or priced "
                 "below the cheapest algorithm for the whole communicator)")


class Executor:
    """Runs one communicator's collectives: plan lookup, argument checks on a miss, selection, inline or scheduled."""

    def __init__(self, comm: "Comm", describe: Callable[[Sig], str]) -> None:
        self.comm = comm
        self.describe = describe  # names a call from its signature, in mismatch reports
        self.engine = comm._engine
        self.cache = PlanCache(_PLANS)
        self.plans = self.cache.plans  # (label, shape key) -> plan
        self.chosen: Any = None  # the algorithm ``stage`` selected for a device call (run as is, or on its staged twin)
        self.others = [q for q in range(comm.size) if q != comm.rank]
        # small calls of a communicator across hosts: a call per host and one among the hosts' first ranks
        self.composed: Optional[HostComposition] = HostComposition(comm) if HostComposition.wanted(comm) else None
        # collective -> (algorithm, bytes as selection saw them) of this communicator's last call that chose one;
        # a process-wide record (``last_choice``) also holds the choices of the communicators an algorithm calls
        self.ran: dict[str, tuple[str, int]] = {}
        self.span_calls = 0  # calls of a new shape run by their span's fast path (``span_runners``)
        # ranks sharing cores spin only briefly for each other: the rank we wait for may need this core
        self.spin_s = _OVERSUBSCRIBED_SPIN_S if self.engine.oversubscribed else _FAST_SPIN_S
        self.retry_s = _YIELD_RETRY_S if self.engine.oversubscribed else 0.0
        self.gate = arena_jit.Gate(self.spin_s, arena_jit.YIELDS if self.engine.oversubscribed else 0)
        if comm._arena is not None:
            comm._arena.gate = self.gate
            if arena_jit.ARENA_JIT_LOAD.get() == "now":
                arena_jit.warm_up()

    # ---- the path every call takes ------------------------------------------------------------
    def run(self, label: str, build: Callable[..., tuple[Call, Sig]], args: tuple, stream: Any = None) -> None:
        """A blocking collective: inline on the arena where its plan allows, else as a schedule waited for here."""
        key = shape_key(args) if stream is None else None
        shaped = None
        if key is not None:
            shaped = (label, key)
            try:
                plan = self.plans.get(shaped)
            except TypeError:  # an unhashable argument (the checks name it)
                plan, shaped = None, None
            if plan is not None:
                fast = plan.fast
                if fast and fast(args):
                    return
                views = self._inline_or_views(plan, args, fast)
                if views is True:
                    return
                if views is not None:
                    call = plan.make_call(*views)
                    if self.composed is not None:
                        flat_key = (self.choice_key(), SMP_BYTES.get())
                        if plan.flat_for != flat_key:
                            if self._compose(label, call):
                                if not fast:  # None, or False where an earlier call of the plan ran another way
                                    plan.fast = composed_plans.plan_closure(self.composed, label, plan, call,
                                                                            self._ran_composed)
                                return
                            plan.flat_for = flat_key  # the shape, the key and the size limit decide it alike
                    self._finish(self._schedule(label, call, plan.sig, plan, True))
                    return
            spanned = self.cache.shaped.get(shaped) if shaped is not None else None
            if spanned is not None and spanned[0](args, spanned[1]):  # this shape's last call ran on its span
                self.span_calls += 1
                return
        sized = resize_key(args) if key is not None else None
        if sized is not None and self.cache.spans and self.cache.run_spanned(label, args, sized, shaped):
            self.span_calls += 1
            return
        resized = self._resized(label, args, key, sized) if sized is not None else None
        if resized is not None:
            (plan, call), stage = resized, None
            sig = plan.sig
        else:
            call, sig, stage = self._resolve(label, build, args, stream)
            plan = self._remember(label, args, call, sig, key, sized) if stage is None and stream is None else None
        if stage is None:
            if self.composed is not None and self._compose(label, call):
                if plan is not None and sized is not None:
                    plan.fast = plan.fast or composed_plans.plan_closure(self.composed, label, plan, call,
                                                                         self._ran_composed)
                    span_runners.keep(self, label, plan, call, sized, composed=True)
                return
            if plan is not None and self._first_as_planned(plan, call, args):
                if sized is not None:
                    span_runners.keep(self, label, plan, call, sized)
                return
            self._finish(self._schedule(label, call, sig, plan, True))
            return
        try:  # composed as on the ranks without a copy (a Bcast root's packed input): every rank decides alike
            if self.composed is None or not self._compose(label, call):
                self._finish(self._schedule(label, call, sig, blocking=True))
        except BaseException:
            stage.discard()
            raise
        stage.finish()

    def _compose(self, label: str, call: Call) -> bool:
        """Run ``call`` as calls on the host and leaders' communicators (``pycoll.composed``), if it is one they take:
        not while PYCOLL_ALGO forces its collective or PYCOLL_CHECK_CALLS verifies every call."""
        assert self.composed is not None
        if not self.composed.takes(call) or CHECK_CALLS.get() or call.coll in parse_override(ALGO.get()):
            return False
        if call.coll in REDUCTIONS and self.comm.reproducible:  # the hosts' partial sums are not the left fold
            return False
        self.comm._live(label, numbered=True)
        self.composed.run(call, label)
        self._ran_composed(call.coll, call.size_bytes)
        return True

    def _ran_composed(self, coll: str, nbytes: int) -> None:
        last_choice.collective, last_choice.algorithm, last_choice.nbytes = coll, "composed", nbytes
        self.ran[coll] = ("composed", nbytes)
        last_choice.why = _COMPOSED_WHY

    def start(self, label: str, build: Callable[..., tuple[Call, Sig]], args: tuple, stream: Any = None) -> Request:
        """A nonblocking collective: scheduled now, progressed by the engine, finished by the request."""
        key = shape_key(args) if stream is None else None
        plan = self.cache.get(label, key) if key is not None else None
        if plan is not None and self.comm._size == 1 and plan.fast and plan.fast(args):
            return Request._finished(None)  # alone: copied at once (``solo``)
        call = plan.call(args) if plan is not None else None
        if call is not None:
            assert plan is not None
            return Request(self.engine, self.comm, schedule=self._schedule(label, call, plan.sig, plan))
        call, sig, stage = self._resolve(label, build, args, stream)
        if stage is None and key is not None:
            plan = self._remember(label, args, call, sig, key, resize_key(args))
        try:
            sched = self._schedule(label, call, sig, plan if stage is None else None)
        except BaseException:
            if stage is not None:
                stage.discard()
            raise
        return Request(self.engine, self.comm, schedule=sched, after=stage)

    def _remember(self, label: str, args: tuple, call: Call, sig: Sig, key: Optional[tuple],
                  sized: Optional[tuple[tuple, int]]) -> Optional[Plan]:
        """Keep a checked call as the plan of its shape (``key``), if its views can be found again in later calls
        (``sized``: the arguments' ``resize_key``)."""
        return self.cache.remember(label, args, call, sig, key, sized) if call.stream is None else None

    def _resized(self, label: str, args: tuple, key: tuple, sized: tuple[tuple, int]) -> Optional[tuple[Plan, Call]]:
        """A new shape's plan and call made from a checked plan whose call differs in its arrays' scale alone
        (``PlanCache.resized``), without the argument checks; None where there is none."""
        found = self.cache.resized(label, args, key, sized)
        if found is not None:
            self._new_shape(label)
        return found

    def _new_shape(self, label: str) -> None:
        """Before a new shape's first call: the communicator must be usable; the compiled kernels are opened now, so
        that the shape's second call never stalls on them."""
        c = self.comm
        c._live(label, numbered=True)
        self.chosen = None
        if self.gate.kernels is None and c._arena is not None:
            self.gate.open()

    def clear(self) -> None:
        self.cache.clear()
        if self.composed is not None:
            self.composed.free()

    def choice_key(self) -> tuple:
        """What an algorithm choice depends on besides the call: a cached choice holds while this is unchanged."""
        return (ALGO.get(), id(cost_model.current()), CHECK_CALLS.get(), self.comm.reproducible)

    # ---- scheduling -----------------------------------------------------------------------------
    def steps(self, label: str, sig: Sig) -> tuple[Steps, Any]:
        """The verbs and owner of the call numbered ``comm._seq``."""
        c = self.comm
        owner = c._owner(f"{label} #{c._seq}", c._ctx | 1, c._seq)
        owner.sig = sig
        steps = Steps(
            self.engine, c._rank, c._size, c._world, c._ctx | 1, c._seq, sig, owner, backend("host"),
            c._layout, c._arena, c._ipc,
        )
        return steps, owner

    def _schedule(self, label: str, call: Call, sig: Sig, plan: Optional[Plan] = None, blocking: bool = False
                  ) -> Schedule:
        """Number the call, pick the algorithm (the plan's, while it holds) and start it. A blocking call's small
        messages to peers on other hosts may move straight through the sockets as it starts (``Steps.now``)."""
        c = self.comm
        c._live(label, numbered=True)
        algo = self._choose(call, plan)
        c._seq += 1
        steps, owner = self.steps(label, sig)
        steps.now = blocking and self.engine.direct_peers and call.stream is None
        gen = algo.run(steps, call)
        if CHECK_CALLS.get() and c._size > 1:
            gen = self._checked(steps, sig, gen)
        return self.engine.start(Schedule(gen, owner), steps.now)

    def _choose(self, call: Call, plan: Optional[Plan]) -> Any:
        """The algorithm for ``call``: the one chosen for a staged device call, the plan's while its choice holds, else
        the cost model's. A plan that chooses anew gets the algorithm's inline form on the arena, and a plan without
        one its fast path where there is one."""
        c = self.comm
        chosen, self.chosen = self.chosen, None
        key = self.choice_key()
        call.reproducible = key[3] and call.coll in REDUCTIONS  # selection and the algorithms' fallbacks read it
        if chosen is not None:
            algo = chosen
        elif plan is not None and plan.algo is not None and plan.algo_for == key:
            algo = plan.algo
        else:
            algo = select(call, c._layout)
            if plan is not None:
                plan.algo, plan.algo_for = algo, key
                kind = INLINE.get(algo.run) if c._arena is not None else None
                plan.inline = kind(self, plan) if kind is not None else False
        self.ran[call.coll] = (algo.name, call.size_bytes)
        if plan is not None and plan.fast is None and c._size == 1:
            plan.fast = solo.fast_path(self, plan)  # alone: a local copy at most
        if plan is not None and plan.fast is None and plan.inline is False and self.engine.direct_peers:
            # a two-rank call across hosts: straight through the socket; an Alltoall's blocks: in one call into C
            plan.fast = paired.fast_path(self, plan, algo) or exchanged.fast_path(self, plan, algo)
        return algo

    def _first_as_planned(self, plan: Plan, call: Call, args: tuple) -> bool:
        """A shape's first blocking call run as its later calls are, where its algorithm has a fast path or an inline
        form on the arena (not while every call is checked: the first goes through the checks' schedule); True
        where it ran. Else the caller schedules it, as each path declines having done nothing."""
        if CHECK_CALLS.get():
            return False
        self._choose(call, plan)
        fast = plan.fast
        return bool(fast and fast(args)) or self._inline_or_views(plan, args, fast, chosen=True) is True

    def _inline_or_views(self, plan: Plan, args: tuple, fast: Any, chosen: bool = False) -> Any:
        """After the plan's fast path (``fast``, as the call found it) did not take the call: True where the
        algorithm's inline form on the arena ran it (its fast path made after a first inline run); else the call's
        views (None where they now overlap: the checks name it). ``chosen``: the plan's algorithm was chosen for this
        very call (its choice holds)."""
        if fast:
            plan.fast = None  # it declined (a new arena, algorithm or spin, a busy arena): made again later
        views = plan.views(args)
        if views is not None:
            runner = plan.inline
            if runner and (chosen or plan.algo_for == self.choice_key()) and runner.run(self, plan, views[0], views[1]):
                if fast is None:
                    plan.fast = runner.fast_path(self, plan)
                return True
        return views

    def _checked(self, steps: Steps, sig: Sig, gen):
        yield from verify_call(steps, sig, self.describe)
        yield from gen

    def _finish(self, sched: Schedule) -> None:
        self.engine.wait_schedule(sched, self.comm.timeout)
        if sched.error is not None:
            self.failed(sched)
            raise self.engine.witnessed(sched.error, sched.owner)

    def failed(self, sched: Schedule) -> None:
        """After a call failed here: tell the peers; if a peer only skipped it, free its arena number."""
        assert sched.error is not None
        arena = self.comm._arena
        if getattr(sched.error, "contained", False) and arena is not None:
            arena.give_back(sched.owner.tag)
        self.engine.abort(sched.owner, sched.error)

    def _resolve(self, label: str, build: Callable[..., tuple[Call, Sig]], args: tuple, stream: Any = None
                 ) -> tuple[Call, Sig, Any]:
        """Check the arguments; if they are wrong here, tell the peers so that they do not wait for us.

        A call on device buffers comes back as its host twin, with the ``Staged`` copy that holds it; a call whose
        receive buffer is a packed copy (a derived datatype's elements) with the ``Unpacking`` that writes it back
        (else None).
        """
        c = self.comm
        self._new_shape(label)
        try:
            with derived_buffers.collecting_packed() as unpacking:  # derived datatypes' packed receive buffers
                call, sig = build(*args)
            call, stage = self._stage(call, stream, label)
            if unpacking.packed and stage is None:
                stage = unpacking  # written back into the user's buffers when the call completes
            return call, sig, stage
        except Exception as err:  # noqa: BLE001 - any refusal: the call's number is consumed and the peers told
            c._seq += 1  # every rank consumes this call's number, so the next call still lines up
            owner = c._owner(f"{label} #{c._seq}", c._ctx | 1, c._seq)
            if not isinstance(err, InvalidArgumentError):  # TypeError, ValueError, NotImplementedError...: kept as is
                self.engine.notify_skip(owner, InvalidArgumentError(f"{type(err).__name__}: {err}", op=owner.op, rank=c._rank))
                raise
            self.engine.notify_skip(owner, err)
            raise type(err)(err.cause, op=owner.op, rank=c._rank, peers=err.peers) from None  # keeps its error class

    def _stage(self, call: Call, stream: Any, label: str) -> tuple[Call, Any]:
        """(the call to schedule, its Staged device copy or None): device buffers are copied to pinned host memory."""
        c = self.comm
        mem = {arrays.memory_of(a) for a in (call.send, call.recv) if a is not None}
        if mem != {"cuda"}:
            if len(mem) > 1:
                where = "on the device" if arrays.memory_of(call.send) == "cuda" else "in host memory"
                raise InvalidArgumentError(
                    f"sendbuf is {where} and recvbuf is not: pass both on the device (as NCCL requires) or both on "
                    "the host", op=label, rank=c._rank)
            return call, None
        chosen = None
        if call.coll == "allreduce" and c._ipc is not None:  # an algorithm on device buffers (CUDA IPC) if selected
            device_call = dataclasses.replace(call, stream=stream, reproducible=c.reproducible)
            chosen = select(device_call, c._layout)  # a host algorithm's cost includes the staging
            if chosen.memory == "cuda":
                self.chosen = chosen
                return device_call, None
        try:
            from .cuda.memory import Staged

            staged_call = Staged(call, c._rank, stream)
        except InvalidArgumentError:
            raise
        except Exception as exc:  # noqa: BLE001 - no numba.cuda, no device, a bad stream: tell the peers too
            raise InvalidArgumentError(f"could not stage the device buffers ({type(exc).__name__}: {exc})", op=label,
                                       rank=c._rank) from None
        self.chosen = chosen  # the staged twin runs the host algorithm chosen for the device call
        return staged_call.call, staged_call

    # ---- inline arena runs ----------------------------------------------------------------------
    def begin(self, label: str, posts_seq: bool = False, handles_lag: bool = False) -> Optional[tuple[Any, int]]:
        """Number an inline arena call and take its arena operation: (arena, op number), or None (nothing done) while
        the arena is not ready, an earlier nonblocking arena call is unfinished, or (unless the kernel ``handles_lag``
        itself) the last call did not wait for every peer and some peer has not finished the call two back."""
        c = self.comm
        state = c._arena
        if state is None or state.status != "ready":
            return None
        arena = state.arena
        if arena is None or arena.finished != state.ops:
            return None
        if not handles_lag and not arena.caught_up(state.ops, self.others):
            return None  # the schedule's ``lag_wait`` waits for them
        if c._freed or c._aborted is not None or c._engine.broken_here(c._ctx):
            c._live(label, numbered=True)  # raises, unless only a later call failed
        c._seq += 1
        state.ops += 1
        opno = arena.ops = state.ops
        state.last = (c._seq, opno)
        arena.seq = c._seq  # posts carry the call number (Python writes it, unless the kernel does: ``posts_seq``)
        if not posts_seq:
            arena.mark_seq(opno)
        return arena, opno

    def rest(self, label: str, sig: Sig, schedule: Callable[[Steps], Schedule]) -> None:
        """Finish an inline call whose peers did not keep up as an ordinary schedule: timeouts, liveness, reports."""
        steps, owner = self.steps(label, sig)
        self._finish(self.engine.start(Schedule(schedule(steps), owner)))

    @contextlib.contextmanager
    def sleeping_waits(self) -> Iterator[None]:
        """Inside, a call that finds its peers late waits on the arena's doorbell at once, with no yields and no
        retries: for a rank that expects a long wait where ranks share cores, whose yields would take turns with the
        very rank it waits for (outside that case there are none to drop)."""
        gate = self.gate
        yields, retry_s = gate.yields, self.retry_s
        gate.yields, self.retry_s = 0, 0.0
        try:
            yield
        finally:
            gate.yields, self.retry_s = yields, retry_s

    def retry(self, arena: Any, status: int, again: Callable[[], int]) -> int:
        """While a kernel call that may be repeated (it posts the same words and copies the same bytes) finds its peers
        late: yield the core and call it again, for at most ``retry_s``; the last status."""
        if not self.retry_s or status & 3 != arena_jit.WAITING:
            return status
        end = time.perf_counter() + self.retry_s
        while status & 3 == arena_jit.WAITING and time.perf_counter() < end:
            if status & arena_jit.WAKE:
                arena.bell.wake()
            os.sched_yield()
            status = again()
        return status

    def spin_meeting(self, arena: Any, opno: int, mine: tuple, finish: Callable[[], None]) -> bool:
        """After posting ``mine``: spin briefly for the peers; if all came with the same call, ``finish``, mark done
        and return True, else False (the caller's schedule waits with timeouts)."""
        others = self.others
        spin_until = time.perf_counter() + self.spin_s
        while arena.waiting_for("post", opno, others):
            if time.perf_counter() > spin_until:
                return False
        posted = (mine[0], mine[1], mine[2], fold_seq(mine[3], arena.seq))
        if any(arena.peer_sig(q, opno) != posted for q in others) or arena.posted_by_others(opno, others):
            return False
        try:
            finish()
        finally:
            arena.set_done(opno)
        return True
