"""How a call composed across hosts fails: every inner communicator broken at once, and the error named as the user's call.

A composed call (``pycoll.composed``) runs as calls on each host's communicator, the hosts' leaders' and the rails'.
A step that fails on one rank breaks every inner communicator that rank belongs to, so that the ranks waiting in
the call's other steps, on other hosts too, fail at once with the cause. The error the user sees names the call
they made on their communicator (``Allreduce #3``), their rank and the peers in its numbering; the cause says in
which inner step it arose and which of the communicator's ranks took part in that step.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

from .errors import PycollError


def guarded(comm: Any, label: str, inner: Sequence[Any], part: Callable[[Any, Any], None], send: Any,
            recv: Any) -> None:
    """``part(send, recv)``, a rank's part of the composed call ``label`` on ``comm``, run on the ``inner``
    communicators; where a step fails here, every one of them this rank belongs to is broken (unless only that call
    failed and the communicators work), and the error is raised again as ``comm``'s call.

    Each is broken from the first call this composed call makes on it: a peer that has not yet reached its step
    there then fails that very call with this cause (a mismatch stays a mismatch), not as a communicator broken
    before it; the calls before, which every rank finished, stay as they were."""
    firsts = [None if sub is None else sub._seq + 1 for sub in inner]
    try:
        part(send, recv)
    except PycollError as err:
        if not getattr(err, "contained", False):  # contained: only this call failed, the communicators work
            for sub, first in zip(inner, firsts):
                if sub is not None and sub._size > 1:
                    sub._engine.request_abort(sub._ctx & ~1, err, list(sub._world), first)
        raise as_outer_call(err, comm, label, step_of(err, inner)) from err


def step_of(err: BaseException, inner: Sequence[Any]) -> Optional[Any]:
    """The inner communicator whose call raised ``err``: the outermost frame of its traceback that runs a method of
    one of them, of its executor or of one of its requests (None where none does)."""
    mine = {id(c): c for c in inner if c is not None}
    tb = err.__traceback__
    while tb is not None:
        owner = tb.tb_frame.f_locals.get("self")
        for candidate in (owner, getattr(owner, "comm", None), getattr(owner, "_comm", None)):
            if id(candidate) in mine:
                return mine[id(candidate)]
        tb = tb.tb_next
    return None


def as_outer_call(err: PycollError, comm: Any, label: str, step: Optional[Any]) -> PycollError:
    """``err``, raised in a step of the composed call ``label`` on an inner communicator ``step`` (None: not known),
    as an error of the same class on ``comm``'s call: its op, this rank and the peers in ``comm``'s numbering."""
    if step is not None:
        members = [comm._to_comm[w] for w in step._world]  # the step's ranks, in comm's numbering
        peers = [members[p] for p in err.peers if 0 <= p < len(members) and members[p] != comm._rank]
        among = f"among ranks {', '.join(map(str, members))} (numbered 0-{len(members) - 1} there)"
    else:
        peers, among = [], "on a communicator inside the call"
    cause = f"{err.cause} [in its step {err.op or 'a call'} {among}; the call is composed across hosts]"
    op = f"{label} #{comm._seq}"
    try:
        outer = type(err)(cause, op=op, rank=comm._rank, peers=peers)
    except TypeError:  # a class whose constructor takes other arguments
        outer = PycollError(cause, op=op, rank=comm._rank, peers=peers)
    for flag in ("contained", "timed_out"):
        if hasattr(err, flag):
            setattr(outer, flag, getattr(err, flag))
    return outer
