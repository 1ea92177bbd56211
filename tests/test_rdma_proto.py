"""RDMA protocol logic without a device: PYCOLL_IB_HCA, port and GID choice, credits, rings, pools, the MR cache."""

from __future__ import annotations

import gc

import numpy as np
import pytest

from pycoll.errors import ProtocolError
from pycoll.topology import fixtures
from pycoll.topology.model import Device
from pycoll.transport.rdma_memory import BlockPool, BouncePool, MRCache, Region, buffer_address, buffer_owner
from pycoll.transport.rdma_proto import (
    ByteRing,
    CreditReturn,
    Credits,
    PortInfo,
    choose_port,
    fabric_of,
    parse_hca,
    pick_gid,
    usable_ports,
)

# ---- PYCOLL_IB_HCA ---------------------------------------------------------------------------------


def test_hca_prefix_match_and_ports():
    f = parse_hca("mlx5_0:1,mlx5_1")
    assert f.allows("mlx5_0", 1) and not f.allows("mlx5_0", 2)
    assert f.allows("mlx5_1", 1) and f.allows("mlx5_1", 2)
    assert f.allows("mlx5_10", 1)  # prefix match by default, as in NCCL
    assert not f.allows("mlx4_0", 1)


def test_hca_exact_and_exclude():
    exact = parse_hca("=mlx5_1")
    assert exact.allows("mlx5_1", 1) and not exact.allows("mlx5_10", 1)
    excl = parse_hca("^mlx5_3")
    assert not excl.allows("mlx5_3", 1) and not excl.allows("mlx5_30", 1) and excl.allows("mlx5_0", 1)
    both = parse_hca("^=mlx5_3:1")
    assert not both.allows("mlx5_3", 1) and both.allows("mlx5_3", 2) and both.allows("mlx5_30", 1)
    assert parse_hca("").allows("anything", 7)


@pytest.mark.parametrize("bad", ["mlx5_0:x", "mlx5_0:0", ":1", "^", "="])
def test_hca_rejects(bad):
    with pytest.raises(ValueError):
        parse_hca(bad)


def _port(dev, port=1, active=True, layer="InfiniBand"):
    return PortInfo(dev, port, active, layer, lid=1, gid="fe80:0000:0000:0000:0000:0000:0000:0001", gid_index=0, fabric="ib:fe80")


def test_usable_ports_follow_the_list_order_and_skip_down_ports():
    ports = [_port("mlx5_0"), _port("mlx5_1"), _port("mlx5_2", active=False), _port("mlx5_3")]
    assert [p.device for p in usable_ports(ports, parse_hca("mlx5_3,mlx5_0,mlx5_2"))] == ["mlx5_3", "mlx5_0"]
    assert [p.device for p in usable_ports(ports, parse_hca("^mlx5_1"))] == ["mlx5_0", "mlx5_3"]


def test_port_nearest_the_gpu_or_numa_node():
    topo = fixtures.dgx_h100()
    ports = [_port(f"mlx5_{i}") for i in range(8)]
    # GPUs 2 and 3 share a PCIe switch with mlx5_2 and mlx5_3 and take them in turn
    assert choose_port(ports, topo, Device(0, "gpu", 2)).device == "mlx5_2"
    assert choose_port(ports, topo, Device(0, "gpu", 3)).device == "mlx5_3"
    # excluding mlx5_3 (PYCOLL_IB_HCA=^mlx5_3): GPU 3 falls back to its switch's other NIC
    without = usable_ports(ports, parse_hca("^=mlx5_3"))
    assert choose_port(without, topo, Device(0, "gpu", 3)).device == "mlx5_2"
    # a rank on NUMA node 1 gets a NIC of socket 1
    assert choose_port(ports, topo, Device(0, "cpu", 1)).device in {"mlx5_4", "mlx5_5", "mlx5_6", "mlx5_7"}
    # no topology, or one that does not know these NICs: the first in preference order
    assert choose_port(ports[3:], None, None).device == "mlx5_3"
    assert choose_port([_port("fake0")], topo, Device(0, "gpu", 0)).device == "fake0"
    assert choose_port([], topo, Device(0, "gpu", 0)) is None


def test_gid_choice_prefers_roce_v2_ipv4():
    table = [
        (0, "fe80:0000:0000:0000:0202:c9ff:fe00:0001", "IB/RoCE v1"),
        (1, "fe80:0000:0000:0000:0202:c9ff:fe00:0001", "RoCE v2"),
        (2, "0000:0000:0000:0000:0000:ffff:0a00:0001", "IB/RoCE v1"),
        (3, "0000:0000:0000:0000:0000:ffff:0a00:0001", "RoCE v2"),
        (4, "0000:0000:0000:0000:0000:0000:0000:0000", ""),
    ]
    assert pick_gid(table) == 3
    assert pick_gid(table[:3]) == 1  # v2 link-local before v1
    assert pick_gid(table, want=2) == 2
    assert pick_gid(table, want=4) == -1  # an empty slot
    assert pick_gid([]) == -1
    assert fabric_of("InfiniBand", "fe80:0000:0000:0000:0002:c903:0031:7891") == "ib:fe80:0000:0000:0000"
    assert fabric_of("Ethernet", "x") == "roce"


# ---- credits and the ring ---------------------------------------------------------------------------


def test_credits_split_at_the_ring_end_and_need_receives():
    c = Credits(capacity=100, recv_slots=2)
    assert c.writable(70, chunk=64) == 64
    c.wrote(64)
    assert c.writable(70, chunk=64) == 36  # up to the end of the ring, never wrapping a write
    c.wrote(30)
    assert c.slots == 0 and c.writable(10, 64) == 0  # both receives used
    assert c.update(consumed=64, reposted=1, peer=1)
    assert c.free == 70 and c.slots == 1 and c.position == 94
    assert c.writable(50, 64) == 6
    assert not c.update(consumed=64, reposted=1, peer=1)
    with pytest.raises(ValueError):
        c.wrote(80)
    with pytest.raises(ProtocolError, match="rank 1"):
        c.update(consumed=10, reposted=1, peer=1)  # went backwards
    with pytest.raises(ProtocolError):
        c.update(consumed=200, reposted=1, peer=1)  # more than was sent


def test_credit_return_batches_but_never_strands_the_sender():
    r = CreditReturn(capacity=1000, recv_slots=8)
    assert not r.due(ring_empty=True)  # nothing to tell
    r.consumed = 100
    assert not r.due(ring_empty=False)
    assert r.due(ring_empty=True)  # everything consumed: the sender may be waiting for exactly this
    r.consumed = 250
    assert r.due(ring_empty=False)  # a quarter of the ring
    assert r.told() == (250, 0)
    r.reposted = 2
    assert r.due(ring_empty=False)  # a quarter of the receives


def test_byte_ring_wraps_and_rejects_overruns():
    ring = ByteRing(memoryview(bytearray(8)))
    ring.view[0:6] = b"abcdef"
    ring.arrived(6, peer=2)
    assert bytes(ring.peek()) == b"abcdef"
    ring.consume(5)
    ring.view[6:8] = b"gh"
    ring.view[0:3] = b"ijk"
    ring.arrived(5, peer=2)
    assert bytes(ring.peek()) == b"fgh"  # contiguous up to the end
    ring.consume(3)
    assert bytes(ring.peek()) == b"ijk"
    with pytest.raises(ProtocolError, match="credit overrun"):
        ring.arrived(6, peer=2)
    with pytest.raises(ValueError):
        ring.consume(4)


def test_credit_protocol_moves_every_byte_through_a_small_ring():
    """Sender, ring and credit return together, with random write and read sizes: no overrun, no stall, order kept."""
    rng = np.random.default_rng(7)
    data = rng.integers(0, 256, 20000, dtype=np.uint8).tobytes()
    cap, slots = 256, 4
    ring, credits, back = ByteRing(memoryview(bytearray(cap))), Credits(cap, slots), CreditReturn(cap, slots)
    sent, out, in_flight, reports = 0, bytearray(), [], 0
    for _ in range(100000):
        if sent < len(data):
            m = credits.writable(min(int(rng.integers(1, 100)), len(data) - sent), chunk=64)
            if m:
                pos = credits.position
                ring.view[pos : pos + m] = data[sent : sent + m]
                credits.wrote(m)
                in_flight.append(m)
                sent += m
        if in_flight and rng.random() < 0.5:  # a write lands: the receive is re-posted at once
            ring.arrived(in_flight.pop(0), peer=1)
            back.reposted += 1
        view = ring.peek()
        take = min(len(view), int(rng.integers(0, 50)))
        out += view[:take]
        ring.consume(take)
        back.consumed += take
        if back.due(ring.pending == 0):
            credits.update(*back.told(), peer=1)
            reports += 1
        if len(out) == len(data):
            break
    assert bytes(out) == data and credits.sent == len(data) and reports > 0


# ---- pools --------------------------------------------------------------------------------------


class _Alloc:
    def __init__(self):
        self.live = {}
        self.next = 0

    def alloc(self, n):
        self.next += 1
        r = Region(self.next << 32, n, self.next, self.next, memoryview(bytearray(n)), self.next)
        self.live[self.next] = r
        return r

    def free(self, r):
        del self.live[r.handle]


def test_block_pool_carves_coalesces_and_grows():
    a = _Alloc()
    pool = BlockPool(a.alloc, a.free, block_size=1024)
    x, y, z = pool.carve(100), pool.carve(200), pool.carve(64)
    assert (x.offset, y.offset, z.offset) == (0, 128, 384) and len(a.live) == 1
    pool.give_back(y)
    pool.give_back(x)  # merges with y's hole
    assert pool.carve(300).offset == 0
    big = pool.carve(5000)  # larger than a block: a block of its own
    assert big.region.length == 5056 and len(a.live) == 2
    x.region.view[:4] = b"abcd"
    assert bytes(x.view[:4]) == b"abcd"
    pool.close()
    assert a.live == {}


def test_bounce_pool_hands_out_fixed_blocks():
    a = _Alloc()
    bounce = BouncePool(BlockPool(a.alloc, a.free, 1 << 20), block_size=4096, count=3)
    blocks = [bounce.take() for _ in range(3)]
    assert bounce.take() is None and bounce.idle == 0
    assert len({b.offset for b in blocks}) == 3 and all(b.length == 4096 for b in blocks)
    bounce.give(blocks[1])
    assert bounce.take() is blocks[1]


# ---- the MR cache ---------------------------------------------------------------------------------


class _Reg:
    def __init__(self):
        self.live = set()
        self.calls = 0

    def register(self, addr, n):
        self.calls += 1
        self.live.add((addr, n))
        return (addr, n)

    def deregister(self, h):
        self.live.remove(h)


def test_mr_cache_reuses_a_static_buffer():
    reg = _Reg()
    cache = MRCache(reg.register, reg.deregister, max_entries=4)
    arr = np.zeros(1000, np.uint8)
    view = memoryview(arr)
    for _ in range(5):
        e = cache.acquire(buffer_address(view), len(view), buffer_owner(view))
        cache.release(e)
    assert (cache.hits, cache.misses, reg.calls) == (4, 1, 1)
    assert buffer_owner(memoryview(arr[10:20])) is arr  # views of the array share its owner


def test_mr_cache_evicts_lru_but_not_entries_in_use():
    reg = _Reg()
    cache = MRCache(reg.register, reg.deregister, max_entries=2)
    owners = [np.zeros(8) for _ in range(4)]
    busy = cache.acquire(1000, 10, owners[0])
    for i, addr in enumerate((2000, 3000, 4000), start=1):
        cache.release(cache.acquire(addr, 10, owners[i]))
    assert (1000, 10) in cache and (4000, 10) in cache and len(cache) == 2
    assert reg.live == {(1000, 10), (4000, 10)} and cache.evictions == 2
    cache.release(busy)
    cache.clear()
    assert reg.live == set()


def test_mr_cache_invalidation():
    reg = _Reg()
    cache = MRCache(reg.register, reg.deregister)
    arr = np.zeros(64, np.uint8)
    held = cache.acquire(5000, 100, arr)
    cache.release(cache.acquire(9000, 100, arr))
    assert cache.invalidate(5050, 10) == 1  # overlaps the first only
    assert (5000, 100) not in cache and (5000, 100) in reg.live  # still in use: deregistered at release
    cache.release(held)
    assert (5000, 100) not in reg.live
    # the owner's death invalidates: its address may come back for other memory
    assert (9000, 100) in cache
    del arr
    gc.collect()
    assert (9000, 100) not in cache and reg.live == set() and cache.invalidations == 2


def test_mr_cache_does_not_keep_buffers_it_cannot_watch():
    reg = _Reg()
    cache = MRCache(reg.register, reg.deregister)
    data = b"x" * 100  # bytes: no weak reference, so no way to notice the memory going away
    e = cache.acquire(buffer_address(memoryview(data)), 100, buffer_owner(memoryview(data)))
    assert len(cache) == 0 and len(reg.live) == 1
    cache.release(e)
    assert reg.live == set()
