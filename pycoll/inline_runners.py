"""The inline forms of the algorithms that have one on a host's shared arena: a ``Runner`` per algorithm posts, spins
briefly for the peers and finishes a planned call as one compiled kernel call, and keeps the whole call as a
closure (``fast_call``) for the plan's later calls; a late peer hands the rest to a schedule (``Executor.rest``)."""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any, Callable, Optional

import numpy as np

from . import arrays
from .algorithms.check import CHECK_CALLS
from .algorithms.registry import ALGO
from .algorithms import arena_jit, arena_meeting, cma_program, direct_cma, shared, slots, staged
from .algorithms.registry import REPRODUCIBLE
from .algorithms import cost as cost_model
from .config import _ENV_BYTES
from .memory import backend
from .p2p_specs import call_key_module
from .transport.arena import DEPTH, fold_seq

if TYPE_CHECKING:  # annotations only: the executor runs these
    from .executor import Executor
    from .plans import Plan


# ---- inline runners: one per algorithm that has an inline form on the arena --------------------------------------

def fast_call(x: Executor, plan: Plan, runner: "Runner", kernel: Callable[[Any, Any, int, int], int],
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
    overlaps = arrays.overlaps
    one_sided, others = lags and runner.one_sided, x.others
    broken, base = engine.broken_ctxs, c._ctx & ~1

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
                or c._aborted is not None or (broken and base in broken)):
            return False
        if a.lagging and not lags and not a.caught_up(state.ops, others):  # after a one-sided call, a peer behind
            return False  # the schedule's ``lag_wait`` waits for them
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
        self.kernel = oneshot_kernel(x, prep, prep.sig)  # the plan's size fits the slot
        return fast_call(x, plan, self, self.kernel)

    def tail(self, x: Executor, plan: Plan, arena: Any, opno: int, status: int, send: Any, recv: Any) -> None:
        oneshot_tail(x, self, arena, opno, status, send, recv,
                     lambda: (plan.make_call(send, recv), self.sig, self.prep.words))


def oneshot_tail(x: Executor, runner: Runner, arena: Any, opno: int, status: int, send: Any, recv: Any,
                 rested: Callable[[], tuple[Any, Any, tuple]]) -> None:
    """After a one-shot Allreduce's kernel status other than DONE: retry while ranks share the cores, else the rest as
    a schedule, of the call, signature and posted words ``rested()`` gives."""
    status = runner.retried(x, arena, opno, status, send, recv)
    if arena_jit.finished(arena, opno, status, x.gate):
        return
    call, sig, mine = rested()
    x.rest(runner.label, sig, lambda st: shared.oneshot_rest(st, arena, opno, call, mine))


def oneshot_kernel(x: Executor, prep: Any, sig: np.ndarray) -> Callable[[Any, Any, int, int], int]:
    """A one-shot Allreduce's kernel step (send, recv, opno, seq) -> status, its arrays bound (``sig``: the
    signature words it posts)."""
    a, fn, code, polls = prep.arena, prep.raw, prep.code, x.gate.polls
    u64, me, rows, y, yf = a.u64, a.rank, prep.views[0][0], x.gate.yields, x.gate.yield_fn
    bases = [b for _, b in prep.views]

    def kernel(send: Any, recv: Any, opno: int, seq: int) -> int:
        return fn(u64, rows, send, recv, me, bases[opno % DEPTH], sig, opno, code, polls, seq, y, yf)

    return kernel


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
            mine = arena_meeting.post_call(a, opno, self.sig)
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
        return fast_call(x, plan, self, kernel)

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
            self.prep = slots.Prepared(arena, plan.make_call(send, recv), self.sig, x.comm._rank, kern,
                                       (self.words, self.sig_array))
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
        return fast_call(x, plan, self, slots_kernel(prep), lags=True)

    def tail(self, x: Executor, plan: Plan, arena: Any, opno: int, status: int, send: Any, recv: Any) -> None:
        slots_tail(x, self.label, self.sig, self.prep, self.one_sided, arena, opno, status, plan.make_call(send, recv))


def slots_kernel(prep: Any) -> Callable[[Any, Any, int, int], int]:
    """A ``slots`` program's kernel step (send, recv, opno, seq) -> status, its arrays bound."""
    fn, a, sl, metas, sig, empty = prep.raw, prep.arena, prep.slots, prep.metas, prep.sig, prep.empty
    u64 = a.u64
    if prep.prog.pack_from_recv:  # the root's Bcast, an in-place Allgather: packed from the receive buffer
        def kernel(send: Any, recv: Any, opno: int, seq: int) -> int:
            return fn(u64, sl, recv, recv, metas[opno % DEPTH], sig, opno, seq, a.lagging)
    else:
        def kernel(send: Any, recv: Any, opno: int, seq: int) -> int:
            return fn(u64, sl, empty if send is None else send, empty if recv is None else recv,
                      metas[opno % DEPTH], sig, opno, seq, a.lagging)
    return kernel


def slots_tail(x: Executor, label: str, sig: Any, prep: Any, one_sided: bool, arena: Any, opno: int, status: int,
                call: Any) -> None:
    """After a ``slots`` kernel status other than DONE: retry while ranks share the cores, else the rest (or, where
    nothing was posted, the whole call) as a schedule."""
    send, recv = call.send, call.recv
    if x.retry_s:
        status = x.retry(arena, status, lambda: slots.run_kernel(None, prep, arena, opno, send, recv, x.gate))
    if arena_jit.finished(arena, opno, status, x.gate):
        arena.lagging = one_sided
        return
    if status & arena_jit.UNPOSTED:  # nothing posted: wait for the peers' last calls, then the whole call
        x.rest(label, sig, lambda st: slots.slots_unposted(st, arena, opno, call))
        return
    arena.lagging = False  # the rest meets every peer
    words = prep.words
    x.rest(label, sig, lambda st: slots.slots_rest(st, arena, opno, call, words))


# where an array's first byte is (0: None or no bytes), in C where built
_buffer_address: Callable[[Any], int] = getattr(call_key_module(), "buffer_address", None) or cma_program.address


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
        self.prog: Any = None  # the rank's cma_program.Program: the same for every call of the plan
        self.packed: Any = None  # ... as the kernel takes it, for ``arena``
        self.scratch: Optional[bool] = None  # whether the call posts a scratch copy (the in-place Alltoall)

    def run(self, x: Executor, plan: Plan, send: Any, recv: Any) -> bool:
        if self.checked:
            return False
        state = x.comm._arena
        a = state.arena if state is not None else None
        if a is None or not a.cma_ok or state.status != "ready":
            return False
        kern = x.gate.open()
        prog, mine, gate = self.prog, self.words, x.gate
        call = None
        if prog is None:
            call = plan.make_call(send, recv)
            sub = cma_program.table_block_bytes(a.slot_bytes, a.size)
            prog = self.prog = self.moves.program(a.rank, a.size, call, sub)
            self.scratch = self.moves.scratch(call)
            self.one_sided = prog.one_sided
        if kern is not None and self.arena is not a:
            readv, writev = a.cma.function_address("read"), a.cma.function_address("write")
            self.arena = a
            self.packed = (prog.packed(a.rank, gate.polls, readv, writev, a.cma.bounces, a.pids, a)
                           if readv and writev else None)
        compiled = kern is not None and self.packed is not None
        taken = x.begin(self.label, posts_seq=True, handles_lag=compiled)  # the kernel waits out a lag itself
        if taken is None:
            return False
        a, opno = taken
        if self.scratch:
            call = call or plan.make_call(send, recv)
            try:
                s, r, scratch = self.moves.buffers(call, self.host)
            except BaseException:
                a.set_done(opno)
                raise
        else:
            s, r, scratch = _buffer_address(send), _buffer_address(recv), None
        if compiled:
            sig, packed = self.sig_array, self.packed
            bases, seq, lag = gate.bases(a, opno), a.seq, a.lagging
            status = kern.cma_moves(a.u64, bases, sig, packed, opno, seq, s, r, lag)
            if x.retry_s:
                status = x.retry(a, status, lambda: kern.cma_moves(a.u64, bases, sig, packed, opno, seq, s, r, lag))
            return self.after(x, plan, a, opno, status, send, recv, s, r, scratch, call)
        call = call or plan.make_call(send, recv)
        cma_program.post(a, opno, prog, mine, s, r)
        posted = (mine[0], mine[1], mine[2], fold_seq(mine[3], a.seq))
        others = x.others
        if (not _reached(x, a, "post", opno, others)
                or not cma_program.posts_agree(a, opno, others, posted, prog.expects())
                or not cma_program.tables_agree(a, opno, prog)):
            x.rest(self.label, self.sig, lambda st: direct_cma.cma_rest(st, a, opno, prog, mine, s, r, scratch))
            return True
        try:
            cma_program.copy(a, opno, prog, s, r)
        except OSError:
            return self.failed(x, a, opno, prog, call, s, r, scratch)
        a.set_done(opno)
        cma_program.local(prog, s, r)
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
            a.lagging = self.one_sided
            gate.inline += 1
            if scratch is not None:
                self.host.release(scratch)
            return True
        call = call or plan.make_call(send, recv)
        if status & arena_jit.FAILED:
            a.lagging = False
            return self.failed(x, a, opno, prog, call, s, r, scratch)
        if code == arena_jit.LEFT:
            a.finished = opno
            a.lagging = self.one_sided
            gate.inline += 1
            return self.wait(x, a, opno, prog, call, scratch)
        mine = self.words
        if status & arena_jit.UNPOSTED:  # nothing posted: wait for the peers' last calls, then the whole call
            x.rest(self.label, self.sig, lambda st: direct_cma.cma_unposted(st, a, opno, prog, mine, s, r, scratch))
            return True
        a.lagging = False  # the rest meets every peer
        x.rest(self.label, self.sig, lambda st: direct_cma.cma_rest(st, a, opno, prog, mine, s, r, scratch))
        return True

    def fast_path(self, x: Executor, plan: Plan) -> Any:
        kern = x.gate.kernels
        a = self.arena
        if not kern or self.packed is None:
            return None  # not yet: the kernels are still loading
        if self.scratch or a is None or x.comm._arena is None or x.comm._arena.arena is not a:
            return False
        fn, sig, packed, gate = arena_jit.pick(kern, "cma_moves"), self.sig_array, self.packed, x.gate
        u64, bases, address = a.u64, [gate.bases(a, k) for k in range(DEPTH)], _buffer_address

        def kernel(send: Any, recv: Any, opno: int, seq: int) -> int:  # the kernel folds seq into sig
            return fn(u64, bases[opno % DEPTH], sig, packed, opno, seq, address(send), address(recv), a.lagging)

        self.kernel = kernel
        return fast_call(x, plan, self, kernel, lags=True)

    def tail(self, x: Executor, plan: Plan, arena: Any, opno: int, status: int, send: Any, recv: Any) -> None:
        status = self.retried(x, arena, opno, status, send, recv)
        self.after(x, plan, arena, opno, status, send, recv, _buffer_address(send), _buffer_address(recv), None)

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
            cma_program.copy(a, opno, prog, s, r)
        except OSError as exc:
            a.set_done(opno)
            err = exc  # ``exc`` is unbound once this block ends; the schedule runs later
            x.rest(self.label, self.sig, lambda st: direct_cma.cma_copy_failed(st, a, err, prog.verb))
            return True
        a.set_done(opno)
        cma_program.local(prog, s, r)
        return self.wait(x, a, opno, prog, call, scratch)


# the algorithms whose inline form is a runner here, and that runner
INLINE: dict[Callable, type] = {
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
