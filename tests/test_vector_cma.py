"""Gatherv, Scatterv and Alltoallv on the arena (``direct_cma``): every rank chooses alike though the ranks do not
all know the blocks' sizes, and a rank takes each block through its sender's table (offset and size), after checking
the size there."""

from __future__ import annotations

import numpy as np
import pytest

from pycoll.algorithms import cma_program, direct_cma, registry
from pycoll.algorithms.base import Call, Layout

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


def _alltoallv(r: int) -> Call:
    """Rank r of 3 in an Alltoallv: it sends q + 1 elements to rank q (block q at 4 * q), receives r + 1 from each
    rank (block q at (r + 1) * q)."""
    return Call("alltoall", F4, np.zeros(12, np.float32), np.zeros(3 * (r + 1), np.float32),
                counts=[r + 1] * 3, displs=[(r + 1) * q for q in range(3)],
                send_counts=[q + 1 for q in range(3)], send_displs=[4 * q for q in range(3)], vector=True)


def test_alltoallv_chooses_alike_and_reads_its_blocks_through_the_senders_tables(monkeypatch):
    monkeypatch.setattr(direct_cma, "refuse_single_host", lambda call, lay: None)
    assert [registry.select(_alltoallv(r), Layout.flat(3)).name for r in range(3)] == ["cma"] * 3
    prog = direct_cma.MOVES["alltoall"].program(1, 3, _alltoallv(1))
    # its table: (byte offset, bytes) of its block for each rank, for the readers
    assert prog.table.tolist() == [[0, 4], [16, 8], [32, 12]]
    # a row per peer, through the peer's table (no offset of its own), into its block q at 2 * q elements
    assert prog.rows.tolist() == [[0, cma_program.TABLE_ROW, 0, 2, 0, 8, 0], [2, cma_program.TABLE_ROW, 0, 2, 16, 8, 0]]
    assert prog.copies.tolist() == [[1, 16, 2, 8, 8]]  # its own block, locally
    assert prog.waits.tolist() == [0, 2]  # both read its buffer (no slot)
    # with 8-byte slot blocks rank 0's 4 bytes lie in the slot: only rank 2 reads its buffer
    assert direct_cma.MOVES["alltoall"].program(1, 3, _alltoallv(1), sub=8).waits.tolist() == [2]
    monkeypatch.setattr(direct_cma, "refuse_single_host", lambda call, lay: "the ranks are on more than one host")
    assert registry.select(_alltoallv(0), Layout.flat(3)).name == "pairwise"


def test_the_kernel_and_python_agree_on_the_table_layout():
    kernels = pytest.importorskip("pycoll.algorithms._arena_kernels")
    assert kernels.TABLE_ROW == cma_program.TABLE_ROW
    assert cma_program.table_head_bytes(3) == 64 and cma_program.table_head_bytes(5) == 128
    assert cma_program.table_block_bytes(64 << 10, 2) == 32704  # (64 KiB - one line) / 2, to whole lines
    assert cma_program.table_block_bytes(64 << 10, 4096) == 0  # no room beside a 64 KiB table


def test_gatherv_blocks_go_through_the_slot_or_are_written_where_the_roots_table_says():
    moves, calls = direct_cma.MOVES["gather"], _calls("gather", root=2)
    row = cma_program.TABLE_ROW
    # blocks up to 64 bytes in the senders' slots: the root copies each out after checking its size (0 bytes too)
    root = moves.program(2, 3, calls[2], sub=64)
    assert root.rows.tolist() == [[0, row, 0, 2, 24, 12, 0], [1, row, 0, 2, 0, 0, 0]]
    assert root.copies.tolist() == [[1, 0, 2, 0, 20]]  # its own 5 floats to element 0
    assert root.waits.tolist() == [] and root.table.tolist() == [[0, 0]] * 3  # nobody copies into the root
    for r, nbytes in ((0, 12), (1, 0)):
        prog = moves.program(r, 3, calls[r], sub=64)
        assert len(prog.rows) == 0 and prog.table.tolist() == [[0, 0], [0, 0], [0, nbytes]]  # for the root to check
        assert prog.waits.tolist() == []  # its block lies in its slot: it leaves without waiting for the root
    # no slot: rank 0 writes its 12 bytes at the place the root's table gives; the root checks the size and waits
    root = moves.program(2, 3, calls[2], sub=0)
    assert root.table.tolist() == [[24, 12], [0, 0], [0, 0]]
    assert root.rows.tolist() == [[0, row, 0, 0, 0, 12, 0], [1, row, 0, 2, 0, 0, 0]]  # which 0: a size check only
    assert root.waits.tolist() == [0]
    sender = moves.program(0, 3, calls[0], sub=0)
    assert sender.rows.tolist() == [[2, row, 0, 1, 0, 12, 1]] and sender.verb == "write"
    assert sender.waits.tolist() == [] and sender.table.tolist() == [[0, 0], [0, 0], [0, 12]]


def test_a_large_gatherv_block_is_split_between_its_sender_and_the_root():
    """As in the uniform Gather: from SPLIT_BYTES the root reads the head of a block from its sender's buffer while
    the sender writes the rest; both check the whole block's size."""
    n = 1 << 18  # floats: 1 MiB blocks
    calls = [Call("gather", F4, np.zeros(n, np.float32), np.zeros(2 * n, np.float32), root=0, counts=[n, n],
                  displs=[0, n], vector=True),
             Call("gather", F4, np.zeros(n, np.float32), None, root=0, vector=True)]
    head = direct_cma.root_share(4 * n, 2, direct_cma.GATHER_ROOT_SHARE)
    assert 0 < head < 4 * n and head % 4096 == 0
    sender = direct_cma.MOVES["gather"].program(1, 2, calls[1], sub=64)
    assert sender.rows.tolist() == [[0, cma_program.TABLE_ROW, head, 1, head, 4 * n - head, 1]]
    assert sender.waits.tolist() == [0]  # the root reads its head
    root = direct_cma.MOVES["gather"].program(0, 2, calls[0], sub=64)
    assert root.rows.tolist() == [[1, cma_program.TABLE_ROW, 0, 0, 0, 4 * n, 0],  # the size check
                                  [1, direct_cma.SEND, 0, 2, 4 * n, head, 0]]  # the head, into its place
    assert root.waits.tolist() == [1] and root.table.tolist() == [[0, 0], [4 * n, 4 * n]]  # where rank 1 writes


@pytest.mark.parametrize("sub,waits", [(0, [0]), (64, [])])
def test_scatterv_readers_find_their_blocks_in_the_roots_table(sub, waits):
    moves, calls = direct_cma.MOVES["scatter"], _calls("scatter", root=2)
    root = moves.program(2, 3, calls[2], sub=sub)
    assert root.table.tolist() == [[24, 12], [0, 0], [0, 0]]  # rank 0's block at element 6, rank 1's empty
    assert len(root.rows) == 0 and root.copies.tolist() == [[1, 0, 2, 0, 20]]
    assert root.waits.tolist() == waits  # rank 0 reads its block from the root's buffer, unless it lies in the slot
    for r, nbytes in ((0, 12), (1, 0)):
        prog = moves.program(r, 3, calls[r], sub=sub)
        assert prog.rows.tolist() == [[2, cma_program.TABLE_ROW, 0, 2, 0, nbytes, 0]]
        assert prog.waits.tolist() == []


def test_the_root_in_place_copies_nothing_of_its_own():
    call = _calls("gather", root=0)[0]
    call.send, call.in_place = None, True
    assert direct_cma.MOVES["gather"].program(0, 3, call).copies.tolist() == []
