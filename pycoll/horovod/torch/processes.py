"""Horovod's process calls on pycoll: init and shutdown, the ranks and sizes (global, local, cross), process
sets with their own engines, and the handles that ``poll`` and ``synchronize`` take."""

from __future__ import annotations

import atexit
import itertools
import threading
from typing import Any, Optional, Sequence, Union

import torch

from ...errors import InvalidArgumentError, NotProvidedError
from ..engine import Engine
from ..loop import Loop
from ..submissions import HorovodError, Request


HorovodInternalError = HorovodError


class ProcessSet:
    """Some ranks of the job, with their own engine (``add_process_set``); ``global_process_set`` is every rank."""

    def __init__(self, ranks: Optional[Sequence[int]] = None) -> None:
        self.ranks = sorted(int(r) for r in ranks) if ranks is not None else None
        self.process_set_id: Optional[int] = None
        self.engine: Optional[Engine] = None

    def included(self) -> bool:
        return self.engine is not None

    def rank(self) -> int:
        return self._engine("rank").rank

    def size(self) -> int:
        return self._engine("size").size

    def _engine(self, op: str) -> Engine:
        if _state is None:
            raise ValueError("Horovod has not been initialized; use hvd.init().")
        if self.engine is None:
            raise InvalidArgumentError(f"this rank is not in process set {self.process_set_id} (ranks {self.ranks})",
                                       op=op)
        return self.engine

    def __repr__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"


global_process_set = ProcessSet()


class _State:
    def __init__(self, world: Any) -> None:
        from ... import MPI

        self.world = world
        self.loop = Loop()
        self.loop.open_timeline(world.Get_rank())
        engine_comm = world.Dup()
        local = world.Split_type(MPI.COMM_TYPE_SHARED, key=world.Get_rank())
        cross = world.Split(local.Get_rank(), world.Get_rank())
        self.local_rank, self.local_size = local.Get_rank(), local.Get_size()
        self.cross_rank, self.cross_size = cross.Get_rank(), cross.Get_size()
        self.homogeneous = len(set(world.allgather(self.local_size))) == 1
        local.Free()
        cross.Free()
        self.engine = Engine(engine_comm, self.loop)
        self.loop.add(self.engine)
        self.sets: dict[int, ProcessSet] = {0: global_process_set}
        global_process_set.process_set_id, global_process_set.engine = 0, self.engine
        global_process_set.ranks = list(range(world.Get_size()))
        self.loop.start()


_state: Optional[_State] = None
_exit_hook: list = []
_init_lock = threading.Lock()
HANDLES: dict[int, tuple[list[Request], Any]] = {}
_next_handle = itertools.count(1)


def init(comm: Any = None, process_sets: Optional[Sequence[ProcessSet]] = None) -> None:
    """Start Horovod on pycoll's world (or the pycoll communicator ``comm``); ``process_sets`` are added at once."""
    global _state
    with _init_lock:
        if _state is not None:
            return
        from ... import MPI

        if comm is not None and isinstance(comm, (list, tuple)):
            raise NotProvidedError("hvd.init(comm=[ranks]) is not supported; pass a pycoll communicator", op="init")
        _state = _State(comm if comm is not None else MPI.COMM_WORLD)
        if not _exit_hook:
            _exit_hook.append(atexit.register(shutdown))  # the others' cycles wait for this rank's until then
    for ps in process_sets or ():
        add_process_set(ps)


def shutdown() -> None:
    """Stop the engine once every rank has called shutdown (or exited); later calls need init() again."""
    global _state
    state = _state
    if state is None:
        return
    state.loop.shutdown(max(state.world.timeout, 1.0))
    for ps in state.sets.values():
        ps.engine = None
    _state = None


def is_initialized() -> bool:
    return _state is not None


def current_state() -> _State:
    if _state is None:
        raise ValueError("Horovod has not been initialized; use hvd.init().")
    return _state


def rank() -> int:
    return current_state().engine.rank


def size() -> int:
    return current_state().engine.size


def local_rank() -> int:
    return current_state().local_rank


def local_size() -> int:
    return current_state().local_size


def cross_rank() -> int:
    return current_state().cross_rank


def cross_size() -> int:
    return current_state().cross_size


def is_homogeneous() -> bool:
    return current_state().homogeneous


def mpi_threads_supported() -> bool:
    return False  # pycoll provides MPI_THREAD_SERIALIZED: only the engine's thread calls it


def mpi_enabled() -> bool:
    return True


def mpi_built() -> bool:
    return True


def gloo_enabled() -> bool:
    return False


def gloo_built() -> bool:
    return False


def nccl_built() -> int:
    return 0


def cuda_built() -> bool:
    return torch.cuda.is_available()


def rocm_built() -> bool:
    return False


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    raise NotProvidedError("set PYCOLL_HVD_TIMELINE (or HOROVOD_TIMELINE) before hvd.init() for a timeline",
                           op="start_timeline")


def add_process_set(process_set: Union[ProcessSet, Sequence[int]]) -> ProcessSet:
    """Make a process set of some ranks: every rank calls it, in the same order (as in Horovod)."""
    state = current_state()
    ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
    if ps.ranks is None or not ps.ranks:
        raise InvalidArgumentError("a process set needs a list of ranks", op="add_process_set")
    bad = [r for r in ps.ranks if not 0 <= r < size()]
    if bad:
        raise InvalidArgumentError(f"ranks {bad} are not in the job of {size()}", op="add_process_set")
    if ps.process_set_id is not None:
        raise InvalidArgumentError(f"{ps} was added already", op="add_process_set")
    set_id = max(state.sets) + 1
    label = f"set{set_id}"

    def make() -> Optional[Engine]:  # on the loop's thread, at the same point on every rank
        from ... import MPI

        comm = state.engine.comm.Split(0 if rank() in ps.ranks else MPI.UNDEFINED, rank())
        if comm is None or comm == MPI.COMM_NULL:
            return None
        engine = Engine(comm, state.loop, label)
        state.loop.add(engine)
        return engine

    ps.engine = _run_call(state.engine, f"add_process_set.{set_id}", make)
    ps.process_set_id = set_id
    state.sets[set_id] = ps
    return ps


def remove_process_set(process_set: ProcessSet) -> bool:
    """Stop a process set's engine (every rank calls it); False for the global set or one not added."""
    state = current_state()
    if process_set.process_set_id in (None, 0) or process_set.process_set_id not in state.sets:
        return False
    engine = process_set.engine

    def stop() -> None:
        if engine is not None:
            engine.shutdown()

    _run_call(state.engine, f"remove_process_set.{process_set.process_set_id}", stop)
    del state.sets[process_set.process_set_id]
    process_set.engine, process_set.process_set_id = None, None
    return True


def _run_call(engine: Engine, name: str, fn: Any) -> Any:
    req = engine.submit(Request(name=name, kind="call", fn=fn))
    return wait_requests([req])[0]


def new_handle(reqs: list[Request], finish: Any) -> int:
    h = next(_next_handle)
    HANDLES[h] = (reqs, finish)
    return h


def wait_requests(reqs: list[Request]) -> list[Any]:
    state = _state
    if state is not None:
        state.loop.drive_until(reqs)
    for req in reqs:
        req.done.wait()
    for req in reqs:
        if req.error is not None:
            raise req.error
    return [req.result for req in reqs]


def poll(handle: int) -> bool:
    """Whether the operation of ``handle`` has finished (``synchronize`` then returns at once)."""
    if handle not in HANDLES:
        raise ValueError(f"handle {handle} was not created or has been cleared")
    return all(req.done.is_set() for req in HANDLES[handle][0])


def synchronize(handle: int) -> Any:
    """Wait for the operation of ``handle`` and return its output (raises its error)."""
    if handle not in HANDLES:
        raise ValueError(f"handle {handle} was not created or has been cleared")
    reqs, finish = HANDLES.pop(handle)
    return finish(wait_requests(reqs))
