"""A composed call's failure, raised as the user's call: the inner step found from the traceback, ranks renumbered."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from pycoll import errors
from pycoll.composed_failures import as_outer_call, guarded, step_of


class _Inner:
    """An inner communicator: world ranks of its members, an engine that records aborts."""

    def __init__(self, world: list[int], seq: int = 0) -> None:
        self._world, self._size, self._ctx, self._seq = world, len(world), 8, seq
        self.aborted: list[Any] = []
        self._engine = SimpleNamespace(
            request_abort=lambda ctx, err, members, first: self.aborted.append((ctx, members, first)))

    def Reduce(self, fail: BaseException) -> None:  # noqa: N802 - as the communicator's method
        raise fail


def _parent(world: list[int], rank: int, seq: int) -> Any:
    return SimpleNamespace(_to_comm={w: i for i, w in enumerate(world)}, _rank=rank, _seq=seq)


def test_a_failed_step_is_raised_as_the_users_call_in_its_numbering() -> None:
    """World ranks 10-13 make the parent (ranks 0-3); the host of parent ranks 2 and 3 is the step that failed,
    its rank 1 (parent rank 3) the peer: the error keeps its class, names the parent's call and number, this rank
    and peer 3, and says which step among which ranks; every inner communicator of this rank is broken."""
    parent = _parent([10, 11, 12, 13], rank=2, seq=7)
    host, leaders = _Inner([12, 13]), _Inner([10, 12])
    inner_err = errors.MismatchError("rank 1 called Reduce(count=5), this rank count=4", op="Reduce #3", rank=0,
                                     peers=[1])
    with pytest.raises(errors.MismatchError) as caught:
        guarded(parent, "Allreduce", (host, leaders, None), lambda s, r: host.Reduce(inner_err), None, None)
    err = caught.value
    assert (err.op, err.rank, err.peers) == ("Allreduce #7", 2, (3,))
    assert err.cause.startswith("rank 1 called Reduce(count=5)")
    assert "[in its step Reduce #3 among ranks 2, 3 (numbered 0-1 there)" in err.cause
    assert err.__cause__ is inner_err
    assert host.aborted and leaders.aborted  # both broken, so the other hosts' ranks fail at once


def test_each_inner_communicator_is_broken_from_the_first_call_the_composed_call_makes_on_it() -> None:
    """The host's step ran (its call #4 failed) before the leaders' (#10 next, not reached): each is broken from the
    call number this composed call began on it, not for all its calls, so a peer that reaches its step on the
    leaders' communicator after the report fails that call with the report's own error (a mismatch stays one),
    not as a communicator broken earlier, and calls that every rank finished before stay done."""
    parent = _parent([0, 1, 2, 3], rank=1, seq=5)
    host, leaders = _Inner([0, 1], seq=3), _Inner([0, 2], seq=9)
    inner_err = errors.MismatchError("counts differ", op="Reduce #4", rank=1, peers=[0])

    def part(send: Any, recv: Any) -> None:
        host._seq += 1  # the step's call takes the host communicator's next number
        host.Reduce(inner_err)

    with pytest.raises(errors.MismatchError):
        guarded(parent, "Allreduce", (host, leaders, None), part, None, None)
    assert host.aborted == [(8, [0, 1], 4)] and leaders.aborted == [(8, [0, 2], 10)]


def test_a_contained_failure_breaks_nothing_and_keeps_its_flag() -> None:
    parent = _parent([0, 1, 2, 3], rank=0, seq=1)
    host = _Inner([0, 1])
    inner_err = errors.MismatchError("counts differ", op="Bcast #2", rank=0, peers=[1])
    inner_err.contained = True  # type: ignore[attr-defined]
    with pytest.raises(errors.MismatchError) as caught:
        guarded(parent, "Bcast", (host,), lambda s, r: host.Reduce(inner_err), None, None)
    assert getattr(caught.value, "contained", False) and not host.aborted
    assert caught.value.peers == (1,)


def test_an_error_from_no_inner_call_keeps_no_peers_it_cannot_renumber() -> None:
    """Where no frame of the traceback runs an inner communicator's method, the peers (numbered in an unknown
    communicator) are left out rather than misnamed; the step's name and its cause stay."""
    parent = _parent([0, 1, 2, 3], rank=1, seq=4)
    host = _Inner([0, 1])

    def elsewhere(send: Any, recv: Any) -> None:
        raise errors.TimeoutError("Timed out after 2 s waiting for rank 1", op="Recv(source=1, tag=0)", rank=0,
                                  peers=[1])

    assert step_of(ValueError(), (host,)) is None
    with pytest.raises(errors.TimeoutError) as caught:
        guarded(parent, "Reduce", (host,), elsewhere, None, None)
    assert (caught.value.op, caught.value.rank, caught.value.peers) == ("Reduce #4", 1, ())
    assert "[in its step Recv(source=1, tag=0) on a communicator inside the call" in caught.value.cause


def test_a_class_with_its_own_constructor_falls_back_to_the_base_class() -> None:
    class Odd(errors.PycollError):
        def __init__(self, what: str) -> None:
            super().__init__(what)

    parent, host = _parent([0, 1], rank=0, seq=2), _Inner([0, 1])
    out = as_outer_call(Odd("broke"), parent, "Barrier", host)
    assert type(out) is errors.PycollError and out.op == "Barrier #2" and "broke" in out.cause
