"""The communicator: mpi4py's buffer and object API, argument checks, and dispatch to algorithms."""

from __future__ import annotations

import hashlib
import os
import pickle
import struct
import sys
import time
import dataclasses
import weakref
from typing import Any, Callable, Optional, Sequence

import numpy as np

from . import buffers, datatypes
from . import ops as _ops
from .algorithms import ALGO, CHECK_CALLS, Call, Layout, Steps, select, verify_call
from .algorithms import cost as cost_model
from .algorithms import arena_jit, shared, staged
from .algorithms.cuda_ipc import IpcState
from .algorithms.shared import ArenaState, arena_enabled
from .buffers import IN_PLACE, Buf, VBuf
from .errors import AbortedError, InvalidArgumentError
from .memory import backend
from .ops import Op
from .p2p import ANY_SOURCE, ANY_TAG, P2P_SIG, PROC_NULL, Owner, Schedule, Sig
from .request import Request, Status
from .runtime import Runtime
from .transport.arena import fold_seq
from .transport.shm import SHM_DIR

UNDEFINED = -32766

# Collective kinds as they travel in message headers (append only).
_KINDS = {
    "allreduce": 1,
    "reduce_scatter": 2,
    "allgather": 3,
    "broadcast": 4,
    "reduce": 5,
    "alltoall": 6,
    "gather": 7,
    "scatter": 8,
    "barrier": 9,
}
_KIND_NAMES = {v: k for k, v in _KINDS.items()}
_WORLD_CTX = 2


def _describe(sig: Sig) -> str:
    name = _KIND_NAMES.get(sig.kind, f"kind {sig.kind}")
    parts = []
    if sig.count:
        parts.append(f"count={sig.count}")
    if sig.dtype:
        parts.append(f"dtype={datatypes.from_code(sig.dtype).name}")
    if sig.op:
        parts.append(f"op={_ops.BY_CODE[sig.op].name}")
    if name in ("broadcast", "reduce", "gather", "scatter"):
        parts.append(f"root={sig.root}")
    if sig.vhash:
        parts.append(f"counts#{sig.vhash & 0xFFFF:04x}")
    return f"{name}({', '.join(parts)})"


def _vhash(values: Sequence[int]) -> int:
    digest = hashlib.blake2b(struct.pack(f"<{len(values)}q", *values), digest_size=8).digest()
    return int.from_bytes(digest, "little") or 1


def _child_ctx(parent: int, counter: int, tag: Any) -> int:
    digest = hashlib.blake2b(repr((parent, counter, tag)).encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "little") & ~1) % ((1 << 63) - 2) + 4  # even, never the world or control ctx


class _AllreducePlan:
    """Checked Allreduce arguments, reused while the same arrays come back: mpi4py code repeats its calls.

    It holds weak references only, so a plan never keeps a user's array alive; on a hit the flat views
    are rebuilt (the arrays' shape, strides, dtype and writability must be unchanged).
    """

    __slots__ = ("send", "recv", "meta", "op", "sig", "dtype", "algo", "algo_for", "compiled", "fast")

    def __init__(self, sendbuf: Any, recvbuf: np.ndarray, call: Call, sig: Sig) -> None:
        self.send = None if sendbuf is IN_PLACE else weakref.ref(sendbuf)
        self.recv = weakref.ref(recvbuf)
        self.meta = self.describe(sendbuf, recvbuf)
        self.op, self.sig, self.dtype = call.op, sig, call.dtype
        self.algo: Any = None  # the algorithm selected for it, valid while ``algo_for`` holds
        self.algo_for: tuple = ()
        self.compiled: Any = None  # arena_jit.Prepared: the compiled path's arguments
        self.fast: Any = None  # _PipeFast: the inline staged path's arguments

    @staticmethod
    def describe(sendbuf: Any, recvbuf: np.ndarray) -> tuple:
        send = None if sendbuf is IN_PLACE else (sendbuf.shape, sendbuf.strides, sendbuf.dtype)
        return (send, recvbuf.shape, recvbuf.strides, recvbuf.dtype, recvbuf.flags.writeable)

    def flat(self, sendbuf: Any, recvbuf: np.ndarray) -> Optional[tuple[np.ndarray, np.ndarray]]:
        """Flat (send, recv) views of these arrays, or None if they are not the ones planned for (or changed)."""
        if self.recv() is not recvbuf or (self.send is None) != (sendbuf is IN_PLACE):
            return None
        if self.send is not None and self.send() is not sendbuf:
            return None
        if self.describe(sendbuf, recvbuf) != self.meta:
            return None
        recv = recvbuf if recvbuf.ndim == 1 else recvbuf.reshape(-1, order="A")
        if self.send is None:
            return recv, recv
        return (sendbuf if sendbuf.ndim == 1 else sendbuf.reshape(-1, order="A")), recv

    def call(self, sendbuf: Any, recvbuf: np.ndarray) -> Optional[Call]:
        """The call for these arrays, or None if they are not the ones planned for (or changed)."""
        flat = self.flat(sendbuf, recvbuf)
        if flat is None:
            return None
        return Call("allreduce", self.dtype, flat[0], flat[1], self.op, in_place=self.send is None)


class _BcastPlan:
    """Checked Bcast arguments for one array and root, kept (weakly) for the inline staged path."""

    __slots__ = ("buf", "meta", "call", "sig", "algo", "algo_for", "words", "sig_array")

    def __init__(self, buf: np.ndarray, call: Call, sig: Sig) -> None:
        self.buf = weakref.ref(buf)
        self.meta = self.describe(buf)
        self.call, self.sig = call, sig  # the flat view in ``call`` is rebuilt per hit
        self.algo: Any = None
        self.algo_for: tuple = ()
        self.words = shared.sig_words(sig)
        self.sig_array = arena_jit.sig_array(self.words)

    @staticmethod
    def describe(buf: np.ndarray) -> tuple:
        return (buf.shape, buf.strides, buf.dtype, buf.flags.writeable, buf.flags.c_contiguous)

    def flat(self, buf: Any) -> Optional[np.ndarray]:
        if self.buf() is not buf or self.describe(buf) != self.meta:
            return None
        return buf if buf.ndim == 1 else buf.reshape(-1)


class _PipePlan:
    """Checked arguments of a repeated blocking Reduce_scatter(_block) or Allgather on contiguous NumPy arrays.

    It is found by the arrays' addresses, not their identity, so a fresh view of the same memory (``a[:k]``
    per call, as mpi4py code often passes) still hits; it holds no array and rebuilds the flat views per
    hit. Once the call's algorithm is ``staged`` it also keeps the pipe geometry for the inline path.
    """

    __slots__ = ("meta", "template", "send_len", "sig", "algo", "algo_for", "fast")

    def __init__(self, sendbuf: Any, recvbuf: np.ndarray, call: Call, sig: Sig) -> None:
        self.meta = self.describe(sendbuf, recvbuf)
        self.template = dataclasses.replace(call, send=None, recv=None)  # a plan keeps no user memory alive
        self.send_len = call.send.shape[0] if call.in_place and call.send is not None else -1  # in place: recv's head
        self.sig = sig
        self.algo: Any = None
        self.algo_for: tuple = ()
        self.fast: Any = None  # _PipeFast once the inline path has run it

    @staticmethod
    def describe(sendbuf: Any, recvbuf: np.ndarray) -> tuple:
        send = None if sendbuf is IN_PLACE else (sendbuf.shape, sendbuf.strides, sendbuf.dtype)
        return (send, recvbuf.shape, recvbuf.strides, recvbuf.dtype, recvbuf.flags.writeable)

    def call(self, sendbuf: Any, recvbuf: np.ndarray) -> Optional[Call]:
        """The call for these arrays (found at the planned addresses), or None if their shape or type changed."""
        if self.describe(sendbuf, recvbuf) != self.meta:
            return None
        recv = recvbuf.reshape(-1)
        if sendbuf is not IN_PLACE:
            send: Optional[np.ndarray] = sendbuf.reshape(-1)
        else:
            send = recv[: self.send_len] if self.send_len >= 0 else None
        t = self.template  # a Call built field by field: dataclasses.replace costs microseconds
        return Call(t.coll, t.dtype, send, recv, t.op, t.root, t.counts, t.displs, t.send_counts, t.send_displs, t.in_place)


def _pipe_key(label: str, sendbuf: Any, recvbuf: Any, *extra: Any) -> Optional[tuple]:
    """A ``_PipePlan``'s key: the call and its arrays' addresses, for plain contiguous NumPy arrays (else None).

    The addresses of arrays seen last time come from a memo by identity (an ``__array_interface__`` costs a
    microsecond per array); a fresh view falls through to its address.
    """
    try:
        memo = _KEY_MEMO.get((label, id(sendbuf), id(recvbuf), *extra))
    except TypeError:
        return None
    if memo is not None and memo[1]() is recvbuf and (memo[0] is None or memo[0]() is sendbuf):
        return memo[2]
    key = _address_key(label, sendbuf, recvbuf, *extra)
    if key is not None:
        if len(_KEY_MEMO) >= 32:
            _KEY_MEMO.pop(next(iter(_KEY_MEMO)))
        _KEY_MEMO[(label, id(sendbuf), id(recvbuf), *extra)] = (
            None if sendbuf is IN_PLACE else weakref.ref(sendbuf), weakref.ref(recvbuf), key)
    return key


_KEY_MEMO: dict[tuple, tuple] = {}  # (label, id(send), id(recv), ...) -> (weakref send, weakref recv, address key)


def _address_key(label: str, sendbuf: Any, recvbuf: Any, *extra: Any) -> Optional[tuple]:
    if type(recvbuf) is not np.ndarray or not recvbuf.flags.c_contiguous:
        return None
    if sendbuf is IN_PLACE:
        send = -1
    elif type(sendbuf) is np.ndarray and sendbuf.flags.c_contiguous:
        send = sendbuf.__array_interface__["data"][0]
    else:
        return None
    try:
        key = (label, send, recvbuf.__array_interface__["data"][0], *extra)
        hash(key)
    except TypeError:  # an unhashable op or count: the checks name it
        return None
    return key


class _PipeFast:
    """A staged call's inline arguments on one arena: the pipe geometry and the posted signature words."""

    __slots__ = ("arena", "pipe", "words", "sig_array")

    def __init__(self, arena: Any, pipe: "staged.Pipe", sig: Sig) -> None:
        self.arena, self.pipe = arena, pipe
        self.words = shared.sig_words(sig)
        self.sig_array = arena_jit.sig_array(self.words)


_PLANS = 8  # Allreduce plans kept per communicator
_FAST_SPIN_S = 50e-6  # how long a fast-path Allreduce spins for its peers before it waits as a schedule
ONESHOT = shared.allreduce_oneshot
_PIPE_ALGOS = (staged.reduce_scatter_staged, staged.allgather_staged)


class Comm:
    """An intracommunicator: a group of ranks with its own message contexts and timeout."""

    def __init__(self, runtime: Runtime, world_ranks: list[int], ctx: int, name: str) -> None:
        self._rt = runtime
        self._engine = runtime.engine
        self._world = world_ranks
        self._to_comm = {w: i for i, w in enumerate(world_ranks)}
        self._rank = self._to_comm[runtime.rank]
        self._size = len(world_ranks)
        self._ctx = ctx  # even: point-to-point; ctx | 1: collectives
        self._seq = 0
        self._children = 0
        self._freed = False
        self._aborted: Optional[AbortedError] = None
        self._name = name
        self.timeout: float = runtime.timeout
        self._layout = Layout.from_ids([runtime.peers[w].host_id for w in world_ranks], runtime.ring_of(world_ranks))
        self._arena: Optional[ArenaState] = None
        self._plans: dict[tuple, _AllreducePlan] = {}
        self._last_plan: Any = None  # the plan (_AllreducePlan or _BcastPlan) of the call being scheduled
        self._chosen: Any = None  # the algorithm _stage selected for a device call (run as is, or on its staged twin)
        self._bcast_plans: dict[tuple, _BcastPlan] = {}
        self._pipe_plans: dict[tuple, _PipePlan] = {}
        self._others = [q for q in range(self._size) if q != self._rank]
        # (choice key, Barrier inline on the arena?, its sig, its posted words, those as a kernel argument)
        self._barrier_choice: tuple = ((), False, None, None, None)
        # ranks sharing cores spin only briefly for each other: the rank we wait for may need this core
        self._fast_spin = _FAST_SPIN_S / 25 if self._engine.oversubscribed else _FAST_SPIN_S
        self._compiled = arena_jit.Gate(self._fast_spin)
        if self._size > 1 and self._layout.hosts == 1 and arena_enabled():
            self._arena = ArenaState(os.path.join(SHM_DIR.get(), f"pycoll-{runtime.info.job_id}-arena-{ctx:x}"))
            self._arena.gate = self._compiled
        # device buffers of one host: CUDA IPC buffers, set up by the first device call that selects them
        self._ipc: Optional[IpcState] = IpcState() if self._arena is not None else None

    # ---- identity --------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._size

    def Get_rank(self) -> int:  # noqa: N802
        return self._rank

    def Get_size(self) -> int:  # noqa: N802
        return self._size

    def Get_name(self) -> str:  # noqa: N802
        return self._name

    def Set_name(self, name: str) -> None:  # noqa: N802
        self._name = name

    def Is_inter(self) -> bool:  # noqa: N802
        return False

    def Is_intra(self) -> bool:  # noqa: N802
        return True

    def world_to_comm(self, world_rank: int) -> int:
        """This communicator's rank for a world rank (unchanged if not a member)."""
        return self._to_comm.get(world_rank, world_rank)

    def world_rank(self, rank: int) -> int:
        """The world rank of one of this communicator's ranks."""
        return self._world[rank]

    def __repr__(self) -> str:
        return f"<pycoll.Comm {self._name} rank {self._rank}/{self._size}>"

    # ---- plumbing --------------------------------------------------------------------------
    def _live(self, opname: str) -> None:
        if self._freed:
            raise InvalidArgumentError("the communicator was freed", op=opname, rank=self._rank)
        if self._aborted is not None:
            raise AbortedError(f"the communicator was torn down: {self._aborted.cause}", op=opname, rank=self._rank)
        err = self._engine.broken(self._ctx)
        if err is not None:
            from .errors import CommunicatorBrokenError, CommunicatorLostError, PeerFailureError, RemoteError

            op = f"{opname} #{self._seq + 1}"
            self._engine.flush(1.0, delivered=True)  # reports this rank passes on leave before it raises (and perhaps exits)
            if isinstance(err, RemoteError) and self._engine.broken_since(self._ctx) == self._seq + 1:
                self._seq += 1  # the failure was in this very call (a peer found it first): report it as such
                raise type(err)(err.cause, op=f"{opname} #{self._seq}", rank=self._rank, peers=err.peers)
            if isinstance(err, PeerFailureError) and err.peers:  # a death: name the dead rank, as its witnesses do
                dead = ", ".join(map(str, err.peers))
                raise CommunicatorLostError(f"rank {dead} failed earlier ({err.cause})", op=op, rank=self._rank, peers=err.peers)
            raise CommunicatorBrokenError(f"an earlier failure broke this communicator: {err}", op=op, rank=self._rank)

    def _owner(self, opname: str, ctx: int, tag: int = -1) -> Owner:
        return Owner(opname, ctx, self._rank, self._to_comm.__getitem__, self._world, _describe, tag)

    def _check_root(self, root: int, opname: str) -> int:
        if not isinstance(root, (int, np.integer)) or not 0 <= root < self._size:
            raise InvalidArgumentError(f"root {root!r} is not a rank of this {self._size}-rank communicator", op=opname, rank=self._rank)
        return int(root)

    def _check_op(self, op: Any, dtype: np.dtype, opname: str) -> Op:
        try:
            resolved = _ops.resolve(op)
        except TypeError as exc:
            raise InvalidArgumentError(str(exc), op=opname, rank=self._rank) from None
        reason = resolved.check(dtype)
        if reason:
            raise InvalidArgumentError(reason, op=opname, rank=self._rank)
        return resolved

    def _sig(self, call: Call, count: int = 0, vhash: int = 0, op: Optional[Op] = None) -> Sig:
        code = datatypes.from_numpy(call.dtype).code if call.coll != "barrier" else 0
        return Sig(_KINDS[call.coll], code, op.code if op else 0, call.root, count, vhash)

    def _steps(self, label: str, sig: Sig) -> tuple[Steps, Owner]:
        """The verbs and owner of the call numbered ``self._seq``."""
        owner = self._owner(f"{label} #{self._seq}", self._ctx | 1, self._seq)
        owner.sig = sig
        steps = Steps(
            self._engine, self._rank, self._size, self._world, self._ctx | 1, self._seq, sig, owner, backend("host"),
            self._layout, self._arena, self._ipc,
        )
        return steps, owner

    def _schedule(self, label: str, call: Call, sig: Sig) -> Schedule:
        """Number the call, pick the algorithm and start it."""
        chosen, self._chosen = self._chosen, None
        self._live(label)
        self._seq += 1
        steps, owner = self._steps(label, sig)
        algo = chosen if chosen is not None else select(call, self._layout)
        if self._last_plan is not None:  # remember the choice for the fast path
            self._last_plan.algo = algo.run
            self._last_plan.algo_for = self._choice_key()
            self._last_plan = None
        gen = algo.run(steps, call)
        if CHECK_CALLS.get() and self._size > 1:
            gen = self._checked(steps, sig, gen)
        return self._engine.start(Schedule(gen, owner))

    @staticmethod
    def _checked(steps: Steps, sig: Sig, gen):
        yield from verify_call(steps, sig, _describe)
        yield from gen

    def _finish(self, sched: Schedule) -> None:
        self._engine.wait_schedule(sched, self.timeout)
        if sched.error is not None:
            self._failed(sched)
            raise sched.error

    def _failed(self, sched: Schedule) -> None:
        """After a call failed here: tell the peers; if a peer only skipped it, free its arena number."""
        assert sched.error is not None
        if getattr(sched.error, "contained", False) and self._arena is not None:
            self._arena.give_back(sched.owner.tag)
        self._engine.abort(sched.owner, sched.error)

    def _resolve(self, label: str, build: Callable[..., tuple[Call, Sig]], args: tuple, stream: Any = None
                 ) -> tuple[Call, Sig, Any]:
        """Check the arguments; if they are wrong here, tell the peers so that they do not wait for us.

        A call on device buffers comes back as its host twin, with the ``Staged`` copy that holds it (else None).
        """
        self._live(label)
        self._chosen = None
        try:
            call, sig = build(*args)
            call, stage = self._stage(call, stream, label)
            return call, sig, stage
        except InvalidArgumentError as err:
            self._seq += 1  # every rank consumes this call's number, so the next call still lines up
            owner = self._owner(f"{label} #{self._seq}", self._ctx | 1, self._seq)
            self._engine.notify_skip(owner, err)
            raise InvalidArgumentError(err.cause, op=owner.op, rank=self._rank, peers=err.peers) from None

    def _stage(self, call: Call, stream: Any, label: str) -> tuple[Call, Any]:
        """(the call to schedule, its Staged device copy or None): device buffers are copied to pinned host memory."""
        mem = {buffers.memory_of(a) for a in (call.send, call.recv) if a is not None}
        if mem != {"cuda"}:
            if len(mem) > 1:
                where = "on the device" if buffers.memory_of(call.send) == "cuda" else "in host memory"
                raise InvalidArgumentError(
                    f"sendbuf is {where} and recvbuf is not: pass both on the device (as NCCL requires) or both on "
                    "the host", op=label, rank=self._rank)
            return call, None
        chosen = None
        if call.coll == "allreduce" and self._ipc is not None:  # an algorithm on device buffers (CUDA IPC) if selected
            device_call = dataclasses.replace(call, stream=stream)
            chosen = select(device_call, self._layout)  # a host algorithm's cost includes the staging
            if chosen.memory == "cuda":
                self._chosen = chosen
                return device_call, None
        try:
            from .cuda.memory import Staged

            staged_call = Staged(call, self._rank, stream)
        except InvalidArgumentError:
            raise
        except Exception as exc:  # noqa: BLE001 - no numba.cuda, no device, a bad stream: tell the peers too
            raise InvalidArgumentError(f"could not stage the device buffers ({type(exc).__name__}: {exc})", op=label,
                                       rank=self._rank) from None
        self._chosen = chosen  # the staged twin runs the host algorithm chosen for the device call
        return staged_call.call, staged_call

    def _run(self, label: str, build: Callable[..., tuple[Call, Sig]], *args: Any, stream: Any = None) -> None:
        call, sig, stage = self._resolve(label, build, args, stream)
        if stage is None:
            self._finish(self._schedule(label, call, sig))
            return
        try:
            self._finish(self._schedule(label, call, sig))
        except BaseException:
            stage.discard()
            raise
        stage.finish()

    def _start(self, label: str, build: Callable[..., tuple[Call, Sig]], *args: Any, stream: Any = None) -> Request:
        call, sig, stage = self._resolve(label, build, args, stream)
        try:
            sched = self._schedule(label, call, sig)
        except BaseException:
            if stage is not None:
                stage.discard()
            raise
        return Request(self._engine, self, schedule=sched, after=stage)

    # ---- argument resolution -----------------------------------------------------------------
    def _recv(self, spec: Any, opname: str, blocks: int = 1) -> Buf:
        if spec is IN_PLACE:
            raise InvalidArgumentError("MPI.IN_PLACE is not allowed as the receive buffer here", op=opname, rank=self._rank)
        return buffers.parse(spec, "recvbuf", opname, writable=True, blocks=blocks)

    def _send(self, spec: Any, opname: str, blocks: int = 1) -> Buf:
        if spec is IN_PLACE:
            raise InvalidArgumentError("MPI.IN_PLACE is not allowed as the send buffer here", op=opname, rank=self._rank)
        return buffers.parse(spec, "sendbuf", opname, blocks=blocks)

    def _per_rank(self, spec: Any, what: str, opname: str, vector: bool, writable: bool) -> VBuf:
        """One block per rank: ``[buf, counts, displs]`` if vector, else ``len // size`` (or the spec's count) each."""
        if vector:
            return buffers.parse_vector(spec, what, opname, self._size, writable=writable)
        if spec is IN_PLACE:
            raise InvalidArgumentError(f"MPI.IN_PLACE is not allowed as {what} here", op=opname, rank=self._rank)
        b = buffers.parse(spec, what, opname, writable=writable, blocks=self._size)
        each = b.count // self._size
        return VBuf(b.array, b.dtype, [each] * self._size, [i * each for i in range(self._size)])

    def _same_type(self, a: np.dtype, b: np.dtype, opname: str) -> None:
        if a != b:
            raise InvalidArgumentError(f"sendbuf holds {a.name} but recvbuf holds {b.name}", op=opname, rank=self._rank)

    def _distinct(self, send: np.ndarray, recv: np.ndarray, opname: str) -> None:
        if buffers.overlaps(send, recv):
            raise InvalidArgumentError("sendbuf and recvbuf overlap; pass MPI.IN_PLACE instead", op=opname, rank=self._rank)

    def _whole(self, count: int, parts: int, what: str, opname: str) -> int:
        if count % parts:
            raise InvalidArgumentError(f"{what} has {count} elements, not a multiple of {parts} ranks", op=opname, rank=self._rank)
        return count // parts

    # ---- reductions ----------------------------------------------------------------------------
    def _allreduce_call(self, sendbuf: Any, recvbuf: Any, op: Any) -> tuple[Call, Sig]:
        name = "Allreduce"
        recv = self._recv(recvbuf, name)
        if sendbuf is IN_PLACE:
            send = recv
        else:
            send = self._send(sendbuf, name)
            self._same_type(send.dtype, recv.dtype, name)
            if send.count != recv.count:
                raise InvalidArgumentError(f"sendbuf has {send.count} elements, recvbuf {recv.count}", op=name, rank=self._rank)
            self._distinct(send.array, recv.array, name)
        o = self._check_op(op, recv.dtype, name)
        call = Call("allreduce", recv.dtype, send.array, recv.array, o, in_place=sendbuf is IN_PLACE)
        return call, self._sig(call, recv.count, op=o)

    def _allreduce_planned(self, sendbuf: Any, recvbuf: Any, op: Any) -> tuple[Call, Sig]:
        """``_allreduce_call`` with its result cached per (sendbuf, recvbuf, op) for plain NumPy arrays."""
        if type(recvbuf) is not np.ndarray or not (sendbuf is IN_PLACE or type(sendbuf) is np.ndarray):
            return self._allreduce_call(sendbuf, recvbuf, op)
        try:
            key = (id(sendbuf), id(recvbuf), op)
            plan = self._plans.get(key)
        except TypeError:  # an unhashable op: let the checks name it
            return self._allreduce_call(sendbuf, recvbuf, op)
        if plan is not None:
            call = plan.call(sendbuf, recvbuf)
            if call is not None:
                self._last_plan = plan
                return call, plan.sig
        call, sig = self._allreduce_call(sendbuf, recvbuf, op)
        if len(self._plans) >= _PLANS:
            self._plans.pop(next(iter(self._plans)))
        self._plans[key] = self._last_plan = _AllreducePlan(sendbuf, recvbuf, call, sig)
        return call, sig

    def Allreduce(self, sendbuf: Any, recvbuf: Any, op: Any = _ops.SUM, *, stream: Any = None) -> None:  # noqa: N802
        if self._arena is not None and self._arena.status == "ready" and self._allreduce_fast(sendbuf, recvbuf, op):
            return
        self._run("Allreduce", self._allreduce_planned, sendbuf, recvbuf, op, stream=stream)

    def _allreduce_fast(self, sendbuf: Any, recvbuf: Any, op: Any) -> bool:
        """A repeated Allreduce whose plan chose oneshot or staged, run inline; False (nothing done) otherwise."""
        try:
            plan = self._plans.get((id(sendbuf), id(recvbuf), op))
        except TypeError:  # an unhashable op: let the checks name it
            return False
        if plan is None or plan.algo_for != self._choice_key():
            return False
        if plan.algo is ONESHOT:
            return self._oneshot_fast(plan, sendbuf, recvbuf)
        if plan.algo is staged.allreduce_staged:
            call = plan.call(sendbuf, recvbuf)
            return call is not None and self._pipe_fast("Allreduce", plan, call)
        return False

    def _oneshot_fast(self, plan: _AllreducePlan, sendbuf: Any, recvbuf: Any) -> bool:
        """A repeated small Allreduce on a ready arena, with no schedule (see ``_arena_meeting``).

        Once the communicator has earned the compiled path, the whole meeting is one kernel call.
        """
        arena = self._arena.arena  # type: ignore[union-attr]
        flat = plan.flat(sendbuf, recvbuf)
        if flat is None or arena is None or flat[1].nbytes > arena.slot_bytes:
            return False
        send, recv = flat
        sig = plan.sig
        prep = plan.compiled
        kern = self._compiled.open() if prep is None or prep.ok else None
        if kern is not None and (prep is None or prep.arena is not arena):
            prep = plan.compiled = arena_jit.Prepared(arena, sig, plan.op, plan.dtype, recv.size)
        if kern is not None and prep.ok:
            rank = self._rank

            def attempt(a: Any, opno: int) -> Optional[tuple]:
                slots, bases = prep.views[opno & 1]
                prep.sig[3] = fold_seq(prep.words[3], a.seq)
                status = kern.allreduce(a.u64, slots, send, recv, rank, bases, prep.sig, opno, prep.code, self._compiled.polls)
                return None if arena_jit.finished(a, opno, status, self._compiled) else prep.words
        else:
            call = Call("allreduce", plan.dtype, send, recv, plan.op, in_place=send is recv)

            def attempt(a: Any, opno: int) -> Optional[tuple]:
                return self._spin_meeting(a, opno, shared.oneshot_post(a, opno, call, sig), lambda: shared.oneshot_reduce(a, opno, call))

        def rest(st: Steps, a: Any, opno: int, mine: tuple) -> Schedule:
            call = Call("allreduce", plan.dtype, send, recv, plan.op, in_place=send is recv)
            return shared.oneshot_rest(st, a, opno, call, mine)

        return self._arena_meeting("Allreduce", sig, attempt, rest)

    def _pipe_fast(self, label: str, plan: Any, call: Call) -> bool:
        """A repeated call whose plan chose a pipelined ``staged`` algorithm, run inline by one kernel call
        (meeting, every chunk, close) when the peers keep up (see ``_arena_meeting``); False (nothing done)
        where the kernel does not cover the call."""
        arena = self._arena.arena  # type: ignore[union-attr]
        if arena is None or not arena.stage_bytes:
            return False
        fast = plan.fast
        if fast is None or fast.arena is not arena:
            fast = plan.fast = _PipeFast(arena, staged.Pipe(arena, call, self._rank), plan.sig)
        pipe = fast.pipe
        kern = self._compiled.kernels  # open (the schedule path counts the calls that open it)
        if not kern or not pipe.covered:
            return False
        if not pipe.kernel:  # planned before the gate opened
            pipe = fast.pipe = staged.Pipe(arena, call, self._rank)
        send, recv = pipe.views(call)
        gate, rank = self._compiled, self._rank
        polls = min(gate.polls, pipe.polls)
        resume: list = [False, 0]

        def attempt(a: Any, opno: int) -> Optional[tuple]:
            base = a.rounds
            fast.sig_array[3] = fold_seq(fast.words[3], a.seq)
            status, j, met = kern.blocks(a.u64, pipe.stages, send, recv, pipe.sd, pipe.rd, pipe.counts, rank, gate.bases(a, opno),
                                         fast.sig_array, opno, pipe.mode, pipe.code, pipe.local, base, pipe.c, pipe.nslots, polls)
            if arena_jit.finished(a, opno, status, gate):
                a.rounds = base + pipe.nchunks
                return None
            resume[:] = [met, j]
            return fast.words

        def rest(st: Steps, a: Any, opno: int, mine: tuple) -> Schedule:
            return staged.pipe_rest(st, a, opno, mine, pipe, call, resume[0], resume[1])

        return self._arena_meeting(label, plan.sig, attempt, rest)

    def _pipe_planned(self, key: Optional[tuple], build: Callable[..., tuple[Call, Sig]], sendbuf: Any, recvbuf: Any,
                      *args: Any) -> tuple[Call, Sig]:
        """``build(sendbuf, recvbuf, *args)``, its result kept as a ``_PipePlan`` under ``key`` (None: not plannable)."""
        if key is None or self._arena is None:
            return build(sendbuf, recvbuf, *args)
        plan = self._pipe_plans.get(key)
        if plan is not None:
            call = plan.call(sendbuf, recvbuf)
            if call is not None:
                self._last_plan = plan
                return call, plan.sig
        call, sig = build(sendbuf, recvbuf, *args)
        if len(self._pipe_plans) >= _PLANS:
            self._pipe_plans.pop(next(iter(self._pipe_plans)))
        self._pipe_plans[key] = self._last_plan = _PipePlan(sendbuf, recvbuf, call, sig)
        return call, sig

    def _planned_fast(self, label: str, key: Optional[tuple], sendbuf: Any, recvbuf: Any) -> bool:
        """A repeated Reduce_scatter(_block) or Allgather whose plan chose ``staged``, run inline; False otherwise."""
        if key is None or self._arena is None or self._arena.status != "ready":
            return False
        plan = self._pipe_plans.get(key)
        if plan is None or plan.algo_for != self._choice_key() or plan.algo not in _PIPE_ALGOS:
            return False
        call = plan.call(sendbuf, recvbuf)
        return call is not None and self._pipe_fast(label, plan, call)

    def _choice_key(self) -> tuple:
        """What an algorithm choice depends on besides the call: a cached choice holds while this is unchanged."""
        return (ALGO.get(), id(cost_model.current()), CHECK_CALLS.get())

    def _spin_meeting(self, arena: Any, opno: int, mine: tuple, finish: Callable[[], None]) -> Optional[tuple]:
        """After posting ``mine``: spin briefly for the peers; if all came with the same call, ``finish`` and
        mark done (None), else return ``mine`` for the schedule that waits with timeouts."""
        others = self._others
        spin_until = time.perf_counter() + self._fast_spin
        while arena.waiting_for("post", opno, others):
            if time.perf_counter() > spin_until:
                return mine
        posted = (mine[0], mine[1], mine[2], fold_seq(mine[3], arena.seq))
        if any(arena.peer_sig(q, opno) != posted for q in others) or arena.posted_by_others(opno, others):
            return mine
        try:
            finish()
        finally:
            arena.set_done(opno)
        return None

    def _arena_meeting(self, label: str, sig: Sig, attempt: Callable, rest: Callable) -> bool:
        """A one-meeting arena call run inline: ``attempt`` posts, spins briefly for the peers and finishes.

        False (nothing done) while an earlier nonblocking arena call is unfinished. If ``attempt`` returns
        the posted words instead (the peers did not post within the spin, or posted another call), ``rest``
        runs as an ordinary schedule, with its timeouts, liveness checks and error reports.
        """
        state = self._arena
        arena = state.arena  # type: ignore[union-attr]
        if arena is None or arena.finished != state.ops:  # type: ignore[union-attr]
            return False
        self._live(label)
        self._seq += 1
        state.ops += 1  # type: ignore[union-attr]
        opno = arena.ops = state.ops  # type: ignore[union-attr]
        state.last = (self._seq, opno)  # type: ignore[union-attr]
        arena.seq = self._seq  # posts carry the call number (Python writes it; kernels write the rest)
        arena.mark_seq(opno)
        mine = attempt(arena, opno)
        if mine is None:
            return True
        steps, owner = self._steps(label, sig)
        self._finish(self._engine.start(Schedule(rest(steps, arena, opno, mine), owner)))
        return True

    def Iallreduce(self, sendbuf: Any, recvbuf: Any, op: Any = _ops.SUM, *, stream: Any = None) -> Request:  # noqa: N802
        return self._start("Iallreduce", self._allreduce_planned, sendbuf, recvbuf, op, stream=stream)

    def _reduce_call(self, sendbuf: Any, recvbuf: Any, op: Any, root: int) -> tuple[Call, Sig]:
        name = "Reduce"
        root = self._check_root(root, name)
        at_root = self._rank == root
        if sendbuf is IN_PLACE:
            if not at_root:
                raise InvalidArgumentError("MPI.IN_PLACE is only allowed at the root", op=name, rank=self._rank)
            recv = self._recv(recvbuf, name)
            send = recv
        else:
            send = self._send(sendbuf, name)
            recv = self._recv(recvbuf, name) if at_root else None
            if recv is not None:
                self._same_type(send.dtype, recv.dtype, name)
                if recv.count != send.count:
                    raise InvalidArgumentError(f"sendbuf has {send.count} elements, recvbuf {recv.count}", op=name, rank=self._rank)
                self._distinct(send.array, recv.array, name)
        o = self._check_op(op, send.dtype, name)
        call = Call("reduce", send.dtype, send.array, recv.array if recv else None, o, root=root, in_place=sendbuf is IN_PLACE)
        return call, self._sig(call, send.count, op=o)

    def Reduce(self, sendbuf: Any, recvbuf: Any, op: Any = _ops.SUM, root: int = 0, *, stream: Any = None) -> None:  # noqa: N802
        self._run("Reduce", self._reduce_call, sendbuf, recvbuf, op, root, stream=stream)

    def Ireduce(self, sendbuf: Any, recvbuf: Any, op: Any = _ops.SUM, root: int = 0, *, stream: Any = None) -> Request:  # noqa: N802
        return self._start("Ireduce", self._reduce_call, sendbuf, recvbuf, op, root, stream=stream)

    def _reduce_scatter_call(
        self, sendbuf: Any, recvbuf: Any, recvcounts: Optional[Sequence[int]], op: Any, name: str
    ) -> tuple[Call, Sig]:
        recv = self._recv(recvbuf, name)
        if recvcounts is None:  # Reduce_scatter_block: every rank gets recvbuf's count
            if sendbuf is IN_PLACE:
                each = self._whole(recv.count, self._size, "recvbuf (in place)", name)
            else:
                each = recv.count
            counts = [each] * self._size
        else:
            try:
                items = list(recvcounts)
            except TypeError:
                raise InvalidArgumentError(f"recvcounts must be a sequence of integers, got {recvcounts!r}", op=name, rank=self._rank) from None
            if not all(isinstance(c, (int, np.integer)) and not isinstance(c, bool) for c in items):  # int() takes 2.5, "3"
                raise InvalidArgumentError(f"recvcounts must be integers, got {items!r}", op=name, rank=self._rank)
            counts = [int(c) for c in items]
            if len(counts) != self._size or min(counts, default=0) < 0:
                raise InvalidArgumentError(
                    f"recvcounts needs {self._size} non-negative entries, got {list(counts)}", op=name, rank=self._rank
                )
        total = sum(counts)
        if sendbuf is IN_PLACE:
            if recv.count < total:
                raise InvalidArgumentError(f"in place, recvbuf needs {total} elements, has {recv.count}", op=name, rank=self._rank)
            send_arr = recv.array[:total]
        else:
            send = self._send(sendbuf, name, blocks=self._size if recvcounts is None else 1)
            self._same_type(send.dtype, recv.dtype, name)
            if send.count != total:
                raise InvalidArgumentError(f"sendbuf needs {total} elements (sum of recvcounts), has {send.count}", op=name, rank=self._rank)
            if recv.count < counts[self._rank]:
                raise InvalidArgumentError(f"recvbuf needs {counts[self._rank]} elements, has {recv.count}", op=name, rank=self._rank)
            self._distinct(send.array, recv.array, name)
            send_arr = send.array
        o = self._check_op(op, recv.dtype, name)
        call = Call("reduce_scatter", recv.dtype, send_arr, recv.array, o, counts=counts, in_place=sendbuf is IN_PLACE)
        return call, self._sig(call, total, _vhash(counts), op=o)

    def Reduce_scatter_block(self, sendbuf: Any, recvbuf: Any, op: Any = _ops.SUM, *, stream: Any = None) -> None:  # noqa: N802
        key = _pipe_key("Reduce_scatter_block", sendbuf, recvbuf, op)
        if self._planned_fast("Reduce_scatter_block", key, sendbuf, recvbuf):
            return
        self._run("Reduce_scatter_block", self._pipe_planned, key, self._reduce_scatter_call, sendbuf, recvbuf, None, op,
                  "Reduce_scatter_block", stream=stream)

    def Ireduce_scatter_block(self, sendbuf: Any, recvbuf: Any, op: Any = _ops.SUM, *, stream: Any = None) -> Request:  # noqa: N802
        return self._start("Ireduce_scatter_block", self._reduce_scatter_call, sendbuf, recvbuf, None, op, "Ireduce_scatter_block", stream=stream)

    def Reduce_scatter(  # noqa: N802
        self, sendbuf: Any, recvbuf: Any, recvcounts: Optional[Sequence[int]] = None, op: Any = _ops.SUM
    , *, stream: Any = None) -> None:
        if recvcounts is None:
            recvcounts = self._gather_counts(recvbuf, "Reduce_scatter")
        try:
            counts = tuple(recvcounts)
        except TypeError:  # not a sequence: the checks name it
            counts = None
        key = _pipe_key("Reduce_scatter", sendbuf, recvbuf, op, counts) if counts is not None else None
        if self._planned_fast("Reduce_scatter", key, sendbuf, recvbuf):
            return
        self._run("Reduce_scatter", self._pipe_planned, key, self._reduce_scatter_call, sendbuf, recvbuf, recvcounts, op,
                  "Reduce_scatter", stream=stream)

    def Ireduce_scatter(  # noqa: N802
        self, sendbuf: Any, recvbuf: Any, recvcounts: Optional[Sequence[int]] = None, op: Any = _ops.SUM
    , *, stream: Any = None) -> Request:
        if recvcounts is None:
            recvcounts = self._gather_counts(recvbuf, "Ireduce_scatter")
        return self._start("Ireduce_scatter", self._reduce_scatter_call, sendbuf, recvbuf, recvcounts, op, "Ireduce_scatter", stream=stream)

    def _gather_counts(self, recvbuf: Any, name: str) -> list[int]:
        """Without recvcounts, each rank's recvbuf size is its count (one extra allgather)."""
        try:
            mine = self._recv(recvbuf, name).count
        except InvalidArgumentError:
            mine = 0  # the call itself will reject the buffer and tell the peers
        counts = np.empty(self._size, np.int64)
        self.Allgather(np.array([mine], np.int64), counts)
        return [int(c) for c in counts]

    # ---- data movement -------------------------------------------------------------------------
    def _bcast_call(self, buf: Any, root: int) -> tuple[Call, Sig]:
        name = "Bcast"
        root = self._check_root(root, name)
        b = buffers.parse(buf, "buf", name, writable=self._rank != root)
        call = Call("broadcast", b.dtype, recv=b.array, root=root)
        return call, self._sig(call, b.count)

    def _bcast_planned(self, buf: Any, root: Any) -> tuple[Call, Sig]:
        """``_bcast_call``, remembered per (array, root) for contiguous NumPy arrays, so that the choice of
        algorithm can be reused by the inline path."""
        call, sig = self._bcast_call(buf, root)
        if type(buf) is np.ndarray and buf.flags.c_contiguous and self._arena is not None:
            if len(self._bcast_plans) >= _PLANS:
                self._bcast_plans.pop(next(iter(self._bcast_plans)))
            self._bcast_plans[(id(buf), call.root)] = self._last_plan = _BcastPlan(buf, call, sig)
        return call, sig

    def Bcast(self, buf: Any, root: int = 0, *, stream: Any = None) -> None:  # noqa: N802
        if self._arena is not None and self._arena.status == "ready" and self._bcast_fast(buf, root):
            return
        self._run("Bcast", self._bcast_planned, buf, root, stream=stream)

    def _bcast_fast(self, buf: Any, root: Any) -> bool:
        """A repeated Bcast whose plan chose ``broadcast:staged``, run inline by one kernel call when the
        peers keep up (see ``_arena_meeting``); False (nothing done) otherwise."""
        try:
            plan = self._bcast_plans.get((id(buf), root))
        except TypeError:
            return False
        if plan is None or plan.algo is not shared.broadcast_staged or plan.algo_for != self._choice_key():
            return False
        flat = plan.flat(buf)
        state = self._arena
        arena = state.arena  # type: ignore[union-attr]
        if flat is None or arena is None or not arena.stage_bytes:
            return False
        kern = self._compiled.open()
        if kern is None:
            return False
        call = Call("broadcast", plan.call.dtype, recv=flat, root=plan.call.root)
        gate, rank, data = self._compiled, self._rank, flat.view(np.uint8)
        chunk, nslots, _ = shared.pipe_shape(arena, data.nbytes)
        resume: list = [False, 0]

        def attempt(a: Any, opno: int) -> Optional[tuple]:
            base = a.rounds
            plan.sig_array[3] = fold_seq(plan.words[3], a.seq)
            status, j, met = kern.broadcast(a.u64, a.stage(call.root), data, rank, gate.bases(a, opno), plan.sig_array,
                                            opno, call.root, base, chunk, nslots, gate.polls)
            if arena_jit.finished(a, opno, status, gate):
                a.rounds = base + j
                return None
            resume[:] = [met, j]
            return plan.words

        def rest(st: Steps, a: Any, opno: int, mine: tuple) -> Schedule:
            return shared.broadcast_staged_rest(st, a, opno, mine, call, resume[0], resume[1])

        return self._arena_meeting("Bcast", plan.sig, attempt, rest)

    def Ibcast(self, buf: Any, root: int = 0, *, stream: Any = None) -> Request:  # noqa: N802
        return self._start("Ibcast", self._bcast_call, buf, root, stream=stream)

    def _allgather_call(self, sendbuf: Any, recvbuf: Any, vector: bool) -> tuple[Call, Sig]:
        name = "Allgatherv" if vector else "Allgather"
        rv = self._per_rank(recvbuf, "recvbuf", name, vector, writable=True)
        mine = rv.counts[self._rank]
        send_arr = None
        if sendbuf is not IN_PLACE:
            s = self._send(sendbuf, name)
            self._same_type(s.dtype, rv.dtype, name)
            if s.count != mine:
                raise InvalidArgumentError(f"sendbuf has {s.count} elements, recvbuf expects {mine} from this rank", op=name, rank=self._rank)
            self._distinct(s.array, rv.array, name)
            send_arr = s.array
        call = Call("allgather", rv.dtype, send_arr, rv.array, counts=rv.counts, displs=rv.displs, in_place=sendbuf is IN_PLACE)
        return call, self._sig(call, sum(rv.counts), _vhash(rv.counts) if vector else 0)

    def Allgather(self, sendbuf: Any, recvbuf: Any, *, stream: Any = None) -> None:  # noqa: N802
        key = _pipe_key("Allgather", sendbuf, recvbuf)
        if self._planned_fast("Allgather", key, sendbuf, recvbuf):
            return
        self._run("Allgather", self._pipe_planned, key, self._allgather_call, sendbuf, recvbuf, False, stream=stream)

    def Iallgather(self, sendbuf: Any, recvbuf: Any, *, stream: Any = None) -> Request:  # noqa: N802
        return self._start("Iallgather", self._allgather_call, sendbuf, recvbuf, False, stream=stream)

    def Allgatherv(self, sendbuf: Any, recvbuf: Any, *, stream: Any = None) -> None:  # noqa: N802
        self._run("Allgatherv", self._allgather_call, sendbuf, recvbuf, True, stream=stream)

    def Iallgatherv(self, sendbuf: Any, recvbuf: Any, *, stream: Any = None) -> Request:  # noqa: N802
        return self._start("Iallgatherv", self._allgather_call, sendbuf, recvbuf, True, stream=stream)

    def _gather_call(self, sendbuf: Any, recvbuf: Any, root: int, vector: bool) -> tuple[Call, Sig]:
        name = "Gatherv" if vector else "Gather"
        root = self._check_root(root, name)
        at_root = self._rank == root
        if sendbuf is IN_PLACE and not at_root:
            raise InvalidArgumentError("MPI.IN_PLACE is only allowed at the root", op=name, rank=self._rank)
        send = None if sendbuf is IN_PLACE else self._send(sendbuf, name)
        recv_arr, counts, displs = None, [], []
        dtype = send.dtype if send is not None else None
        if at_root:
            rv = self._per_rank(recvbuf, "recvbuf", name, vector, writable=True)
            recv_arr, counts, displs, dtype = rv.array, rv.counts, rv.displs, rv.dtype
            if send is not None:
                self._same_type(send.dtype, rv.dtype, name)
                if send.count != counts[root]:
                    raise InvalidArgumentError(f"sendbuf has {send.count} elements, recvbuf expects {counts[root]}", op=name, rank=self._rank)
                self._distinct(send.array, rv.array, name)
        assert dtype is not None
        call = Call(
            "gather", dtype, send.array if send else None, recv_arr, root=root, counts=counts, displs=displs, in_place=send is None
        )
        return call, self._sig(call)

    def Gather(self, sendbuf: Any, recvbuf: Any, root: int = 0, *, stream: Any = None) -> None:  # noqa: N802
        self._run("Gather", self._gather_call, sendbuf, recvbuf, root, False, stream=stream)

    def Igather(self, sendbuf: Any, recvbuf: Any, root: int = 0, *, stream: Any = None) -> Request:  # noqa: N802
        return self._start("Igather", self._gather_call, sendbuf, recvbuf, root, False, stream=stream)

    def Gatherv(self, sendbuf: Any, recvbuf: Any, root: int = 0, *, stream: Any = None) -> None:  # noqa: N802
        self._run("Gatherv", self._gather_call, sendbuf, recvbuf, root, True, stream=stream)

    def Igatherv(self, sendbuf: Any, recvbuf: Any, root: int = 0, *, stream: Any = None) -> Request:  # noqa: N802
        return self._start("Igatherv", self._gather_call, sendbuf, recvbuf, root, True, stream=stream)

    def _scatter_call(self, sendbuf: Any, recvbuf: Any, root: int, vector: bool) -> tuple[Call, Sig]:
        name = "Scatterv" if vector else "Scatter"
        root = self._check_root(root, name)
        at_root = self._rank == root
        if recvbuf is IN_PLACE and not at_root:
            raise InvalidArgumentError("MPI.IN_PLACE is only allowed at the root", op=name, rank=self._rank)
        recv = None if recvbuf is IN_PLACE else buffers.parse(recvbuf, "recvbuf", name, writable=True)
        send_arr, counts, displs = None, [], []
        dtype = recv.dtype if recv is not None else None
        if at_root:
            sv = self._per_rank(sendbuf, "sendbuf", name, vector, writable=False)
            send_arr, counts, displs, dtype = sv.array, sv.counts, sv.displs, sv.dtype
            if recv is not None:
                self._same_type(sv.dtype, recv.dtype, name)
                if recv.count != counts[root]:
                    raise InvalidArgumentError(f"recvbuf has {recv.count} elements, sendbuf gives {counts[root]}", op=name, rank=self._rank)
                self._distinct(sv.array, recv.array, name)
        assert dtype is not None
        call = Call(
            "scatter", dtype, send_arr, recv.array if recv else None, root=root, counts=counts, displs=displs, in_place=recv is None
        )
        return call, self._sig(call)

    def Scatter(self, sendbuf: Any, recvbuf: Any, root: int = 0, *, stream: Any = None) -> None:  # noqa: N802
        self._run("Scatter", self._scatter_call, sendbuf, recvbuf, root, False, stream=stream)

    def Iscatter(self, sendbuf: Any, recvbuf: Any, root: int = 0, *, stream: Any = None) -> Request:  # noqa: N802
        return self._start("Iscatter", self._scatter_call, sendbuf, recvbuf, root, False, stream=stream)

    def Scatterv(self, sendbuf: Any, recvbuf: Any, root: int = 0, *, stream: Any = None) -> None:  # noqa: N802
        self._run("Scatterv", self._scatter_call, sendbuf, recvbuf, root, True, stream=stream)

    def Iscatterv(self, sendbuf: Any, recvbuf: Any, root: int = 0, *, stream: Any = None) -> Request:  # noqa: N802
        return self._start("Iscatterv", self._scatter_call, sendbuf, recvbuf, root, True, stream=stream)

    def _alltoall_call(self, sendbuf: Any, recvbuf: Any, vector: bool) -> tuple[Call, Sig]:
        name = "Alltoallv" if vector else "Alltoall"
        rv = self._per_rank(recvbuf, "recvbuf", name, vector, writable=True)
        sv = rv if sendbuf is IN_PLACE else self._per_rank(sendbuf, "sendbuf", name, vector, writable=False)
        if not vector and sv.counts != rv.counts:
            raise InvalidArgumentError(
                f"sendbuf has {sum(sv.counts)} elements, recvbuf {sum(rv.counts)}", op=name, rank=self._rank
            )
        if sv is not rv:
            self._same_type(sv.dtype, rv.dtype, name)
            self._distinct(sv.array, rv.array, name)
        call = Call(
            "alltoall",
            rv.dtype,
            sv.array,
            rv.array,
            counts=rv.counts,
            displs=rv.displs,
            send_counts=sv.counts,
            send_displs=sv.displs,
            in_place=sendbuf is IN_PLACE,
        )
        return call, self._sig(call, 0 if vector else rv.counts[0])

    def Alltoall(self, sendbuf: Any, recvbuf: Any, *, stream: Any = None) -> None:  # noqa: N802
        self._run("Alltoall", self._alltoall_call, sendbuf, recvbuf, False, stream=stream)

    def Ialltoall(self, sendbuf: Any, recvbuf: Any, *, stream: Any = None) -> Request:  # noqa: N802
        return self._start("Ialltoall", self._alltoall_call, sendbuf, recvbuf, False, stream=stream)

    def Alltoallv(self, sendbuf: Any, recvbuf: Any, *, stream: Any = None) -> None:  # noqa: N802
        self._run("Alltoallv", self._alltoall_call, sendbuf, recvbuf, True, stream=stream)

    def Ialltoallv(self, sendbuf: Any, recvbuf: Any, *, stream: Any = None) -> Request:  # noqa: N802
        return self._start("Ialltoallv", self._alltoall_call, sendbuf, recvbuf, True, stream=stream)

    def _barrier_call(self) -> tuple[Call, Sig]:
        call = Call("barrier", np.dtype(np.uint8))
        return call, self._sig(call)

    def Barrier(self) -> None:  # noqa: N802
        if self._arena is not None and self._arena.status == "ready" and self._barrier_fast():
            return
        self._run("Barrier", self._barrier_call)

    def _barrier_fast(self) -> bool:
        """Barrier through the arena without a schedule, when the selection for barriers is the arena one."""
        key = self._choice_key()
        if self._barrier_choice[0] != key:
            call, sig = self._barrier_call()
            inline = select(call, self._layout).run is shared.barrier_arena and not key[2]
            words = shared.sig_words(sig)
            self._barrier_choice = (key, inline, sig, words, arena_jit.sig_array(words))
        _, inline, sig, words, sig_arr = self._barrier_choice
        if not inline:
            return False
        kern = self._compiled.open()
        if kern is not None:
            gate, rank = self._compiled, self._rank

            def attempt(a: Any, opno: int) -> Optional[tuple]:
                sig_arr[3] = fold_seq(words[3], a.seq)
                status = kern.barrier(a.u64, rank, gate.bases(a, opno), sig_arr, opno, gate.polls)
                return None if arena_jit.finished(a, opno, status, gate) else words
        else:
            def attempt(a: Any, opno: int) -> Optional[tuple]:
                return self._spin_meeting(a, opno, shared.post_call(a, opno, sig), lambda: None)

        return self._arena_meeting("Barrier", sig, attempt, lambda st, a, opno, mine: shared.barrier_rest(st, a, opno, mine))

    def Ibarrier(self) -> Request:  # noqa: N802
        return self._start("Ibarrier", self._barrier_call)

    # ---- point-to-point ------------------------------------------------------------------------
    def _peer(self, peer: int, opname: str, allow_any: bool) -> int:
        if not isinstance(peer, (int, np.integer)):  # before any comparison: an array would compare elementwise
            raise InvalidArgumentError(f"rank {peer!r} is not an integer", op=opname, rank=self._rank)
        if peer == PROC_NULL or (allow_any and peer == ANY_SOURCE):
            return int(peer)
        if not 0 <= peer < self._size:
            raise InvalidArgumentError(f"rank {peer!r} is not in this {self._size}-rank communicator", op=opname, rank=self._rank)
        return self._world[int(peer)]

    def _tag(self, tag: int, opname: str, allow_any: bool) -> int:
        if not isinstance(tag, (int, np.integer)) or (tag < 0 and not (allow_any and tag == ANY_TAG)):
            raise InvalidArgumentError(f"tag {tag!r} must be a non-negative integer", op=opname, rank=self._rank)
        return int(tag)

    def _isend_array(self, arr: np.ndarray, dest: int, tag: int, opname: str) -> Request:
        self._live(opname)
        peer = self._peer(dest, opname, False)
        tag = self._tag(tag, opname, False)
        if peer == PROC_NULL:
            return Request.completed()
        owner = self._owner(f"{opname}(dest={dest}, tag={tag})", self._ctx)
        req = self._engine.isend(peer, arr, self._ctx, tag, P2P_SIG, owner)
        return Request(self._engine, self, p2p=req)

    def _irecv_array(
        self, arr: Optional[np.ndarray], source: int, tag: int, opname: str, finish: Optional[Callable] = None
    ) -> Request:
        self._live(opname)
        peer = self._peer(source, opname, True)
        tag = self._tag(tag, opname, True)
        if peer == PROC_NULL:
            return Request.completed(Status(PROC_NULL, ANY_TAG, 0))
        owner = self._owner(f"{opname}(source={source}, tag={tag})", self._ctx)
        req = self._engine.irecv(peer, arr, self._ctx, tag, None, owner)
        return Request(self._engine, self, p2p=req, finish=finish)

    def _p2p_buf(self, buf: Any, opname: str, writable: bool = False) -> np.ndarray:
        """A host buffer for point-to-point; device buffers are for collectives only in this build."""
        b = buffers.parse(buf, "buf", opname, writable=writable)
        if b.memory != "host":
            raise InvalidArgumentError("point-to-point calls take host buffers only; device buffers work in collectives",
                                       op=opname, rank=self._rank)
        return b.array  # type: ignore[return-value]

    def Isend(self, buf: Any, dest: int, tag: int = 0) -> Request:  # noqa: N802
        return self._isend_array(self._p2p_buf(buf, "Isend"), dest, tag, "Isend")

    def Send(self, buf: Any, dest: int, tag: int = 0) -> None:  # noqa: N802
        self._isend_array(self._p2p_buf(buf, "Send"), dest, tag, "Send").Wait()

    Ssend = Send
    Rsend = Send
    Bsend = Send

    def Irecv(self, buf: Any, source: int = ANY_SOURCE, tag: int = ANY_TAG) -> Request:  # noqa: N802
        return self._irecv_array(self._p2p_buf(buf, "Irecv", writable=True), source, tag, "Irecv")

    def Recv(self, buf: Any, source: int = ANY_SOURCE, tag: int = ANY_TAG, status: Optional[Status] = None) -> None:  # noqa: N802
        self._irecv_array(self._p2p_buf(buf, "Recv", writable=True), source, tag, "Recv").Wait(status)

    def Sendrecv(  # noqa: N802
        self,
        sendbuf: Any,
        dest: int,
        sendtag: int = 0,
        recvbuf: Any = None,
        source: int = ANY_SOURCE,
        recvtag: int = ANY_TAG,
        status: Optional[Status] = None,
    ) -> None:
        rreq = self.Irecv(recvbuf, source, recvtag)
        sreq = self.Isend(sendbuf, dest, sendtag)
        Request.Waitall([rreq, sreq], [status, None] if status is not None else None)

    # ---- Python objects (pickle) ---------------------------------------------------------------
    @staticmethod
    def _dumps(obj: Any) -> np.ndarray:
        return np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), np.uint8)

    @staticmethod
    def _loads(data: np.ndarray) -> Any:
        return pickle.loads(data.tobytes())

    def _allgather_bytes(self, data: np.ndarray) -> list[np.ndarray]:
        sizes = np.empty(self._size, np.int64)
        self.Allgather(np.array([data.size], np.int64), sizes)
        out = np.empty(int(sizes.sum()), np.uint8)
        counts = [int(s) for s in sizes]
        displs = [int(d) for d in np.concatenate(([0], np.cumsum(sizes)[:-1]))]
        self.Allgatherv(data, [out, counts, displs])
        return [out[d : d + c] for c, d in zip(counts, displs)]

    def bcast(self, obj: Any = None, root: int = 0) -> Any:
        root = self._check_root(root, "bcast")
        data = self._dumps(obj) if self._rank == root else None
        size = np.array([data.size if data is not None else 0], np.int64)
        self.Bcast(size, root)
        if data is None:
            data = np.empty(int(size[0]), np.uint8)
        self.Bcast(data, root)
        return obj if self._rank == root else self._loads(data)

    def allgather(self, sendobj: Any) -> list[Any]:
        return [self._loads(b) for b in self._allgather_bytes(self._dumps(sendobj))]

    def allreduce(self, sendobj: Any, op: Any = _ops.SUM) -> Any:
        o = _ops.resolve(op)
        return o.reduce_objects(self.allgather(sendobj))

    def gather(self, sendobj: Any, root: int = 0) -> Optional[list[Any]]:
        root = self._check_root(root, "gather")
        data = self._dumps(sendobj)
        sizes = np.empty(self._size, np.int64) if self._rank == root else None
        self.Gather(np.array([data.size], np.int64), sizes, root)
        if self._rank != root:
            self.Gatherv(data, None, root)
            return None
        assert sizes is not None
        counts = [int(s) for s in sizes]
        out = np.empty(sum(counts), np.uint8)
        displs = [int(d) for d in np.concatenate(([0], np.cumsum(sizes)[:-1]))]
        self.Gatherv(data, [out, counts, displs], root)
        return [self._loads(out[d : d + c]) for c, d in zip(counts, displs)]

    def reduce(self, sendobj: Any, op: Any = _ops.SUM, root: int = 0) -> Any:
        o = _ops.resolve(op)
        values = self.gather(sendobj, root)
        return o.reduce_objects(values) if values is not None else None

    def scatter(self, sendobj: Optional[Sequence[Any]] = None, root: int = 0) -> Any:
        root = self._check_root(root, "scatter")
        size = np.empty(1, np.int64)
        if self._rank == root:
            if sendobj is None or len(sendobj) != self._size:
                raise InvalidArgumentError(f"scatter needs a sequence of {self._size} objects at the root", op="scatter", rank=self._rank)
            parts = [self._dumps(o) for o in sendobj]
            sizes = np.array([p.size for p in parts], np.int64)
            self.Scatter(sizes, size, root)
            self.Scatterv([np.concatenate(parts) if parts else np.empty(0, np.uint8), [int(s) for s in sizes]], np.empty(parts[root].size, np.uint8), root)
            return sendobj[root]
        self.Scatter(None, size, root)
        data = np.empty(int(size[0]), np.uint8)
        self.Scatterv(None, data, root)
        return self._loads(data)

    def alltoall(self, sendobj: Sequence[Any]) -> list[Any]:
        if len(sendobj) != self._size:
            raise InvalidArgumentError(f"alltoall needs a sequence of {self._size} objects", op="alltoall", rank=self._rank)
        parts = [self._dumps(o) for o in sendobj]
        scounts = np.array([p.size for p in parts], np.int64)
        rcounts = np.empty(self._size, np.int64)
        self.Alltoall(scounts, rcounts)
        out = np.empty(int(rcounts.sum()), np.uint8)
        send = np.concatenate(parts) if parts else np.empty(0, np.uint8)
        self.Alltoallv([send, [int(c) for c in scounts]], [out, [int(c) for c in rcounts]])
        displs = np.concatenate(([0], np.cumsum(rcounts)[:-1]))
        return [self._loads(out[int(d) : int(d) + int(c)]) for c, d in zip(rcounts, displs)]

    def barrier(self) -> None:
        self.Barrier()

    def send(self, obj: Any, dest: int, tag: int = 0) -> None:
        self._isend_array(self._dumps(obj), dest, tag, "send").Wait()

    def isend(self, obj: Any, dest: int, tag: int = 0) -> Request:
        return self._isend_array(self._dumps(obj), dest, tag, "isend")

    def recv(self, buf: Any = None, source: int = ANY_SOURCE, tag: int = ANY_TAG, status: Optional[Status] = None) -> Any:
        return self._irecv_array(None, source, tag, "recv", finish=self._loads).wait(status)

    def irecv(self, buf: Any = None, source: int = ANY_SOURCE, tag: int = ANY_TAG) -> Request:
        return self._irecv_array(None, source, tag, "irecv", finish=self._loads)

    def sendrecv(
        self, sendobj: Any, dest: int, sendtag: int = 0, recvbuf: Any = None, source: int = ANY_SOURCE, recvtag: int = ANY_TAG, status: Optional[Status] = None
    ) -> Any:
        rreq = self.irecv(None, source, recvtag)
        self.isend(sendobj, dest, sendtag).Wait()
        return rreq.wait(status)

    # ---- communicator management ---------------------------------------------------------------
    def Split(self, color: int = 0, key: int = 0) -> "Comm":  # noqa: N802
        self._live("Split")
        self._children += 1
        table = self.allgather((int(color), int(key)))
        if color == UNDEFINED or color is None:
            return COMM_NULL  # type: ignore[return-value]
        members = sorted((k, r) for r, (c, k) in enumerate(table) if c == color)
        world = [self._world[r] for _, r in members]
        ctx = _child_ctx(self._ctx, self._children, ("split", int(color)))
        child = Comm(self._rt, world, ctx, f"{self._name}.split({color})")
        child.timeout = self.timeout
        return child

    def Dup(self) -> "Comm":  # noqa: N802
        self._live("Dup")
        self._children += 1
        child = Comm(self._rt, list(self._world), _child_ctx(self._ctx, self._children, "dup"), f"{self._name}.dup")
        child.timeout = self.timeout
        return child

    Clone = Dup

    def Free(self) -> None:  # noqa: N802
        self._live("Free")
        self._freed = True
        self._plans.clear()
        self._bcast_plans.clear()
        if self._arena is not None:
            self._arena.close()
        if self._ipc is not None:
            self._ipc.close()

    def Abort(self, errorcode: int = 1, *, terminate: bool = True) -> None:  # noqa: N802
        """Tear this communicator down, from any thread, without waiting for anyone.

        Calls waiting on it in other threads raise ``AbortedError`` within 50 ms, its peers raise an error
        naming this rank, and later calls on it raise ``AbortedError``. With ``terminate`` (MPI's meaning,
        the default) the process then exits with ``errorcode`` and the launcher stops the others; with
        ``terminate=False`` (NCCL's ncclCommAbort) the process and its other communicators live on.
        """
        err = AbortedError(f"Comm.Abort({errorcode}) was called on rank {self._rank}", op=f"Abort of {self._name}", rank=self._rank)
        self._aborted = err
        if terminate:  # the peers see this process go (closed sockets, exited pid) within their liveness check
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except Exception:  # exiting regardless
                    pass
            os._exit(errorcode)
        if self._size > 1:
            self._engine.request_abort(self._ctx & ~1, err, self._world)


class _NullComm:
    """``MPI.COMM_NULL``: compares equal only to itself; any call on it is an error."""

    def __repr__(self) -> str:
        return "<pycoll.MPI.COMM_NULL>"

    def __bool__(self) -> bool:
        return False

    def __getattr__(self, name: str) -> Any:
        raise InvalidArgumentError(f"{name} called on MPI.COMM_NULL")


COMM_NULL = _NullComm()


def world_comm(runtime: Runtime) -> Comm:
    return Comm(runtime, list(range(runtime.size)), _WORLD_CTX, "MPI_COMM_WORLD")


def group_comm(runtime: Runtime, world_ranks: Sequence[int], key: str) -> Comm:
    """A communicator over ``world_ranks`` built without a collective call: every member passes the same ``key``,
    which names it and keeps its messages apart from every other communicator's."""
    ranks = [int(r) for r in world_ranks]
    return Comm(runtime, ranks, _child_ctx(_WORLD_CTX, -2, (key, tuple(ranks))), key)


def self_comm(runtime: Runtime) -> Comm:
    return Comm(runtime, [runtime.rank], _child_ctx(_WORLD_CTX, -1, ("self", runtime.rank)), "MPI_COMM_SELF")
