"""A rendezvous whose copy the sender shares (the split table of transport.shm's rings), in one process: the receiver
alone, the sender alone, both at once from two threads, a sender's failed write, and a slot that an older offer
holds; then two ranks moving large messages both ways through every point-to-point call that announces one."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest

k = pytest.importorskip("pycoll.p2p_kernels")

from pycoll import p2p_lane as lane  # noqa: E402
from pycoll.transport.cma import CrossMemory  # noqa: E402
from test_p2p_lanes import CTX, PULLED, Pair, data  # noqa: E402

import harness  # noqa: E402

CHUNK = lane.SPLIT_CHUNK


@pytest.fixture
def pair() -> Pair:
    cma = CrossMemory()
    if not cma.function_address("read") or not cma.function_address("write"):
        pytest.skip(f"no cross-memory attach here: {cma.reason or 'libc has no process_vm_readv/_writev'}")
    probe, got = data(64, 1), np.zeros(64, np.uint8)
    try:
        cma.read_addr(os.getpid(), got.ctypes.data, probe.ctypes.data, probe.size)
    except OSError as exc:
        pytest.skip(f"process_vm_readv refused here ({exc.strerror}: ptrace rules)")
    assert (got == probe).all()
    p = Pair()
    for w in (p.a, p.b):
        w[lane.L_WRITEV] = cma.function_address("write")
    return p


def _slot(p: Pair, rid: int) -> np.ndarray:
    """The split slot of ``rid`` in ring ab (a sends to b), as int64 words."""
    header = p.rings["ab"][1]
    at = (lane.SPLIT_TABLE + (rid % lane.SPLIT_SLOTS) * lane.SPLIT_SLOT_BYTES) // 8
    return header[at: at + lane.SPLIT_SLOT_BYTES // 8]


def _claims(slot: np.ndarray) -> tuple[int, int]:
    c = int(slot[lane.S_CLAIMS // 8])
    return c & 0xFFFFFFFF, c >> 32


def test_the_receiver_alone_reads_every_chunk_and_frees_the_slot(pair):
    a, b = pair.addr(pair.a), pair.addr(pair.b)
    n = 5 * CHUNK + 3
    big, got = data(n, 4), np.zeros(n, np.uint8)
    assert k.announce_at(a, big.ctypes.data, n, CTX, 3, 9) == 1
    slot = _slot(pair, 9)
    assert slot[0] == 9 * 4 + lane.SPLIT_OFFERED and slot[1] == n
    assert k.take(b, got.ctypes.data, n, CTX, 3, 0, 1) == PULLED and (got == big).all()
    assert _claims(slot) == (6, 0) and slot[0] == 9 * 4 + lane.SPLIT_FREE
    assert k.help_split(a, 9, big.ctypes.data, n) == 0  # done: the sender finds nothing to write


def test_small_messages_are_not_offered(pair):
    a = pair.addr(pair.a)
    small = data(lane.SPLIT_MIN_BYTES - 1, 1)
    assert k.announce_at(a, small.ctypes.data, small.size, CTX, 3, 4) == 1
    assert _slot(pair, 4)[0] == 0


def test_the_sender_writes_what_it_claims_before_the_receiver_starts(pair):
    a, b = pair.addr(pair.a), pair.addr(pair.b)
    n = 4 * CHUNK + 100
    big, got = data(n, 6), np.zeros(n, np.uint8)
    k.announce_at(a, big.ctypes.data, n, CTX, 3, 12)
    slot = _slot(pair, 12)
    assert k.help_split(a, 12, big.ctypes.data, n) == 0  # offered, not begun: the receiver's address is unknown
    # begin as the receiver does, then let the sender take every chunk
    slot[lane.S_DST // 8] = got.ctypes.data
    slot[0] = 12 * 4 + lane.SPLIT_ACTIVE
    assert k.help_split(a, 12, big.ctypes.data, n) == 5
    assert _claims(slot) == (0, 5) and slot[lane.S_PUSHED // 8] == 5 and (got == big).all()
    got[:] = 0
    slot[0] = 12 * 4 + lane.SPLIT_OFFERED  # the receiver's take finds every chunk claimed and written
    slot[lane.S_PUSHED // 8] = 5
    assert k.take(b, got.ctypes.data, n, CTX, 3, 0, 1) == PULLED
    assert (got == 0).all()  # the receiver read none of the chunks the sender had claimed
    assert slot[0] == 12 * 4 + lane.SPLIT_FREE


def test_a_failed_write_is_read_again_by_the_receiver(pair):
    a, b = pair.addr(pair.a), pair.addr(pair.b)
    n = 3 * CHUNK + 7
    big, got = data(n, 8), np.full(n, 255, np.uint8)
    k.announce_at(a, big.ctypes.data, n, CTX, 3, 20)
    slot = _slot(pair, 20)
    slot[lane.S_DST // 8] = 4096  # an address the write fails at (EFAULT)
    slot[0] = 20 * 4 + lane.SPLIT_ACTIVE
    assert k.help_split(a, 20, big.ctypes.data, n) == 0  # its first write failed: it stops
    assert _claims(slot) == (0, 1) and slot[lane.S_FAILED // 8] == 1 and slot[lane.S_PUSHED // 8] == 1
    slot[0] = 20 * 4 + lane.SPLIT_OFFERED
    assert k.take(b, got.ctypes.data, n, CTX, 3, 0, 1) == PULLED and (got == big).all()
    assert _claims(slot) == (3, 1) and slot[0] == 20 * 4 + lane.SPLIT_FREE


def test_an_older_offer_is_taken_over_and_an_active_slot_is_not(pair):
    a, b = pair.addr(pair.a), pair.addr(pair.b)
    n = 2 * CHUNK
    first, second = data(n, 1), data(n, 2)
    k.announce_at(a, first.ctypes.data, n, CTX, 3, 5)
    k.announce_at(a, second.ctypes.data, n, CTX, 3, 5 + lane.SPLIT_SLOTS)  # the same slot, still offered to 5
    slot = _slot(pair, 5)
    assert slot[0] == (5 + lane.SPLIT_SLOTS) * 4 + lane.SPLIT_OFFERED
    got = np.zeros(n, np.uint8)
    assert k.take(b, got.ctypes.data, n, CTX, 3, 0, 1) == PULLED and (got == first).all()  # 5: read alone
    assert slot[0] == (5 + lane.SPLIT_SLOTS) * 4 + lane.SPLIT_OFFERED  # left for the newer id
    slot[0] = (5 + lane.SPLIT_SLOTS) * 4 + lane.SPLIT_ACTIVE
    third = data(n, 3)
    k.announce_at(a, third.ctypes.data, n, CTX, 3, 5 + 2 * lane.SPLIT_SLOTS)
    assert slot[0] == (5 + lane.SPLIT_SLOTS) * 4 + lane.SPLIT_ACTIVE  # a transfer holds it: no offer


@pytest.mark.parametrize("blocking", [False, True])
def test_both_copy_at_once_from_two_threads(pair, blocking):
    a, b = pair.addr(pair.a), pair.addr(pair.b)
    n = 256 * CHUNK + 11  # 32 MiB: long enough for the sender to join
    big, got = data(n, 5), np.zeros(n, np.uint8)
    rid = 30
    k.announce_at(a, big.ctypes.data, n, CTX, 3, rid)
    results = {}
    go = threading.Event()

    def receive():
        go.wait()
        results["take"] = k.take(b, got.ctypes.data, n, CTX, 3, 0, 1)

    t = threading.Thread(target=receive)
    t.start()
    written = 0
    go.set()
    if blocking:  # a blocking Send's wait for its acknowledgement writes chunks meanwhile
        assert k.await_ack(a, CTX, 3, rid, 1 << 40, big.ctypes.data, n) == 1
    else:  # the engine's wait calls help_split
        while t.is_alive():
            written += k.help_split(a, rid, big.ctypes.data, n)
    t.join()
    assert results["take"] == PULLED and (got == big).all()
    front, back = _claims(_slot(pair, rid))
    assert front + back == 257 and _slot(pair, rid)[lane.S_PUSHED // 8] == back
    if not blocking:
        assert written == back
    print(f"receiver read {front} chunks, sender wrote {back}")


@pytest.mark.ranks
def test_large_messages_between_two_ranks_with_the_sender_helping(tmp_path):
    res = harness.run_cases(2, ["p2p.split_*"], transport="shm", out_dir=str(tmp_path), job_timeout=120)
    res.assert_ok()
    helped = res.records("p2p.split_every_call", "split_chunks")
    print("chunks the senders wrote:", helped)
    assert set(helped) == {0, 1}
