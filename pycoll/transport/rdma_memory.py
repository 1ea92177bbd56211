"""RDMA's registered memory with no verbs in it: regions, the block pool that carves them, bounce blocks, and the
cache of user-buffer registrations (bounded, invalidated when a buffer goes away)."""

from __future__ import annotations

import bisect
import dataclasses
import weakref
from collections import OrderedDict
from typing import Any, Callable, Optional

import numpy as np


@dataclasses.dataclass
class Region:
    """A registered memory region: its address and keys, a view when the process may touch it, the provider's
    handle (an MR) for deregistration."""

    addr: int
    length: int
    lkey: int
    rkey: int
    view: Optional[memoryview] = None
    handle: Any = None


@dataclasses.dataclass
class Slice:
    """A piece of a Region handed out by a BlockPool."""

    region: Region
    offset: int
    length: int

    @property
    def addr(self) -> int:
        return self.region.addr + self.offset

    @property
    def view(self) -> memoryview:
        assert self.region.view is not None
        return self.region.view[self.offset : self.offset + self.length]


class BlockPool:
    """Strategy 1: a few large pre-registered blocks that rings, control cells and bounce blocks are carved from
    (first fit, freed pieces coalesce), so registration happens once per block rather than once per buffer."""

    def __init__(self, alloc: Callable[[int], Region], free: Callable[[Region], None], block_size: int, align: int = 64) -> None:
        self._alloc, self._free_region = alloc, free
        self.block_size = block_size
        self.align = align
        self.blocks: list[Region] = []
        self._holes: list[list[tuple[int, int]]] = []  # per block: sorted (offset, length) free pieces

    def carve(self, nbytes: int) -> Slice:
        size = max(self.align, -(-nbytes // self.align) * self.align)
        for b, holes in enumerate(self._holes):
            for h, (off, length) in enumerate(holes):
                if length >= size:
                    if length == size:
                        del holes[h]
                    else:
                        holes[h] = (off + size, length - size)
                    return Slice(self.blocks[b], off, nbytes)
        region = self._alloc(max(self.block_size, size))
        self.blocks.append(region)
        self._holes.append([(size, region.length - size)] if region.length > size else [])
        return Slice(region, 0, nbytes)

    def give_back(self, piece: Slice) -> None:
        b = next(i for i, r in enumerate(self.blocks) if r is piece.region)
        holes = self._holes[b]
        size = max(self.align, -(-piece.length // self.align) * self.align)
        i = bisect.bisect(holes, (piece.offset, 0))
        start, length = piece.offset, size
        if i < len(holes) and holes[i][0] == start + length:  # merge with the next hole
            length += holes.pop(i)[1]
        if i > 0 and holes[i - 1][0] + holes[i - 1][1] == start:  # and with the previous one
            start, length = holes[i - 1][0], holes[i - 1][1] + length
            holes[i - 1] = (start, length)
        else:
            holes.insert(i, (start, length))

    def free_bytes(self) -> int:
        return sum(length for holes in self._holes for _, length in holes)

    def close(self) -> None:
        for region in self.blocks:
            self._free_region(region)
        self.blocks.clear()
        self._holes.clear()


class BouncePool:
    """Strategy 2: fixed-size registered blocks that send data is copied into (dynamic shapes, small messages);
    a block is busy from its copy until the write that reads it completes."""

    def __init__(self, pool: BlockPool, block_size: int, count: int) -> None:
        self.block_size = block_size
        self._all = [pool.carve(block_size) for _ in range(count)]
        self._idle = list(reversed(self._all))

    @property
    def idle(self) -> int:
        return len(self._idle)

    def take(self) -> Optional[Slice]:
        return self._idle.pop() if self._idle else None

    def give(self, block: Slice) -> None:
        self._idle.append(block)


def buffer_owner(view: memoryview) -> Any:
    """The object that owns the memory behind ``view``: a NumPy array's root base, else the exporter."""
    obj = view.obj
    while getattr(obj, "base", None) is not None and hasattr(obj, "__array_interface__"):
        obj = obj.base
    return obj


class _Entry:
    __slots__ = ("key", "handle", "users", "stale", "finalizer")

    def __init__(self, key: tuple[int, int], handle: Any) -> None:
        self.key, self.handle = key, handle
        self.users = 0
        self.stale = False  # invalidated while in use: deregistered when the last user releases it
        self.finalizer: Any = None


class MRCache:
    """Strategy 3: registrations of user buffers kept for reuse (repeated static shapes), keyed by (address,
    length), least recently used evicted past ``max_entries`` or ``max_bytes``.

    An entry is invalidated when the buffer's owner is garbage-collected (the address may then be reused for
    other pages) or by ``invalidate`` over an address range; an entry in use is deregistered only when its
    last user releases it. ``register(addr, length)`` and ``deregister(handle)`` are the provider's.
    """

    def __init__(
        self,
        register: Callable[[int, int], Any],
        deregister: Callable[[Any], None],
        max_entries: int = 64,
        max_bytes: int = 1 << 32,
    ) -> None:
        self._register, self._deregister = register, deregister
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self._lru: "OrderedDict[tuple[int, int], _Entry]" = OrderedDict()
        self.bytes = 0
        self.hits = self.misses = self.evictions = self.invalidations = 0
        self._gone: list[_Entry] = []  # entries whose owner was garbage-collected, forgotten at the next call

    def __len__(self) -> int:
        self._reap()
        return len(self._lru)

    def __contains__(self, key: tuple[int, int]) -> bool:
        self._reap()
        return key in self._lru

    def acquire(self, addr: int, length: int, owner: Any = None) -> _Entry:
        """The registration of [addr, addr+length), registering on a miss; release it with ``release``. Without
        an owner that can be watched (weakref), the registration is not cached and ends at release."""
        self._reap()
        key = (addr, length)
        entry = self._lru.get(key)
        if entry is not None and not entry.stale:
            self.hits += 1
            self._lru.move_to_end(key)
            entry.users += 1
            return entry
        self.misses += 1
        entry = _Entry(key, self._register(addr, length))
        entry.users = 1
        try:
            entry.finalizer = weakref.finalize(owner, self._gone.append, entry) if owner is not None else None
        except TypeError:  # bytes and other objects without weak references
            entry.finalizer = None
        if entry.finalizer is None:
            entry.stale = True  # transient: deregistered at release
            return entry
        self._lru[key] = entry
        self.bytes += length
        self._evict()
        return entry

    def release(self, entry: _Entry) -> None:
        self._reap()
        entry.users -= 1
        if entry.users == 0 and entry.stale:
            self._drop_handle(entry)
        else:
            self._evict()

    def invalidate(self, addr: int, length: int) -> int:
        """Forget every entry overlapping [addr, addr+length) (memory unmapped or reused); returns how many."""
        self._reap()
        hit = [e for (a, n), e in self._lru.items() if a < addr + length and addr < a + n]
        for e in hit:
            self._forget(e)
        self.invalidations += len(hit)
        return len(hit)

    def clear(self) -> None:
        for e in list(self._lru.values()):
            self._forget(e)

    def _reap(self) -> None:
        """Forget the entries whose owners were collected. The finalizer only queues them: it may run inside
        any allocation, on any thread, while this cache is half-way through an update."""
        while self._gone:
            entry = self._gone.pop()
            if self._lru.get(entry.key) is entry:
                self.invalidations += 1
                self._forget(entry)

    def _forget(self, entry: _Entry) -> None:
        if self._lru.get(entry.key) is entry:
            del self._lru[entry.key]
            self.bytes -= entry.key[1]
        if entry.finalizer is not None:
            entry.finalizer.detach()
        entry.stale = True
        if entry.users == 0:
            self._drop_handle(entry)

    def _drop_handle(self, entry: _Entry) -> None:
        handle, entry.handle = entry.handle, None
        if handle is not None:
            self._deregister(handle)

    def _evict(self) -> None:
        while len(self._lru) > self.max_entries or self.bytes > self.max_bytes:
            victim = next((e for e in self._lru.values() if e.users == 0), None)
            if victim is None:
                return  # everything is in use: over the limit until something is released
            self.evictions += 1
            self._forget(victim)


def buffer_address(view: memoryview) -> int:
    """The address of a contiguous buffer (read-only ones too); 0 for an empty one."""
    return int(np.frombuffer(view, np.uint8).ctypes.data) if len(view) else 0
