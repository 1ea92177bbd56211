"""The one execution path of a communicator's collectives: plans cached by call shape, selection, inline arena runs.

``Comm`` checks a call's arguments once per call *shape* (the buffers' types, shapes, strides, dtypes, the counts,
op and root) and hands the call here. A repeated shape skips the checks: its plan rebinds the flat views onto the
new buffers (any address: a fresh array, a view, an mpi4py buffer spec all hit) and, where the chosen algorithm
has an inline form on the host arena, runs it as one compiled kernel call; otherwise the call runs as a schedule
on the progress engine. Every collective goes through ``Executor.run``/``Executor.start``.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import time
from typing import TYPE_CHECKING, Any, Callable, Optional

import numpy as np

from . import buffers, paired
from .algorithms import ALGO, CHECK_CALLS, Call, Steps, select, verify_call
from .algorithms import arena_jit, direct_cma, shared, slots, staged
from .algorithms.registry import REDUCTIONS, REPRODUCIBLE, last_choice, parse_override
from .algorithms import cost as cost_model
from .buffers import IN_PLACE
from .composed import HostComposition
from .config import _ENV_BYTES, str_param
from .datatypes import Datatype
from .errors import InvalidArgumentError
from .memory import backend, host_address
from .ops import Op
from .p2p import Schedule, Sig
from .request import Request
from .transport.arena import DEPTH, fold_seq

if TYPE_CHECKING:
    from .comm import Comm

CALL_KEY = str_param(
    "PYCOLL_CALL_KEY", "auto",
    "How a collective call's shape key (the key of its cached plan, built on every call) is made: `auto`, in C "
    "where `pycoll/_callkey.c` was compiled at install (about 0.2 µs against 1.1-1.6 µs), else in Python; "
    "`python`: always in Python. Read when pycoll is imported.",
)
_PLANS = 64  # plans kept per communicator (oldest dropped first)
_FAST_SPIN_S = 50e-6  # how long an inline arena call spins for its peers before it waits as a schedule
# where ranks outnumber cores: a fifth of a microsecond, then the kernel gives the core away (arena_jit.YIELDS)
_OVERSUBSCRIBED_SPIN_S = 0.2e-6
# Ranks that outnumber the cores spin only briefly (the peer they wait for may need the core), then yield the core and
# call the kernel again for this long before the call waits as a schedule: a schedule costs tens of microseconds.
_YIELD_RETRY_S = 1e-3
_SCALARS = (int, str, bool, float, type(None), Op, Datatype, np.dtype)


def shape_key_python(args: tuple) -> Optional[tuple]:
    """What a call's arguments are, apart from buffer addresses: None where an argument is of a kind not planned.

    One entry per argument; a list or tuple becomes a tuple of its type and its items' entries, so no two different
    argument lists share a key. The usual buffer specs, ``[buf, count, type]`` and ``[buf, type]``, get one flat
    entry each (an array's entry is its shape, dtype and C-order and writable flags, a Datatype stands bare), which
    no other argument list can produce. Built without recursion or per-item calls: it runs on every call.
    ``shape_key`` is this function's C form (``pycoll/_callkey.c``) where it was compiled at install.
    """
    key = []
    add = key.append
    for a in args:
        t = type(a)
        if t is list or t is tuple:
            n = len(a)
            if n == 3:
                b, c, d = a
                if type(b) is _NDARRAY and type(c) is int and type(d) is Datatype:
                    f = b.flags
                    add((t, b.shape, b.dtype, f.c_contiguous, f.writeable, c, d))
                    continue
            elif n == 2:
                b, d = a
                if type(b) is _NDARRAY and type(d) is Datatype:
                    f = b.flags
                    add((t, b.shape, b.dtype, f.c_contiguous, f.writeable, d))
                    continue
            item = _describe_items(t, a)
            if item is None:
                return None
            add(item)
        elif t is _NDARRAY:  # C order says the strides (a plan never takes an array in another order)
            f = a.flags
            add((a.shape, a.dtype, f.c_contiguous, f.writeable))
        elif t is int or t is Op or t is str or a is IN_PLACE or a is None:  # no other entry equals these
            add(a)
        elif t is bool:  # True == 1: a flag gets an entry no int equals
            add(_TRUE if a else _FALSE)
        else:
            item = _describe_scalar(t, a)
            if item is None:
                return None
            add(item)
    return tuple(key)


_NDARRAY = np.ndarray
_TRUE, _FALSE = object(), object()


def _describe_items(t: type, items: Any) -> Optional[tuple]:
    """The key entry of a list or tuple argument (a buffer spec, counts, displacements), None if not planned."""
    out: list = [t]
    for a in items:
        ta = type(a)
        if ta is np.ndarray:
            f = a.flags
            out.append((a.shape, a.dtype, f.c_contiguous, f.writeable))
        elif ta is Datatype:
            out.append((ta, a))
        elif ta is int or a is IN_PLACE:
            out.append(a)
        elif ta is list or ta is tuple:
            inner = _describe_items(ta, a)
            if inner is None:
                return None
            out.append(inner)
        else:
            inner = _describe_scalar(ta, a)
            if inner is None:
                return None
            out.append(inner)
    return tuple(out)


def _describe_scalar(t: type, a: Any) -> Any:
    """A scalar's entry, with its type (True == 1 == 1.0, but only the int is a valid count or root); None for other
    buffer kinds (memoryview, bytearray, device arrays, ...), which are checked on every call."""
    if t in _SCALARS:
        return (t, a)
    if isinstance(a, np.integer):
        return int(a)
    return None


def _compiled_shape_key() -> Optional[Callable[[tuple], Optional[tuple]]]:
    """The C form of ``shape_key_python``, or None where it was not built (PYCOLL_CALL_KEY=python: never used)."""
    if CALL_KEY.get() == "python":
        return None
    try:  # an extension module, absent where the install had no compiler
        _callkey = importlib.import_module("pycoll._callkey")
    except ImportError:
        return None
    _callkey.configure(Datatype, Op, IN_PLACE, _TRUE, _FALSE, _describe_items, _describe_scalar)
    return _callkey.shape_key


shape_key: Callable[[tuple], Optional[tuple]] = _compiled_shape_key() or shape_key_python


def _arrays(args: tuple):
    """(path, array) of every NumPy array among the arguments, one level into buffer specs."""
    for i, a in enumerate(args):
        if type(a) is np.ndarray:
            yield (i, -1), a
        elif type(a) in (list, tuple) and a and type(a[0]) is np.ndarray:
            yield (i, 0), a[0]


class _Rebind:
    """How a call's flat view is found again in a later call of the same shape: which argument, dtype, element range.

    ``view`` is made for the shape: a whole one-dimensional array is fetched from the arguments and nothing more."""

    __slots__ = ("index", "item", "dtype", "start", "stop", "whole", "view")

    def __init__(self, index: int, item: int, dtype: np.dtype, start: int, stop: int, whole: bool, ndim: int = 1) -> None:
        self.index, self.item, self.dtype, self.start, self.stop, self.whole = index, item, dtype, start, stop, whole
        if whole and ndim == 1:
            i, j = index, item
            self.view = (lambda args: args[i]) if j < 0 else (lambda args: args[i][j])
        else:
            self.view = self._view

    @staticmethod
    def find(view: Optional[np.ndarray], args: tuple) -> Any:
        """The recipe for ``view`` (a flat view into one of ``args``), None for no view, False if it is not one."""
        if view is None:
            return None
        if type(view) is not np.ndarray or not view.flags.c_contiguous:
            return False
        addr = host_address(view) if view.size else -1
        for (i, j), a in _arrays(args):
            if not a.flags.c_contiguous or a.dtype.hasobject:
                continue
            base = host_address(a)
            isz = view.dtype.itemsize
            if view.size == 0:
                if a.size == 0 or a.nbytes % isz:
                    continue
                return _Rebind(i, j, view.dtype, 0, 0, False)
            if base <= addr and addr + view.nbytes <= base + a.nbytes and (addr - base) % isz == 0 and a.nbytes % isz == 0:
                start = (addr - base) // isz
                whole = start == 0 and view.nbytes == a.nbytes and view.dtype == a.dtype
                return _Rebind(i, j, view.dtype, start, start + view.size, whole, a.ndim)
        return False

    def _view(self, args: tuple) -> np.ndarray:
        a = args[self.index] if self.item < 0 else args[self.index][self.item]
        if a.ndim != 1:
            a = a.reshape(-1)
        if self.whole:
            return a
        if a.dtype != self.dtype:
            a = a.view(self.dtype)
        return a[self.start:self.stop]


class Plan:
    """A checked call shape: its call template and signature, how to rebind its views, and its algorithm choice."""

    __slots__ = ("template", "sig", "send", "recv", "label", "algo", "algo_for", "inline", "fast")

    def __init__(self, label: str, call: Call, sig: Sig, send: Any, recv: Any) -> None:
        self.label = label
        self.template = dataclasses.replace(call, send=None, recv=None)  # a plan keeps no user memory alive
        self.sig = sig
        self.send, self.recv = send, recv
        self.algo: Any = None  # the Algorithm selected for it, valid while ``algo_for`` holds
        self.algo_for: tuple = ()
        self.inline: Any = None  # the algorithm's inline runner on the arena (see ``Runner``), or False: none
        # the runner's whole call for these arguments (``Runner.fast_path``): False where it has none, None untried
        self.fast: Any = None

    def views(self, args: tuple) -> Optional[tuple[Optional[np.ndarray], Optional[np.ndarray]]]:
        """(send, recv) flat views for these arguments (same shape), or None if they now overlap (the checks name it)."""
        send = self.send.view(args) if self.send is not None else None
        recv = self.recv.view(args) if self.recv is not None else None
        if send is not None and recv is not None and not self.template.in_place and send.size and recv.size:
            # two distinct arrays that own their memory cannot overlap; the same array twice, or views, may
            if send is recv or send.base is not None or recv.base is not None:
                if buffers.overlaps(send, recv):
                    return None
        return send, recv

    def make_call(self, send: Optional[np.ndarray], recv: Optional[np.ndarray]) -> Call:
        t = self.template
        return Call(t.coll, t.dtype, send, recv, t.op, t.root, t.counts, t.displs, t.send_counts, t.send_displs,
                    t.in_place, t.vector, t.total)

    def call(self, args: tuple) -> Optional[Call]:
        """The call for these arguments (same shape), or None if its buffers now overlap (the checks name it)."""
        views = self.views(args)
        return None if views is None else self.make_call(*views)


class Executor:
    """Runs one communicator's collectives: plan lookup, argument checks on a miss, selection, inline or scheduled."""

    def __init__(self, comm: "Comm", describe: Callable[[Sig], str]) -> None:
        self.comm = comm
        self.describe = describe  # names a call from its signature, in mismatch reports
        self.engine = comm._engine
        self.plans: dict[tuple, Plan] = {}
        self.chosen: Any = None  # the algorithm ``stage`` selected for a device call (run as is, or on its staged twin)
        self.others = [q for q in range(comm.size) if q != comm.rank]
        # small calls of a communicator across hosts: a call per host and one among the hosts' first ranks
        self.composed: Optional[HostComposition] = HostComposition(comm) if HostComposition.wanted(comm) else None
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
        if key is not None:
            try:
                plan = self.plans.get((label, key))
            except TypeError:  # an unhashable argument (the checks name it)
                plan = None
            if plan is not None:
                fast = plan.fast
                if fast:
                    if fast(args):
                        return
                    plan.fast = None  # it declined (a new arena, algorithm or spin, a busy arena): made again later
                views = plan.views(args)
                if views is not None:
                    runner = plan.inline
                    if runner and plan.algo_for == self.choice_key() and runner.run(self, plan, views[0], views[1]):
                        if fast is None:
                            plan.fast = runner.fast_path(self, plan)
                        return
                    call = plan.make_call(*views)
                    if self.composed is not None and self._compose(label, call):
                        return
                    self._finish(self._schedule(label, call, plan.sig, plan, True))
                    return
        call, sig, stage = self._resolve(label, build, args, stream)
        plan = self._remember(label, args, call, sig) if stage is None and stream is None else None
        if stage is None:
            if self.composed is not None and self._compose(label, call):
                return
            self._finish(self._schedule(label, call, sig, plan, True))
            return
        try:
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
        self.comm._live(label)
        self.composed.run(call)
        last_choice.collective, last_choice.algorithm, last_choice.nbytes = call.coll, "composed", call.size_bytes
        last_choice.why = "a call on each host's communicator and one among the hosts' first ranks (PYCOLL_SMP_BYTES)"
        return True

    def start(self, label: str, build: Callable[..., tuple[Call, Sig]], args: tuple, stream: Any = None) -> Request:
        """A nonblocking collective: scheduled now, progressed by the engine, finished by the request."""
        plan = self._plan(label, args) if stream is None else None
        call = plan.call(args) if plan is not None else None
        if call is not None:
            assert plan is not None
            return Request(self.engine, self.comm, schedule=self._schedule(label, call, plan.sig, plan))
        call, sig, stage = self._resolve(label, build, args, stream)
        if stage is None and stream is None:
            plan = self._remember(label, args, call, sig)
        try:
            sched = self._schedule(label, call, sig, plan if stage is None else None)
        except BaseException:
            if stage is not None:
                stage.discard()
            raise
        return Request(self.engine, self.comm, schedule=sched, after=stage)

    def _plan(self, label: str, args: tuple) -> Optional[Plan]:
        key = shape_key(args)
        if key is None:
            return None
        try:
            return self.plans.get((label, key))
        except TypeError:  # an unhashable argument (the checks name it)
            return None

    def _remember(self, label: str, args: tuple, call: Call, sig: Sig) -> Optional[Plan]:
        """Keep a checked call as the plan of its shape, if its views can be found again in later calls."""
        key = shape_key(args)
        if key is None or call.stream is not None:
            return None
        send_rb, recv_rb = _Rebind.find(call.send, args), _Rebind.find(call.recv, args)  # in place: views into recv
        if send_rb is False or recv_rb is False:
            return None
        try:
            hash(key)
        except TypeError:
            return None
        if len(self.plans) >= _PLANS:
            self.plans.pop(next(iter(self.plans)))
        plan = self.plans[(label, key)] = Plan(label, call, sig, send_rb, recv_rb)
        return plan

    def clear(self) -> None:
        self.plans.clear()
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
        chosen, self.chosen = self.chosen, None
        c._live(label)
        c._seq += 1
        steps, owner = self.steps(label, sig)
        steps.now = blocking and self.engine.direct_peers and call.stream is None
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
                kind = _INLINE.get(algo.run) if c._arena is not None else None
                plan.inline = kind(self, plan) if kind is not None else False
        if plan is not None and plan.fast is None and plan.inline is False and self.engine.direct_peers:
            plan.fast = paired.fast_path(self, plan, algo)  # a two-rank call across hosts: straight through the socket
        gen = algo.run(steps, call)
        if CHECK_CALLS.get() and c._size > 1:
            gen = self._checked(steps, sig, gen)
        return self.engine.start(Schedule(gen, owner), steps.now)

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
        c._live(label)
        self.chosen = None
        if self.gate.kernels is None and c._arena is not None:
            self.gate.open()  # a shape's first call opens the compiled kernels, so its second never stalls on them
        try:
            with buffers.collecting_packed() as unpacking:  # derived datatypes' packed receive buffers
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
        mem = {buffers.memory_of(a) for a in (call.send, call.recv) if a is not None}
        if mem != {"cuda"}:
            if len(mem) > 1:
                where = "on the device" if buffers.memory_of(call.send) == "cuda" else "in host memory"
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
        if arena.lagging and not handles_lag:
            if arena.waiting_for("done", state.ops - 1, self.others):
                return None  # the schedule's ``lag_wait`` waits for them
            arena.lagging = False
        if c._freed or c._aborted is not None or c._engine.broken_ctxs:
            c._live(label)  # raises
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


# ---- inline runners: one per algorithm that has an inline form on the arena --------------------------------------

def _fast_call(x: Executor, plan: Plan, runner: "Runner", kernel: Callable[[Any, Any, int, int], int],
               lags: bool = False) -> Any:
    """A plan's whole inline call as one closure (see ``Runner.fast_path``): what the plan, the arena and the choice
    of algorithm settled is bound once; a call rebinds its views, numbers itself and runs ``kernel(send, recv,
    opno, seq)``, whose status it acts on. The choice is rechecked from the raw environment words it depends on.

    ``lags``: the kernel waits for the peers' last calls itself when the arena is ``lagging``, and may return without
    waiting for every peer (the arena is then ``lagging``); other kernels never start on a lagging arena."""
    c = x.comm
    state, env, model = c._arena, _ENV_BYTES, cost_model.current()
    if env is None or state is None or state.arena is None or state.status != "ready":
        return False
    a, gate, engine = state.arena, x.gate, c._engine
    ka, kc, kr = ALGO.env_key, CHECK_CALLS.env_key, REPRODUCIBLE.env_key
    va, vc, vr, mine, polls = env.get(ka), env.get(kc), env.get(kr), c._reproducible, gate.polls
    send_view = plan.send.view if plan.send is not None else None
    recv_view = plan.recv.view if plan.recv is not None else None
    overlap = not plan.template.in_place and send_view is not None and recv_view is not None
    overlaps = buffers.overlaps
    one_sided = lags and runner.one_sided

    def fast(args: tuple) -> bool:
        if (env.get(ka) != va or env.get(kc) != vc or env.get(kr) != vr or c._reproducible is not mine
                or cost_model._current is not model or gate.polls != polls):
            return False
        send = send_view(args) if send_view is not None else None
        recv = recv_view(args) if recv_view is not None else None
        if overlap and (send is recv or send.base is not None or recv.base is not None) and send.size and recv.size \
                and overlaps(send, recv):
            return False  # the checks name it
        if (state.arena is not a or a.finished != state.ops or state.status != "ready" or c._freed
                or c._aborted is not None or engine.broken_ctxs or (a.lagging and not lags)):
            return False
        seq = c._seq + 1
        c._seq = a.seq = seq
        opno = state.ops + 1
        state.ops = a.ops = opno
        state.last = (seq, opno)
        status = kernel(send, recv, opno, seq)
        if status == 0:  # DONE, and nobody to wake
            a.finished = opno
            a.lagging = lags and one_sided
            gate.inline += 1
            return True
        runner.tail(x, plan, a, opno, status, send, recv)
        return True

    return fast



class Runner:
    """An algorithm's inline form for one plan: ``run`` posts, spins briefly for the peers and finishes the whole call
    (one kernel call once the kernels are loaded); if the peers are late, the rest runs as a schedule. ``run`` returns
    False, having done nothing, where the inline form does not apply (the caller then schedules the call)."""

    def __init__(self, x: Executor, plan: Plan) -> None:
        self.x, self.plan, self.label, self.sig = x, plan, plan.label, plan.sig
        self.words = arena_jit.sig_words(plan.sig)
        self.sig_array = arena_jit.sig_array(self.words)
        self.arena: Any = None  # the arena the prepared arguments are for
        self.kernel: Any = None  # the fast path's kernel step (send, recv, opno, seq) -> status, for its retries
        self.one_sided = False  # its calls may return before every peer read what they posted (``HostArena.lagging``)

    def run(self, x: Executor, plan: Plan, send: Any, recv: Any) -> bool:  # pragma: no cover - each runner has one
        raise NotImplementedError

    def fast_path(self, x: Executor, plan: Plan) -> Any:
        """The whole call as one function of the call's arguments, for a plan that just ran inline: it rebinds the
        views, numbers the call and runs the kernel, and returns False (having done nothing) where anything it was
        made for changed (the arena, the algorithm choice, the spin, an unfinished nonblocking call). False: none;
        None: not yet (asked again after the next inline run)."""
        return False

    def tail(self, x: Executor, plan: Plan, arena: Any, opno: int, status: int, send: Any, recv: Any) -> None:
        """After a kernel status other than DONE: retry while ranks share the cores, else finish as a schedule."""
        raise NotImplementedError  # pragma: no cover - runners with a fast path have one

    def retried(self, x: Executor, arena: Any, opno: int, status: int, send: Any, recv: Any) -> int:
        """``status`` after retrying the fast path's kernel step (``self.kernel``) while ranks share the cores."""
        if x.retry_s:
            seq = arena.seq
            status = x.retry(arena, status, lambda: self.kernel(send, recv, opno, seq))
        return status


class _Oneshot(Runner):
    """A small Allreduce through the slots (``allreduce:oneshot``)."""

    prep: Any = None

    def run(self, x: Executor, plan: Plan, send: Any, recv: Any) -> bool:
        kern = x.gate.open()
        slot_bytes = x.comm._arena.arena.slot_bytes if x.comm._arena.arena is not None else 0
        if recv.nbytes > slot_bytes:
            return False
        taken = x.begin(self.label)
        if taken is None:
            return False
        a, opno = taken
        if kern is not None and (self.prep is None or self.prep.arena is not a):
            self.prep = arena_jit.Prepared(a, self.sig, plan.template.op, plan.template.dtype, recv.size, kern)
        if kern is not None and self.prep.ok:
            prep, gate = self.prep, x.gate
            slots_, bases = prep.views[opno % DEPTH]
            fn, seq = prep.kernel, a.seq
            y, yf = gate.yields, gate.yield_fn
            status = fn(a.u64, slots_, send, recv, a.rank, bases, prep.sig, opno, prep.code, gate.polls, seq, y, yf)
            status = x.retry(a, status, lambda: fn(a.u64, slots_, send, recv, a.rank, bases, prep.sig, opno, prep.code,
                                                   gate.polls, seq, y, yf))
            if arena_jit.finished(a, opno, status, gate):
                return True
            mine = prep.words
            call = plan.make_call(send, recv)
        else:
            call = plan.make_call(send, recv)
            mine = shared.oneshot_post(a, opno, call, self.sig)
            if x.spin_meeting(a, opno, mine, lambda: shared.oneshot_reduce(a, opno, call)):
                return True
        x.rest(self.label, self.sig, lambda st: shared.oneshot_rest(st, a, opno, call, mine))
        return True

    def fast_path(self, x: Executor, plan: Plan) -> Any:
        prep = self.prep
        if prep is None or prep.raw is None:
            return False
        a, fn, sig, code, polls = prep.arena, prep.raw, prep.sig, prep.code, x.gate.polls
        u64, me, rows, y, yf = a.u64, a.rank, prep.views[0][0], x.gate.yields, x.gate.yield_fn
        bases = [b for _, b in prep.views]

        def kernel(send: Any, recv: Any, opno: int, seq: int) -> int:  # the plan's size fits the slot
            return fn(u64, rows, send, recv, me, bases[opno % DEPTH], sig, opno, code, polls, seq, y, yf)

        self.kernel = kernel
        return _fast_call(x, plan, self, kernel)

    def tail(self, x: Executor, plan: Plan, arena: Any, opno: int, status: int, send: Any, recv: Any) -> None:
        status = self.retried(x, arena, opno, status, send, recv)
        if arena_jit.finished(arena, opno, status, x.gate):
            return
        call = plan.make_call(send, recv)
        mine = self.prep.words
        x.rest(self.label, self.sig, lambda st: shared.oneshot_rest(st, arena, opno, call, mine))


class _Pipe(Runner):
    """A pipelined ``staged`` allreduce, reduce-scatter, allgather, reduce or (ex)scan in one kernel call (meeting, every
    chunk, close)."""

    pipe: Any = None

    def run(self, x: Executor, plan: Plan, send: Any, recv: Any) -> bool:
        kern = x.gate.open()
        arena = x.comm._arena.arena
        if not kern or arena is None or not arena.stage_bytes:
            return False
        call = plan.make_call(send, recv)
        if self.pipe is None or self.arena is not arena or not self.pipe.kernel:
            self.pipe, self.arena = staged.Pipe(arena, call, x.comm._rank), arena
        pipe = self.pipe
        if not pipe.covered:
            return False
        taken = x.begin(self.label)
        if taken is None:
            return False
        a, opno = taken
        s, r = pipe.views(call)
        gate = x.gate
        base = a.rounds
        self.sig_array[3] = fold_seq(self.words[3], a.seq)
        status, j, met = kern.blocks(a.u64, pipe.stages, s, r, pipe.sd, pipe.rd, pipe.counts, a.rank, gate.bases(a, opno),
                                     self.sig_array, opno, pipe.mode, pipe.code, pipe.local, base, pipe.c, pipe.nslots,
                                     min(gate.polls, pipe.polls))
        if arena_jit.finished(a, opno, status, gate):
            a.rounds = base + pipe.nchunks
            return True
        x.rest(self.label, self.sig, lambda st: staged.pipe_rest(st, a, opno, self.words, pipe, call, met, j))
        return True


class _Broadcast(Runner):
    """A ``broadcast:staged`` call in one kernel call when the peers keep up."""

    def run(self, x: Executor, plan: Plan, send: Any, recv: Any) -> bool:
        kern = x.gate.open()
        arena = x.comm._arena.arena
        if kern is None or arena is None or not arena.stage_bytes:
            return False
        taken = x.begin(self.label)
        if taken is None:
            return False
        a, opno = taken
        gate, data, root = x.gate, recv.view(np.uint8), plan.template.root
        chunk, nslots, _ = shared.pipe_shape(a, data.nbytes)
        base = a.rounds
        self.sig_array[3] = fold_seq(self.words[3], a.seq)
        status, j, met = kern.broadcast(a.u64, a.stage(root), data, a.rank, gate.bases(a, opno), self.sig_array, opno, root,
                                        base, chunk, nslots, gate.polls)
        if arena_jit.finished(a, opno, status, gate):
            a.rounds = base + j
            return True
        call = plan.make_call(send, recv)
        x.rest(self.label, self.sig, lambda st: shared.broadcast_staged_rest(st, a, opno, self.words, call, met, j))
        return True


class _Barrier(Runner):
    """Barrier through the arena: post, meet, leave."""

    def run(self, x: Executor, plan: Plan, send: Any, recv: Any) -> bool:
        if CHECK_CALLS.get():
            return False
        kern = x.gate.open()
        taken = x.begin(self.label)
        if taken is None:
            return False
        a, opno = taken
        if kern is not None:
            gate = x.gate
            bases, seq = gate.bases(a, opno), a.seq
            y, yf = gate.yields, gate.yield_fn
            status = kern.barrier(a.u64, a.rank, bases, self.sig_array, opno, gate.polls, seq, y, yf)
            status = x.retry(a, status, lambda: kern.barrier(a.u64, a.rank, bases, self.sig_array, opno, gate.polls, seq,
                                                             y, yf))
            if arena_jit.finished(a, opno, status, gate):
                return True
            mine = self.words
        else:
            mine = shared.post_call(a, opno, self.sig)
            if x.spin_meeting(a, opno, mine, lambda: None):
                return True
        x.rest(self.label, self.sig, lambda st: shared.barrier_rest(st, a, opno, mine))
        return True

    def fast_path(self, x: Executor, plan: Plan) -> Any:
        kern = x.gate.kernels
        state = x.comm._arena
        if not kern:
            return None  # not yet: the kernels are still loading
        if state is None or state.arena is None:
            return False
        a, gate, sig = state.arena, x.gate, self.sig_array
        fn, u64, me, polls = arena_jit.pick(kern, "barrier"), a.u64, a.rank, gate.polls
        bases, y, yf = [gate.bases(a, k) for k in range(DEPTH)], gate.yields, gate.yield_fn

        def kernel(send: Any, recv: Any, opno: int, seq: int) -> int:
            return fn(u64, me, bases[opno % DEPTH], sig, opno, polls, seq, y, yf)

        self.kernel = kernel
        return _fast_call(x, plan, self, kernel)

    def tail(self, x: Executor, plan: Plan, arena: Any, opno: int, status: int, send: Any, recv: Any) -> None:
        status = self.retried(x, arena, opno, status, None, None)
        if arena_jit.finished(arena, opno, status, x.gate):
            return
        mine = self.words
        x.rest(self.label, self.sig, lambda st: shared.barrier_rest(st, arena, opno, mine))


class _Slots(Runner):
    """A small collective through the slots (the ``slots`` algorithms), one kernel call when the peers keep up. A
    rank waits only for the peers whose slots it reads, so a Bcast root, a Gather or Reduce leaf returns once it
    posted (``Program.one_sided``)."""

    prep: Any = None

    def run(self, x: Executor, plan: Plan, send: Any, recv: Any) -> bool:
        kern = x.gate.open()
        if kern is None:
            return False
        arena = x.comm._arena.arena
        if self.prep is None or self.prep.arena is not arena:
            if arena is None:
                return False
            self.prep = slots.Prepared(arena, plan.make_call(send, recv), self.sig, x.comm._rank, kern)
            self.one_sided = self.prep.prog.one_sided
        prep = self.prep
        if not prep.ok:
            return False
        taken = x.begin(self.label, posts_seq=True, handles_lag=True)
        if taken is None:
            return False
        a, opno = taken
        status = slots.run_kernel(kern, prep, a, opno, send, recv, x.gate)
        if status == arena_jit.DONE:
            a.finished = opno
            a.lagging = self.one_sided
            x.gate.inline += 1
        else:
            self.tail(x, plan, a, opno, status, send, recv)
        return True

    def fast_path(self, x: Executor, plan: Plan) -> Any:
        prep = self.prep
        if prep is None or prep.raw is None or prep.as_bytes or prep.polls != x.gate.polls:
            return False
        fn, a, sl, metas, sig, empty = prep.raw, prep.arena, prep.slots, prep.metas, prep.sig, prep.empty
        u64 = a.u64
        if prep.prog.pack_from_recv:  # the root's Bcast, an in-place Allgather: packed from the receive buffer
            def kernel(send: Any, recv: Any, opno: int, seq: int) -> int:
                return fn(u64, sl, recv, recv, metas[opno % DEPTH], sig, opno, seq, a.lagging)
        else:
            def kernel(send: Any, recv: Any, opno: int, seq: int) -> int:
                return fn(u64, sl, empty if send is None else send, empty if recv is None else recv,
                          metas[opno % DEPTH], sig, opno, seq, a.lagging)

        return _fast_call(x, plan, self, kernel, lags=True)

    def tail(self, x: Executor, plan: Plan, arena: Any, opno: int, status: int, send: Any, recv: Any) -> None:
        prep = self.prep
        if x.retry_s:
            status = x.retry(arena, status, lambda: slots.run_kernel(None, prep, arena, opno, send, recv, x.gate))
        if arena_jit.finished(arena, opno, status, x.gate):
            arena.lagging = self.one_sided
            return
        call = plan.make_call(send, recv)
        if status & arena_jit.UNPOSTED:  # nothing posted: wait for the peers' last calls, then the whole call
            x.rest(self.label, self.sig, lambda st: slots.slots_unposted(st, arena, opno, call))
            return
        arena.lagging = False  # the rest meets every peer
        x.rest(self.label, self.sig, lambda st: slots.slots_rest(st, arena, opno, call, prep.words))


def _reached(x: Executor, arena: Any, what: str, opno: int, ranks: list[int], extra_s: float = 0.0) -> bool:
    """Whether ``ranks`` reach ``what`` for ``opno`` while this rank spins (``extra_s`` longer); where ranks share the
    cores it spins only briefly, then yields the core between polls for ``retry_s`` (and ``extra_s``)."""
    waiting = arena.waiting_for
    if not waiting(what, opno, ranks):
        return True
    clock = time.perf_counter
    spin_end = clock() + x.spin_s + (0.0 if x.retry_s else extra_s)
    end = spin_end + (x.retry_s + extra_s if x.retry_s else 0.0)
    while waiting(what, opno, ranks):
        now = clock()
        if now > spin_end:
            if now > end:
                return False
            os.sched_yield()
    return True


class _Cma(Runner):
    """A ``cma`` Gather, Scatter, Alltoall, Broadcast or Allgather (``direct_cma``): the rank's program in one kernel
    call (post, meet, copy by cross-memory attach, copy the local block, wait until the ranks that copy from or into
    this rank's memory are done), or in Python while the kernels load. What the peers are late for runs on as a
    schedule (``direct_cma.cma_rest``/``cma_wait_rest``), as does a call whose posts do not match (it reports the
    mismatch)."""

    host = backend("host")
    spin_s_per_byte = 1e-9  # the "done" spin also waits out the peers' copies: at least 1 GB/s

    def __init__(self, x: Executor, plan: Plan) -> None:
        super().__init__(x, plan)
        self.moves = direct_cma.MOVES[plan.template.coll]
        self.checked = CHECK_CALLS.get()  # part of the plan's choice: a change makes a new runner
        self.prog: Any = None  # the rank's direct_cma.Program: the same for every call of the plan
        self.packed: Any = None  # ... as the kernel takes it, for ``arena``
        self.scratch: Optional[bool] = None  # whether the call posts a scratch copy (the in-place Alltoall)

    def run(self, x: Executor, plan: Plan, send: Any, recv: Any) -> bool:
        if self.checked:
            return False
        state = x.comm._arena
        a = state.arena if state is not None else None
        if a is None or not a.cma_ok:
            return False
        kern = x.gate.open()
        taken = x.begin(self.label, posts_seq=True)
        if taken is None:
            return False
        a, opno = taken
        prog, mine, gate = self.prog, self.words, x.gate
        call = None
        if prog is None:
            call = plan.make_call(send, recv)
            prog = self.prog = self.moves.program(a.rank, a.size, call)
            self.scratch = self.moves.scratch(call)
        if self.scratch:
            call = call or plan.make_call(send, recv)
            try:
                s, r, scratch = self.moves.buffers(call, self.host)
            except BaseException:
                a.set_done(opno)
                raise
        else:
            s, r, scratch = direct_cma.address(send), direct_cma.address(recv), None
        if kern is not None:
            if self.arena is not a:
                readv, writev = a.cma.function_address("read"), a.cma.function_address("write")
                self.arena, self.packed = a, prog.packed(a.rank, gate.polls, readv, writev, a.pids) if readv and writev else None
        if kern is not None and self.packed is not None:
            sig, packed = self.sig_array, self.packed
            sig[3] = fold_seq(mine[3], a.seq)
            bases, seq = gate.bases(a, opno), a.seq
            status = kern.cma_moves(a.u64, bases, sig, packed, opno, seq, s, r)
            if x.retry_s:
                status = x.retry(a, status, lambda: kern.cma_moves(a.u64, bases, sig, packed, opno, seq, s, r))
            return self.after(x, plan, a, opno, status, send, recv, s, r, scratch, call)
        call = call or plan.make_call(send, recv)
        direct_cma.post(a, opno, prog, mine, s, r)
        posted = (mine[0], mine[1], mine[2], fold_seq(mine[3], a.seq))
        others = x.others
        if not _reached(x, a, "post", opno, others) or not direct_cma.posts_agree(a, opno, others, posted, prog.expects()):
            x.rest(self.label, self.sig, lambda st: direct_cma.cma_rest(st, a, opno, prog, mine, s, r, scratch))
            return True
        try:
            direct_cma.copy(a, opno, prog, s, r)
        except OSError:
            return self.failed(x, a, opno, prog, call, s, r, scratch)
        a.set_done(opno)
        direct_cma.local(prog, s, r)
        gate.inline += 1
        return self.wait(x, a, opno, prog, call, scratch)

    def after(self, x: Executor, plan: Plan, a: Any, opno: int, status: int, send: Any, recv: Any, s: int, r: int,
              scratch: Any, call: Any = None) -> bool:
        """Act on the kernel's status: done, done here with peers still in this rank's memory (``wait``), a failed
        copy, or peers late or mismatched (the rest as a schedule)."""
        gate, prog = x.gate, self.prog
        if status & arena_jit.WAKE:
            a.bell.wake()
        code = status & 3
        if code == arena_jit.DONE and not status & arena_jit.FAILED:
            a.finished = opno
            gate.inline += 1
            if scratch is not None:
                self.host.release(scratch)
            return True
        call = call or plan.make_call(send, recv)
        if status & arena_jit.FAILED:
            return self.failed(x, a, opno, prog, call, s, r, scratch)
        if code == arena_jit.LEFT:
            a.finished = opno
            gate.inline += 1
            return self.wait(x, a, opno, prog, call, scratch)
        mine = self.words
        x.rest(self.label, self.sig, lambda st: direct_cma.cma_rest(st, a, opno, prog, mine, s, r, scratch))
        return True

    def fast_path(self, x: Executor, plan: Plan) -> Any:
        kern = x.gate.kernels
        a = self.arena
        if not kern or self.packed is None:
            return None  # not yet: the kernels are still loading
        if self.scratch or a is None or x.comm._arena is None or x.comm._arena.arena is not a:
            return False
        fn, sig, packed, w3, gate = arena_jit.pick(kern, "cma_moves"), self.sig_array, self.packed, self.words[3], x.gate
        u64, bases, address = a.u64, [gate.bases(a, k) for k in range(DEPTH)], direct_cma.address

        def kernel(send: Any, recv: Any, opno: int, seq: int) -> int:
            sig[3] = fold_seq(w3, seq)
            return fn(u64, bases[opno % DEPTH], sig, packed, opno, seq, address(send), address(recv))

        self.kernel = kernel
        return _fast_call(x, plan, self, kernel)

    def tail(self, x: Executor, plan: Plan, arena: Any, opno: int, status: int, send: Any, recv: Any) -> None:
        status = self.retried(x, arena, opno, status, send, recv)
        self.after(x, plan, arena, opno, status, send, recv, direct_cma.address(send), direct_cma.address(recv), None)

    def wait(self, x: Executor, a: Any, opno: int, prog: Any, call: Any, scratch: Any) -> bool:
        """This rank is done: wait (inline, then as a schedule) until the ranks that use its memory are."""
        waits = prog.waits.tolist()
        if waits and not _reached(x, a, "done", opno, waits, call.nbytes * self.spin_s_per_byte):
            x.rest(self.label, self.sig, lambda st: direct_cma.cma_wait_rest(st, a, opno, waits, scratch))
            return True
        if scratch is not None:
            self.host.release(scratch)
        return True

    def failed(self, x: Executor, a: Any, opno: int, prog: Any, call: Any, s: int, r: int, scratch: Any) -> bool:
        """A cross-memory copy failed: copy again in Python, for the error (a peer probably exited), and report it as a
        schedule does; this rank is done."""
        try:
            direct_cma.copy(a, opno, prog, s, r)
        except OSError as exc:
            a.set_done(opno)
            err = exc  # ``exc`` is unbound once this block ends; the schedule runs later
            x.rest(self.label, self.sig, lambda st: direct_cma.cma_copy_failed(st, a, err, prog.verb))
            return True
        a.set_done(opno)
        direct_cma.local(prog, s, r)
        return self.wait(x, a, opno, prog, call, scratch)


_INLINE: dict[Callable, type] = {
    shared.allreduce_oneshot: _Oneshot,
    staged.allreduce_staged: _Pipe,
    staged.reduce_scatter_staged: _Pipe,
    staged.allgather_staged: _Pipe,
    staged.reduce_staged: _Pipe,
    staged.scan_staged: _Pipe,
    staged.exscan_staged: _Pipe,
    shared.broadcast_staged: _Broadcast,
    shared.barrier_arena: _Barrier,
    **{run: _Slots for run in slots.RUNS},
    direct_cma.gather_cma: _Cma,
    direct_cma.scatter_cma: _Cma,
    direct_cma.alltoall_cma: _Cma,
    direct_cma.broadcast_cma: _Cma,
    direct_cma.allgather_cma: _Cma,
}
