"""Failure reports inside one engine (loopback channel): lost peers, mismatches, aborts from a thread, stall reports."""

from __future__ import annotations

import logging
import os
import threading
import time

import numpy as np
import pytest

from pycoll.errors import AbortedError, MismatchError, PeerFailureError, PeerLostError, PeerMismatchError
from pycoll.p2p import Engine
from pycoll.p2p_protocol import ABORT_TAG, HEADER, HEADER_SIZE, MAGIC, P2P_SIG, RTS, Owner, Sig
from pycoll.transport.loopback import LoopbackChannel


def _owner(op: str, ctx: int = 2, tag: int = 5) -> Owner:
    return Owner(op, ctx | 1, 0, lambda w: w, [0, 1], tag=tag)


def _engine() -> Engine:
    # Rank 0 with a "peer" 1 whose channel loops back: what we send to 1 arrives as if from 1.
    return Engine(0, {1: LoopbackChannel(1)})


def test_a_lost_peer_is_named_by_every_survivor() -> None:
    eng = _engine()
    waiting = _owner("Allreduce #5")
    r = eng.irecv(1, np.empty(4), waiting.ctx, 5, Sig(kind=1), waiting)
    # "rank 1" reports that rank 3 died in its Bcast #5 of this communicator
    reporter = Owner("Bcast #5", waiting.ctx, 1, lambda w: w, [0, 1], tag=5)
    eng._tell_members(reporter, PeerFailureError("rank 3 exited during the call", op="Bcast #5", rank=1, peers=[3]), ABORT_TAG, 2)
    eng.wait_requests([r], 5.0, waiting)
    assert isinstance(r.error, PeerLostError) and isinstance(r.error, PeerFailureError)
    assert r.error.peers == (3,) and r.error.op == "Allreduce #5" and "rank 3 failed" in str(r.error)


class _ResetAfterReport(LoopbackChannel):
    """Rank 1 announced a message, reported rank 3's death and exited: its stream still reads, replies are reset."""

    peer_pid = os.getpid()
    reset = False

    def send_some(self, data):
        if self.reset:
            raise PeerFailureError("connection to rank 1 failed: [Errno 104] Connection reset by peer", peers=[1])
        return super().send_some(data)


def test_a_survivor_that_reported_a_death_and_exited_is_not_blamed() -> None:
    ch = _ResetAfterReport(1)
    eng = Engine(0, {1: ch})
    owner = Owner("Recv", 2, 0, lambda w: w, [0, 1], tag=-1)
    src = np.arange(4096, dtype=np.uint8)
    got, later = np.zeros(4096, np.uint8), np.zeros(8, np.uint8)
    first = eng.irecv(1, got, 2, 7, P2P_SIG, owner)
    never = eng.irecv(1, later, 2, 8, P2P_SIG, owner)
    # rank 1's stream: an announced message (this rank acknowledges it), then its report that rank 3 died
    ch.send_some(memoryview(HEADER.pack(2, 7, src.nbytes, RTS | (MAGIC << 24), 0, src.ctypes.data, 1).ljust(HEADER_SIZE, b"\0")))
    reporter = Owner("Bcast #5", 3, 1, lambda w: w, [0, 1], tag=5)
    eng._tell_members(reporter, PeerFailureError("rank 3 exited during the call", op="Bcast #5", rank=1, peers=[3]), ABORT_TAG, 2)
    ch.reset = True  # the acknowledgement is the first reply that fails
    eng.progress()
    assert first.done and never.done
    # the failed reply did not cut the stream short: its report was read, and names the rank that died
    assert isinstance(never.error, PeerLostError) and never.error.peers == (3,), never.error
    assert first.error is None or isinstance(first.error, PeerLostError), first.error
    assert 1 in eng.dead_peers()


def test_a_mismatch_found_elsewhere_is_a_mismatch_here() -> None:
    eng = _engine()
    waiting = _owner("Allreduce #5")
    r = eng.irecv(1, np.empty(4), waiting.ctx, 5, Sig(kind=1), waiting)
    reporter = Owner("Allreduce #5", waiting.ctx, 1, lambda w: w, [0, 1], tag=5)
    found = MismatchError("rank 2 called Bcast(root 0), this rank called Allreduce(float64 x 4, SUM)", op="Allreduce #5", rank=1, peers=[2])
    eng._tell_members(reporter, found, ABORT_TAG, 2)
    eng.wait_requests([r], 5.0, waiting)
    assert isinstance(r.error, PeerMismatchError) and isinstance(r.error, MismatchError)
    text = str(r.error)
    assert "rank 2 called Bcast" in text and "rank 1 called Allreduce" in text and "found by rank 1" in text
    assert set(r.error.peers) == {1, 2}


def test_abort_from_another_thread_ends_a_wait_promptly() -> None:
    eng = _engine()
    waiting = _owner("Recv #5")
    r = eng.irecv(1, np.empty(4), waiting.ctx, 5, None, waiting)  # nothing will ever come
    err = AbortedError("Comm.Abort(1) was called on rank 0", op="Abort of world", rank=0)
    fired: list[float] = []

    def abort() -> None:
        time.sleep(0.2)
        fired.append(time.monotonic())
        assert eng.request_abort(2, err, [0, 1]) is False  # the waiting thread holds the engine: it acts

    threading.Thread(target=abort).start()
    eng.wait_requests([r], 30.0, waiting)
    took = time.monotonic() - fired[0]
    assert isinstance(r.error, AbortedError) and r.error.op == "Recv #5" and took < 0.5
    assert eng.broken(2) is not None


def test_abort_when_idle_acts_at_once() -> None:
    eng = _engine()
    err = AbortedError("Comm.Abort(1) was called on rank 0", op="Abort of world", rank=0)
    assert eng.request_abort(2, err, [0, 1]) is True
    assert eng.broken(2) is err
    r = eng.irecv(1, np.empty(4), 3, 6, None, _owner("Recv #6"))
    assert isinstance(r.error, AbortedError)


def test_stall_report_names_the_missing_rank_and_gets_its_answer(monkeypatch, caplog) -> None:
    monkeypatch.setenv("PYCOLL_STALL_WARN", "0.3")
    eng = _engine()
    waiting = _owner("Allreduce #9", tag=9)
    r = eng.irecv(1, np.empty(4), waiting.ctx, 9, None, waiting)
    with caplog.at_level(logging.WARNING, logger="pycoll"):
        with pytest.raises(Exception):
            eng.wait_requests([r], 1.0, waiting)  # times out after the report
    text = caplog.text
    assert "stall: Allreduce #9 on world rank 0" in text and "rank 1 (world 1)" in text
    # the question went to "rank 1" (looped back here), which answered with the operation it waits in
    assert "world rank 1 answers: in Allreduce #9" in text


def test_a_probe_answer_with_another_signature_is_a_mismatch() -> None:
    """Both sides wait (no data flows): the peer's answer to the idle probe names its call; a different
    signature for the same call number fails this rank's call with MismatchError naming both."""
    from pycoll.p2p_protocol import Schedule

    eng = _engine()
    mine, theirs = Sig(4, 1, 0, 0, 64, 0), Sig(4, 1, 0, 1, 64, 0)  # the same Reduce, roots 0 and 1
    own = _owner("Reduce #5")
    own.sig = mine
    own.describe = lambda s: f"reduce(root={s.root})"

    def waits():
        yield (eng.irecv(1, np.empty(4), own.ctx, 5 * 4096, mine, own),)

    sched = eng.start(Schedule(waits(), own))
    eng._compare_calls(1, [[own.ctx, 5, list(mine)]])  # the same call: nothing happens
    assert not sched.done
    eng._compare_calls(1, [[own.ctx, 5, list(theirs)]])
    assert isinstance(sched.error, MismatchError)
    assert "rank 1 called reduce(root=1), this rank called reduce(root=0)" in str(sched.error)
