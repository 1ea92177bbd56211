"""RDMA transport: a byte channel per peer over an RC queue pair, data carried by RDMA WRITE with immediate.

Each channel owns a receive ring that its peer writes into, and writes into the peer's ring in turn:

- Credits. A write needs ring space and a posted receive at the peer (``rdma_proto.Credits``). The receiver
  reports its totals of bytes consumed and receives re-posted by a plain RDMA WRITE into the sender's control
  cell (``CreditReturn`` decides when), so credits need no receive of their own.
- Chunking and pipelining. A send is cut into writes of at most PYCOLL_IB_CHUNK that never wrap the ring;
  as many are in flight as the credits and the send queue allow.
- Memory (the three strategies): rings, control cells and bounce blocks are carved from a few large
  pre-registered blocks (``BlockPool``); sends below PYCOLL_IB_ZCOPY are copied into fixed-size bounce blocks
  (``BouncePool``); larger ones are written straight from the user's buffer, registered through the MR
  cache (``MRCache``), and count as accepted only once their writes completed.
- Failures. A failed completion or a queue pair in error becomes a PeerFailureError naming the peer; the
  channel never blocks, so every wait above keeps the communicator's timeout.

Devices come from a provider: pyverbs (``rdma_verbs``), or with PYCOLL_IB_FAKE=1 a fake NIC in shared
memory (``rdma_fake``) that runs the same channel between processes of one host.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Any, NamedTuple, Optional

from ..config import bool_param, int_param, size_param, str_param
from ..errors import PeerFailureError, ProtocolError, PycollError
from . import rdma_verbs
from .base import Barrier, Channel, PeerInfo, Transport, publish_pair, read_pair
from .rdma_memory import BlockPool, BouncePool, MRCache, Region, Slice, buffer_address, buffer_owner
from .rdma_proto import (
    CTRL_BYTES,
    CTRL_CLOSED,
    CTRL_CONSUMED,
    CTRL_REPOSTED,
    CTRL_WORDS,
    ByteRing,
    CreditReturn,
    Credits,
    Endpoint,
    Nic,
    NoRdma,
    PortInfo,
    Provider,
    choose_port,
    parse_hca,
    usable_ports,
)

log = logging.getLogger("pycoll")

IB_DISABLE = bool_param("PYCOLL_IB_DISABLE", False, "Set to 1 to turn the RDMA transport off (peers on other hosts then use TCP).")
IB_HCA = str_param(
    "PYCOLL_IB_HCA",
    "",
    "RDMA devices and ports to use, NCCL_IB_HCA syntax: `mlx5_0:1,mlx5_1`; `^` excludes the list, `=` matches names "
    "exactly (default: prefix). Default: the active port nearest the rank's GPU or NUMA node.",
)
IB_FAKE = bool_param("PYCOLL_IB_FAKE", False, "Set to 1 to run the RDMA transport over a fake NIC in shared memory (tests; ranks of one host).")
IB_BUFFER = size_param("PYCOLL_IB_BUFFER", 4 << 20, "Bytes of each RDMA receive ring (one per peer; the peer writes into it).")
IB_CHUNK = size_param("PYCOLL_IB_CHUNK", 512 << 10, "Largest single RDMA write, and the size of each bounce block; several are in flight.")
IB_BOUNCE = int_param("PYCOLL_IB_BOUNCE", 8, "Registered bounce blocks per peer that sends below PYCOLL_IB_ZCOPY are copied into.")
IB_ZCOPY = size_param(
    "PYCOLL_IB_ZCOPY", 256 << 10, "Sends of at least this many bytes are written straight from the user's buffer (registered once, cached); 0: always copy."
)
IB_MR_CACHE = int_param("PYCOLL_IB_MR_CACHE", 64, "User-buffer registrations the MR cache keeps (least recently used evicted).")
IB_BLOCK = size_param("PYCOLL_IB_BLOCK", 32 << 20, "Size of the pre-registered blocks that rings and bounce blocks are carved from.")
IB_RECV_DEPTH = int_param("PYCOLL_IB_RECV_DEPTH", 64, "Receives kept posted per queue pair: writes with immediate in flight towards one rank.")

# What a posted write was for; completions arrive in posting order on a queue pair.
_DATA, _ZCOPY, _CREDIT = 1, 2, 3
_KEEPALIVE_S = 1.0  # an idle channel re-sends its credits this often, so a vanished peer shows as a failed write


class _Posted(NamedTuple):
    wr_id: int
    kind: int
    nbytes: int
    block: Optional[Slice]


class _ZeroCopy:
    """A send written straight from the user's buffer: bytes posted, completed and reported to the engine."""

    __slots__ = ("addr", "length", "entry", "posted", "completed", "reported")

    def __init__(self, addr: int, length: int, entry: Any) -> None:
        self.addr, self.length, self.entry = addr, length, entry
        self.posted = self.completed = self.reported = 0


class _Memory(NamedTuple):
    """A channel's registered pieces: the ring the peer writes, the cell it writes credits into, our credit
    source, and the bounce blocks."""

    ring: Slice
    ctrl: Slice
    credit_src: Slice
    bounce: BouncePool


class RdmaChannel(Channel):
    """The byte channel to one peer over one RC queue pair."""

    kind = "rdma"

    def __init__(self, peer: int, ep: Endpoint, mem: _Memory, remote: dict, cache: MRCache,
                 send_depth: int, recv_depth: int, zcopy: int) -> None:
        super().__init__(peer)
        self._ep = ep
        self._mem = mem
        self._ring = ByteRing(mem.ring.view)
        self._ctrl = mem.ctrl.view[: CTRL_WORDS * 8].cast("Q")
        self._src = mem.credit_src.view[: CTRL_WORDS * 8].cast("Q")
        self._bounce = mem.bounce
        self._cache = cache
        self._r_ring, self._r_ring_rkey, r_ring_len = int(remote["ring"][0]), int(remote["ring"][1]), int(remote["ring"][2])
        self._r_ctrl, self._r_ctrl_rkey = int(remote["ctrl"][0]), int(remote["ctrl"][1])
        self._credits = Credits(r_ring_len, int(remote["recv_depth"]))
        self._return = CreditReturn(len(mem.ring.view), recv_depth)
        self._chunk = mem.bounce.block_size
        self._send_depth = send_depth
        self._zcopy = zcopy
        self._inflight: deque[_Posted] = deque()
        self._credit_busy = False
        self.credit_writes = 0
        self._zc: Optional[_ZeroCopy] = None
        self._next_id = 0
        self._error: Optional[PeerFailureError] = None
        self._last_post = time.monotonic()
        self.closed = False

    # ---- failures ----------------------------------------------------------------------------
    def _fail(self, cause: str) -> PeerFailureError:
        if self._error is None:
            self._error = PeerFailureError(cause, peers=[self.peer])
        return self._error

    def _peer_closed(self) -> bool:
        return bool(self._ctrl[CTRL_CLOSED])

    @property
    def closed_by_peer(self) -> bool:
        """The peer closed this channel itself (a normal shutdown), rather than dying."""
        return self._peer_closed()

    # ---- completions and credits -------------------------------------------------------------
    def _progress(self) -> None:
        """Reap completions, re-post receives, take the peer's credits and return ours when due."""
        if self._error is not None:
            raise self._error
        reposts = 0
        try:
            completions = self._ep.poll(64)
        except Exception as exc:  # the device refused to poll: nothing on this queue pair can be trusted
            raise self._fail(f"polling the RDMA completions of rank {self.peer} failed: {exc}") from None
        for c in completions:
            if not c.ok:
                what = "receive" if c.recv else "RDMA write"
                raise self._fail(f"{what} to rank {self.peer} failed: {c.status}")
            if c.recv:
                if c.nbytes and c.imm != c.nbytes:
                    raise self._fail(f"rank {self.peer} wrote {c.nbytes} bytes announcing {c.imm} (RDMA immediate mismatch)")
                try:
                    self._ring.arrived(c.imm, self.peer)
                except ProtocolError as err:
                    raise self._fail(err.cause) from None
                reposts += 1
                continue
            done = self._inflight.popleft()
            if done.wr_id != c.wr_id:
                raise self._fail(f"RDMA completions to rank {self.peer} out of order (wr {c.wr_id}, expected {done.wr_id})")
            if done.kind == _DATA:
                assert done.block is not None
                self._bounce.give(done.block)
            elif done.kind == _ZCOPY:
                assert self._zc is not None
                self._zc.completed += done.nbytes
            else:
                self._credit_busy = False
        if reposts:
            try:
                self._ep.post_recv(reposts)
            except Exception as exc:
                raise self._fail(f"re-posting RDMA receives for rank {self.peer} failed: {exc}") from None
            self._return.reposted += reposts
        try:
            self._credits.update(self._ctrl[CTRL_CONSUMED], self._ctrl[CTRL_REPOSTED], self.peer)
        except ProtocolError as err:
            raise self._fail(err.cause) from None
        self._return_credits()

    def _post(self, kind: int, src: Region, offset: int, nbytes: int, raddr: int, rkey: int, imm: Optional[int],
              block: Optional[Slice] = None) -> None:
        self._next_id += 1
        try:
            self._ep.post_write(self._next_id, src, offset, nbytes, raddr, rkey, imm)
        except Exception as exc:  # a post refused (queue pair in error): the peer is unreachable
            raise self._fail(f"RDMA write to rank {self.peer} could not be posted: {exc}") from None
        self._inflight.append(_Posted(self._next_id, kind, nbytes, block))
        self._last_post = time.monotonic()

    def _return_credits(self, force: bool = False) -> None:
        if self._credit_busy or self.closed or self._peer_closed() or len(self._inflight) >= self._send_depth:
            return
        if not (force or self._return.due(self._ring.pending == 0)):
            return
        consumed, reposted = self._return.told()
        self._src[CTRL_CONSUMED], self._src[CTRL_REPOSTED] = consumed, reposted
        src = self._mem.credit_src
        self._post(_CREDIT, src.region, src.offset, CTRL_WORDS * 8, self._r_ctrl, self._r_ctrl_rkey, None)
        self._credit_busy = True
        self.credit_writes += 1

    def _room(self) -> bool:
        """A send-queue slot for data, keeping one for credits."""
        return len(self._inflight) < self._send_depth - 1

    # ---- sending -----------------------------------------------------------------------------
    def send_some(self, data: memoryview) -> int:
        self._progress()
        if self._peer_closed():
            raise self._fail(f"rank {self.peer} closed its RDMA channel")
        if not len(data):
            return 0
        if self._zc is not None or (self._zcopy and len(data) >= self._zcopy):
            got = self._send_direct(data)
            if got is not None:
                return got
        return self._send_copies(data)

    def _send_copies(self, data: memoryview) -> int:
        """Copy into bounce blocks and write them (strategy 2)."""
        sent, n = 0, len(data)
        credits = self._credits
        while sent < n and self._room():
            m = credits.writable(n - sent, self._chunk)
            if m == 0:
                break
            block = self._bounce.take()
            if block is None:
                break
            block.view[:m] = data[sent : sent + m]
            self._post(_DATA, block.region, block.offset, m, self._r_ring + credits.position, self._r_ring_rkey, m, block)
            credits.wrote(m)
            sent += m
        return sent

    def _send_direct(self, data: memoryview) -> Optional[int]:
        """Write from the user's buffer (strategy 3); bytes count as accepted once their writes completed.
        None: the buffer cannot be registered, so copy instead."""
        addr = buffer_address(data)
        zc = self._zc
        if zc is None:
            try:
                entry = self._cache.acquire(addr, len(data), buffer_owner(data))
            except Exception as exc:  # e.g. memory the device cannot pin: bounce blocks still work
                log.debug("RDMA to rank %d: a %d-byte send buffer cannot be registered (%s); copying", self.peer, len(data), exc)
                self._zcopy = 0
                return None
            zc = self._zc = _ZeroCopy(addr, len(data), entry)
        elif addr != zc.addr + zc.reported or len(data) != zc.length - zc.reported:
            raise ProtocolError(
                f"RDMA send to rank {self.peer}: a direct send of {zc.length} bytes was interrupted by another buffer",
                peers=[self.peer],
            )
        region: Region = zc.entry.handle
        credits = self._credits
        while zc.posted < zc.length and self._room():
            m = credits.writable(zc.length - zc.posted, self._chunk)
            if m == 0:
                break
            offset = zc.addr + zc.posted - region.addr
            self._post(_ZCOPY, region, offset, m, self._r_ring + credits.position, self._r_ring_rkey, m)
            credits.wrote(m)
            zc.posted += m
        done = zc.completed - zc.reported
        zc.reported += done
        if zc.reported == zc.length:
            self._cache.release(zc.entry)
            self._zc = None
        return done

    # ---- receiving ---------------------------------------------------------------------------
    def peek(self, want: int = 0) -> memoryview:
        view = self._ring.peek()
        if view:
            return view
        self._progress()
        view = self._ring.peek()
        if not view and self._peer_closed():
            raise self._fail(f"rank {self.peer} closed its RDMA channel")
        return view

    def consume(self, n: int) -> None:
        self._ring.consume(n)
        self._return.consumed += n
        self._return_credits()

    # ---- liveness and shutdown ---------------------------------------------------------------
    def check_alive(self) -> Optional[str]:
        if self._error is not None:
            return self._error.cause
        try:
            reason = self._ep.error()
            if reason is None and not self._inflight and time.monotonic() - self._last_post > _KEEPALIVE_S:
                self._return_credits(force=True)  # a write to a vanished peer fails within the retry timeout
            if reason is None:
                self._progress()
        except PeerFailureError as err:
            return err.cause
        except Exception as exc:
            reason = f"{type(exc).__name__}: {exc}"
        if reason is not None:
            return self._fail(f"RDMA queue pair to rank {self.peer} failed: {reason}").cause
        if self._peer_closed():
            return f"rank {self.peer} closed its RDMA channel"
        return None

    def has_pending_output(self) -> bool:
        return self._zc is not None or any(p.kind != _CREDIT for p in self._inflight)

    def unsafe_to_exit(self) -> bool:
        # the device still reads our bounce blocks or the user's buffer for these writes
        return self._error is None and self.has_pending_output()

    def close(self) -> None:
        if self.closed:
            return
        try:
            if self._error is None and not self._peer_closed():
                # tell the peer (the closed word rides on a credit write), then let the device finish reading;
                # the credit cell changes only while no write reads it
                told = False
                deadline = time.monotonic() + 0.5
                while time.monotonic() < deadline and not (told and not self._inflight):
                    if not self._credit_busy and not told:
                        self._src[CTRL_CLOSED] = 1
                        self._return_credits(force=True)
                        told = True
                    self._progress()
        except Exception:  # best effort: the peer may be gone already
            pass
        self.closed = True
        self._ep.close()
        if self._zc is not None:
            self._cache.release(self._zc.entry)
            self._zc = None
        for mv in (self._ctrl, self._src):
            try:
                mv.release()
            except BufferError:
                pass


class RdmaTransport(Transport):
    """Opens the port nearest this rank, one RC queue pair per peer, connected through the bootstrap store."""

    name = "rdma"

    def __init__(self, provider: Optional[Provider] = None) -> None:
        self._provider = provider
        self.store: Any = None  # the bootstrap store, set by the runtime before connect
        self.reason: Optional[str] = None  # why the transport is off, once enabled() said so
        self.port: Optional[PortInfo] = None
        self._ports: list[PortInfo] = []
        self.nic: Optional[Nic] = None
        self.pool: Optional[BlockPool] = None
        self.cache: Optional[MRCache] = None
        self._channels: list[RdmaChannel] = []

    def provider(self) -> Provider:
        if self._provider is None:
            if IB_FAKE.get():
                from .rdma_fake import FakeProvider

                self._provider = FakeProvider()
            else:
                self._provider = rdma_verbs.VerbsProvider()
        return self._provider

    def probe(self) -> list[PortInfo]:
        """The usable ports, best first; raises NoRdma saying why there are none."""
        if IB_DISABLE.get():
            raise NoRdma("PYCOLL_IB_DISABLE is set")
        try:
            hca = parse_hca(IB_HCA.get())
        except ValueError as exc:
            raise NoRdma(f"PYCOLL_IB_HCA={IB_HCA.get()!r} is not valid: {exc}") from None
        ports = self.provider().ports()
        usable = usable_ports(ports, hca)
        if not usable:
            seen = ", ".join(f"{p.label} ({'active' if p.active else 'down'})" for p in ports) or "none"
            raise NoRdma(f"no active RDMA port matches PYCOLL_IB_HCA={IB_HCA.get()!r} (ports: {seen})")
        return usable

    def enabled(self) -> bool:
        try:
            self._ports = self.probe()
        except Exception as exc:  # NoRdma, or a provider surprise: either way this process goes without RDMA
            self.reason = str(exc) if isinstance(exc, NoRdma) else f"probing the RDMA devices failed: {type(exc).__name__}: {exc}"
            if not IB_DISABLE.get():
                log.info("RDMA transport off: %s; peers use shared memory or TCP", self.reason)
            return False
        return True

    def listen(self, me: PeerInfo, store_host: str) -> Any:
        if not self._ports:
            return None
        self.port = choose_port(self._ports, *_topology_and_device(me))
        p = self.port
        log.info("rank %d: RDMA on %s (%s, gid[%d] %s)", me.rank, p.label, p.link_layer, p.gid_index, p.gid)
        return {"device": p.device, "port": p.port, "fabric": p.fabric, "lid": p.lid, "gid": p.gid}

    def can_connect(self, me: PeerInfo, peer: PeerInfo) -> bool:
        mine, theirs = me.addresses.get("rdma"), peer.addresses.get("rdma")
        return me.rank != peer.rank and bool(mine) and bool(theirs) and mine["fabric"] == theirs["fabric"]

    def _open(self, job_id: str) -> Nic:
        assert self.port is not None
        nic = self.nic = self.provider().open(self.port, job_id)
        self.pool = BlockPool(nic.alloc, nic.deregister, IB_BLOCK.get())
        self.cache = MRCache(nic.register, nic.deregister, max_entries=IB_MR_CACHE.get())
        return nic

    def _memory(self, recv_depth: int) -> _Memory:
        assert self.pool is not None
        chunk = max(IB_CHUNK.get(), 4096)
        return _Memory(
            ring=self.pool.carve(max(IB_BUFFER.get(), 4096)),
            ctrl=self.pool.carve(CTRL_BYTES),
            credit_src=self.pool.carve(CTRL_BYTES),
            bounce=BouncePool(self.pool, chunk, max(IB_BOUNCE.get(), 1)),
        )

    def connect(
        self, me: PeerInfo, peers: list[PeerInfo], job_id: str, barrier: Barrier, timeout: float
    ) -> dict[int, Channel]:
        deadline = time.monotonic() + timeout
        channels: dict[int, Channel] = {}
        try:
            if peers:
                if self.store is None:
                    raise PycollError("RDMA set-up needs the bootstrap store", op="init", rank=me.rank)
                channels = self._connect_all(me, peers, job_id, deadline)
            barrier("rdma-connected")  # every queue pair is ready to receive before anyone writes
        except BaseException:
            for ch in channels.values():
                ch.close()
            self.close()
            raise
        return channels

    def _connect_all(self, me: PeerInfo, peers: list[PeerInfo], job_id: str, deadline: float) -> dict[int, Channel]:
        try:
            nic = self._open(job_id)
        except Exception as exc:
            raise PeerFailureError(f"cannot open RDMA port {self.port.label if self.port else '?'}: {exc}", op="init", rank=me.rank) from None
        recv_depth = max(IB_RECV_DEPTH.get(), 2)
        send_depth = recv_depth + 2  # data writes are bounded by the peer's receives; plus the credit write
        pending: dict[int, tuple[Endpoint, _Memory]] = {}
        for peer in peers:
            ep = nic.endpoint(send_depth, recv_depth)
            mem = self._memory(recv_depth)
            mem.ctrl.view[:] = bytes(len(mem.ctrl.view))
            ep.post_recv(recv_depth)
            pending[peer.rank] = (ep, mem)
            desc = {
                "ep": ep.address(),
                "ring": [mem.ring.addr, mem.ring.region.rkey, mem.ring.length],
                "ctrl": [mem.ctrl.addr, mem.ctrl.region.rkey],
                "recv_depth": recv_depth,
            }
            publish_pair(self.store, "rdma", me.rank, peer.rank, desc)
        out: dict[int, Channel] = {}
        for peer in peers:
            ep, mem = pending[peer.rank]
            remote = read_pair(self.store, "rdma", me.rank, peer.rank, deadline)
            try:
                ep.connect(remote["ep"])
            except Exception as exc:
                raise PeerFailureError(
                    f"RDMA queue pair to rank {peer.rank} cannot be connected: {exc}", op="init", rank=me.rank, peers=[peer.rank]
                ) from None
            assert self.cache is not None
            ch = RdmaChannel(peer.rank, ep, mem, remote, self.cache, send_depth, recv_depth, IB_ZCOPY.get())
            self._channels.append(ch)
            out[peer.rank] = ch
        return out

    def close(self) -> None:
        for ch in self._channels:
            ch.close()
        self._channels.clear()
        if self.cache is not None:
            self.cache.clear()
            self.cache = None
        if self.pool is not None:
            self.pool.close()
            self.pool = None
        if self.nic is not None:
            self.nic.close()
            self.nic = None


def _topology_and_device(me: PeerInfo) -> tuple[Any, Any]:
    """This host's topology and the rank's device in it (for the nearest NIC), or (None, None)."""
    try:
        from ..topology import live
        from ..topology.model import Device

        kind, ident = me.device if len(me.device) == 2 else ("cpu", 0)
        return live.local_topology(), Device(0, str(kind), ident)
    except Exception as exc:  # the topology is a preference only
        log.debug("RDMA port choice without topology: %s", exc)
        return None, None
