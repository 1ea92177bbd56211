"""Gatherv and Scatterv by cross-memory attach (``direct_cma``): every rank chooses alike though only the root knows
the block sizes, and the root's program makes every copy, at the displacements only it knows, after checking the
byte counts the others post."""

from __future__ import annotations

import numpy as np
import pytest

from pycoll.algorithms import direct_cma, registry
from pycoll.algorithms.base import Call, Layout
from pycoll.transport.arena import RECV, SEND

F4 = np.dtype(np.float32)
COUNTS, DISPLS = [3, 0, 5], [6, 0, 0]  # uneven, a zero block, blocks out of rank order


def _calls(coll: str, root: int = 0) -> list[Call]:
    """Rank r's view of one vector call on 3 ranks: the root has the counts and displacements, the others their
    own block only."""
    out = []
    for r in range(3):
        mine = np.zeros(COUNTS[r], np.float32)
        if r == root:
            whole = np.zeros(11, np.float32)
            send, recv = (mine, whole) if coll == "gather" else (whole, mine)
            out.append(Call(coll, F4, send, recv, root=root, counts=COUNTS, displs=DISPLS, vector=True))
        else:
            send, recv = (mine, None) if coll == "gather" else (None, mine)
            out.append(Call(coll, F4, send, recv, root=root, vector=True))
    return out


@pytest.mark.parametrize("coll", ["gather", "scatter"])
def test_every_rank_chooses_the_same_algorithm_though_their_sizes_differ(coll, monkeypatch):
    monkeypatch.setattr(direct_cma, "refuse_single_host", lambda call, lay: None)  # as where the arena is on
    calls = _calls(coll)
    assert len({c.size_bytes for c in calls}) > 1  # the sizes the ranks see differ, so no size can decide
    one_host = Layout.flat(3)
    assert [registry.select(c, one_host).name for c in calls] == ["cma"] * 3
    monkeypatch.setattr(direct_cma, "refuse_single_host", lambda call, lay: "the ranks are on more than one host")
    assert [registry.select(c, one_host).name for c in calls] == ["linear"] * 3


def test_alltoallv_is_still_refused():
    call = Call("alltoall", F4, np.zeros(3, np.float32), np.zeros(3, np.float32), counts=[1, 1, 1],
                displs=[0, 1, 2], send_counts=[1, 1, 1], send_displs=[0, 1, 2], vector=True)
    assert "displacements" in direct_cma._refuse(call, Layout.flat(3))


@pytest.mark.parametrize("coll,word,write", [("gather", SEND, 0), ("scatter", RECV, 1)])
def test_the_root_copies_every_block_at_its_displacement_after_checking_its_size(coll, word, write):
    moves = direct_cma.MOVES[coll]
    calls = _calls(coll, root=2)
    root = moves.program(2, 3, calls[2])
    # rank 0's 3 floats at element 6, rank 1's empty block: no copy, but its posted size is still checked (0 bytes)
    assert root.rows.tolist() == [[0, word, 0, 2 if coll == "gather" else 1, 24, 12, write]]
    assert root.expect.tolist() == [12, 0, -1]
    assert root.waits.tolist() == []  # nobody copies into or out of the root's memory
    # its own block (5 floats at element 0) within its memory
    own = [1, 0, 2, 0, 20]
    assert root.copies.tolist() == [own]
    assert root.verb == ("write" if write else "read")
    for r, nbytes in ((0, 12), (1, 0)):
        prog = moves.program(r, 3, calls[r])
        assert len(prog.rows) == 0 and prog.nbytes == nbytes
        assert prog.expect.tolist() == [-1, -1, -1]
        assert prog.waits.tolist() == ([2] if nbytes else [])  # the root reads or writes its memory


def test_the_root_in_place_copies_nothing_of_its_own():
    call = _calls("gather", root=0)[0]
    call.send, call.in_place = None, True
    assert direct_cma.MOVES["gather"].program(0, 3, call).copies.tolist() == []
