"""CUDA IPC for the ranks of one host: each rank's device buffer exported by handle, peers' buffers mapped and cached."""

# Two backends share one small interface (allocate, open, published):
# - CudaIpc: device memory from numba.cuda, exported with cuIpcGetMemHandle (numba's IPC handles) and opened in
#   the peers with cuIpcOpenMemHandle. Ranks may share one GPU: a process cannot open its own handle, but another
#   process on the same device can.
# - ShmIpc: for numba's CUDA simulator, where "device" memory is host memory. The buffer is a file in the
#   shared-memory directory, mapped by every rank and wrapped as a simulator device array, so the algorithms,
#   the handle exchange, the mapping cache and the kernels run across real processes without a GPU.
# Nothing here imports numba.cuda at import time (the simulator must be chosen before it loads).

from __future__ import annotations

import itertools
import json
import mmap
import os
import pickle
import secrets
from typing import Any, Optional, Protocol

import numpy as np

SLOT_ALIGN = 256  # bytes: slots and blocks start on this boundary (a CUDA allocation's alignment)
_SHM_PREFIX = "pycoll-ipc-"
_CUDA, _SHM = b"C", b"S"  # the first byte of a handle names its backend
_names = itertools.count()


class Buffer(Protocol):
    """Device bytes (this rank's or a mapped peer's): typed views for kernels and copies, and a close."""

    nbytes: int
    handle: bytes  # what a peer opens (empty for a mapping of someone else's buffer)

    def view(self, offset: int, nbytes: int, dtype: Any) -> Any: ...

    def close(self) -> None: ...


class CudaBuffer:
    """A numba device array of bytes: this rank's own allocation, or a peer's opened through its IPC handle."""

    def __init__(self, array: Any, handle: bytes = b"", opened: Any = None) -> None:
        self._array = array
        self.nbytes = int(array.size)
        self.handle = handle
        self._opened = opened  # numba's IpcArrayHandle when this maps a peer's memory

    def view(self, offset: int, nbytes: int, dtype: Any) -> Any:
        return self._array[offset : offset + nbytes].view(np.dtype(dtype))

    def close(self) -> None:
        self._array = None
        if self._opened is not None:
            opened, self._opened = self._opened, None
            opened.close()


class CudaIpc:
    """Device memory shared through CUDA IPC handles (numba's serialisation of cuIpcGetMemHandle)."""

    name = "cuda"

    def allocate(self, nbytes: int) -> CudaBuffer:
        from numba import cuda

        array = cuda.device_array(nbytes, np.uint8)
        # numba pickles the 64-byte handle with the allocation's size, offset and device identity
        return CudaBuffer(array, _CUDA + pickle.dumps(array.get_ipc_handle()))

    def open(self, handle: bytes) -> CudaBuffer:
        if handle[:1] != _CUDA:
            raise ValueError(f"not a CUDA IPC handle (backend byte {handle[:1]!r})")
        # the handle comes from a rank of this job on this host (the same trust as the host arena's mapping)
        opened = pickle.loads(handle[1:])
        return CudaBuffer(opened.open(), opened=opened)

    def published(self, buf: CudaBuffer) -> None:
        """Every peer has mapped ``buf``: nothing to release (the handle names live memory only)."""


class ShmBuffer:
    """A shared-memory file mapped into this process, seen as simulator device memory."""

    def __init__(self, path: str, nbytes: int, create: bool) -> None:
        self.path, self.nbytes = path, nbytes
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, nbytes)
            elif os.fstat(fd).st_size != nbytes:
                raise ValueError(f"{path} has {os.fstat(fd).st_size} bytes, the handle says {nbytes}")
            self._map: Optional[mmap.mmap] = mmap.mmap(fd, nbytes)
        except BaseException:
            if create:
                os.unlink(path)
            raise
        finally:
            os.close(fd)
        self._host: Optional[np.ndarray] = np.frombuffer(self._map, np.uint8)
        self.handle = _SHM + json.dumps({"path": path, "nbytes": nbytes}).encode() if create else b""

    def view(self, offset: int, nbytes: int, dtype: Any) -> Any:
        from .launch import DeviceNDArray

        assert self._host is not None, "the buffer was closed"
        return DeviceNDArray(self._host[offset : offset + nbytes].view(np.dtype(dtype)))

    def unlink(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def close(self) -> None:
        self._host = None
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:  # a view is still alive somewhere: the mapping goes with it
                pass
            self._map = None


class ShmIpc:
    """The simulator's stand-in for CUDA IPC: buffers are shared-memory files; a handle is the file's name."""

    name = "shm"

    def __init__(self, directory: Optional[str] = None) -> None:
        if directory is None:
            from ..config import SHM_DIR

            directory = SHM_DIR.get()
        self.directory = directory

    def allocate(self, nbytes: int) -> ShmBuffer:
        name = f"{_SHM_PREFIX}{os.getpid()}-{next(_names)}-{secrets.token_hex(4)}"
        return ShmBuffer(os.path.join(self.directory, name), nbytes, create=True)

    def open(self, handle: bytes) -> ShmBuffer:
        if handle[:1] != _SHM:
            raise ValueError(f"not a shared-memory IPC handle (backend byte {handle[:1]!r})")
        desc = json.loads(handle[1:].decode())
        path, nbytes = str(desc["path"]), int(desc["nbytes"])
        if os.path.dirname(path) != self.directory or not os.path.basename(path).startswith(_SHM_PREFIX):
            raise ValueError(f"{path} is not a pycoll IPC buffer in {self.directory}")
        return ShmBuffer(path, nbytes, create=False)

    def published(self, buf: ShmBuffer) -> None:
        """Every peer has mapped ``buf`` (or given up): the file's name can go; the mappings stay."""
        buf.unlink()


def backend() -> Any:
    """The backend for this process: the stand-in under numba's CUDA simulator, CUDA IPC otherwise."""
    from . import launch

    return ShmIpc() if launch.is_simulator() else CudaIpc()


class MappingCache:
    """Peers' buffers opened by (peer, generation): each handle is opened once, and closed when a newer
    generation replaces it or the communicator is freed."""

    def __init__(self, ipc: Any) -> None:
        self._ipc = ipc
        self._maps: dict[tuple[int, int], Any] = {}
        self.opened = 0  # handles opened over the cache's life (the tests count them)

    def get(self, peer: int, generation: int, handle: bytes) -> Any:
        key = (peer, generation)
        buf = self._maps.get(key)
        if buf is None:
            buf = self._maps[key] = self._ipc.open(handle)
            self.opened += 1
        return buf

    def lookup(self, peer: int, generation: int) -> Optional[Any]:
        return self._maps.get((peer, generation))

    def drop(self, generation: int) -> None:
        """Close the mappings of one generation (its exchange failed)."""
        for key in [k for k in self._maps if k[1] == generation]:
            self._maps.pop(key).close()

    def retire(self, generation: int) -> int:
        """Close every mapping older than ``generation``; returns how many were closed."""
        old = [k for k in self._maps if k[1] < generation]
        for key in old:
            self._maps.pop(key).close()
        return len(old)

    def close(self) -> None:
        for buf in self._maps.values():
            buf.close()
        self._maps.clear()

    def __len__(self) -> int:
        return len(self._maps)


def slot_bytes(need: int, smallest: int, largest: int) -> int:
    """A slot's size for calls of ``need`` bytes: a power of two from ``smallest``, at most ``largest``, aligned."""
    size = max(int(smallest), 1)
    while size < need:
        size *= 2
    size = min(size, max(int(largest), need))
    return -(-size // SLOT_ALIGN) * SLOT_ALIGN


class IpcArena:
    """One generation of a communicator's IPC buffers: this rank's and the peers' mapped, two slots each.

    Slot ``op & 1`` of every rank holds arena operation ``op``'s data, so one call may start while a peer still
    reads the last one (as in the host arena).
    """

    def __init__(self, generation: int, rank: int, size: int, slot: int, own: Any, peers: dict[int, Any]) -> None:
        self.generation, self.rank, self.size = generation, rank, size
        self.slot_bytes = slot
        self.own = own
        self._bufs = [own if q == rank else peers[q] for q in range(size)]

    def slot(self, rank: int, op: int, nbytes: int, dtype: Any = np.uint8, start: int = 0) -> Any:
        """``nbytes`` of ``rank``'s slot for arena operation ``op``, from byte ``start``, as ``dtype``."""
        if start + nbytes > self.slot_bytes:
            raise ValueError(f"{start + nbytes} bytes do not fit a {self.slot_bytes}-byte IPC slot")
        return self._bufs[rank].view((op & 1) * self.slot_bytes + start, nbytes, dtype)
