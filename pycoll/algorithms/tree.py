"""Tree algorithms: double binary tree allreduce, and pipelined binary-tree broadcast and reduce."""

from __future__ import annotations

import functools
from typing import Optional

import numpy as np

from .base import Call, Layout, Schedule, Steps, binary_tree, blocks_of, concurrently, even_counts, pieces_of, unfinished
from .cost import CostModel, log2ceil
from .registry import register


class Tree:
    """One binary tree over a communicator's ranks, rank ``r`` at position ``position(r)``."""

    def __init__(self, p: int, rank_at: list[int]) -> None:
        parent, children = binary_tree(p)
        pos = {rank: x for x, rank in enumerate(rank_at)}
        self.parent = {rank: (rank_at[parent[x]] if parent[x] >= 0 else None) for rank, x in pos.items()}
        self.children = {rank: [rank_at[c] for c in children[x]] for rank, x in pos.items()}
        self.root = rank_at[0]


def rooted_tree(p: int, root: int) -> Tree:
    return Tree(p, [(root + x) % p for x in range(p)])


def double_tree(p: int) -> tuple[Tree, Tree]:
    """Two trees in which no rank is interior twice: the second mirrors the first (even p) or shifts it by one (odd p).

    The first tree's leaves are the odd ranks; in the second, the odd ranks land on even positions, so
    each rank forwards data in at most one tree (Sanders, Speck and Traeff's two-tree scheme).
    """
    first = Tree(p, list(range(p)))
    second = Tree(p, [p - 1 - x for x in range(p)] if p % 2 == 0 else [(x + 1) % p for x in range(p)])
    return first, second


def reduce_up(st: Steps, tree: Tree, ins: list[np.ndarray], acc: list[np.ndarray], op,
              done: Optional[list[np.ndarray]] = None) -> Schedule:
    """Pipelined reduction of ``ins`` (k pieces) towards the root; the root's sums land in ``done``.

    Interior ranks keep partial sums in ``acc``: the first child's pieces reduce on arrival, the
    second child's land in the other half of ``acc``'s pair and are folded in once both are there.
    """
    r = st.rank
    parent, kids = tree.parent[r], tree.children[r]
    k = len(ins)
    if st.now and k == 1:  # one message per edge: straight through the sockets where they can go so
        if kids:
            got = st.recv_reduce_now(kids[0], ins[0], acc[0], op)
            if got is not None:
                yield (got,)
            for kid in kids[1:]:
                spare = st.mem.scratch(acc[0].shape[0], acc[0].dtype)
                got = st.recv_now(kid, spare)
                if got is not None:
                    yield (got,)
                st.mem.reduce(op, acc[0], spare, acc[0])
                st.mem.release(spare)
            result = acc[0]
        else:
            result = ins[0]
        if parent is not None:
            sent = st.send_now(parent, result)
            if sent is not None:
                yield (sent,)
        elif done is not None:
            st.mem.copy(done[0], result)
        return
    sends = []
    if not kids:
        if parent is not None:
            sends = [st.send(parent, piece) for piece in ins]
        elif done is not None:
            for dst, src in zip(done, ins):
                st.mem.copy(dst, src)
        yield tuple(sends)
        return
    spare = st.mem.scratch(sum(a.shape[0] for a in acc), acc[0].dtype) if len(kids) > 1 else None
    spares = blocks_of(spare, [a.shape[0] for a in acc]) if spare is not None else []
    firsts = [st.recv_reduce(kids[0], ins[c], acc[c], op) for c in range(k)]
    seconds = [st.recv(kids[1], spares[c]) for c in range(k)] if spare is not None else []
    for c in range(k):
        yield (firsts[c], seconds[c]) if seconds else (firsts[c],)
        if seconds:
            st.mem.reduce(op, acc[c], spares[c], acc[c])
        if parent is not None:
            sends.append(st.send(parent, acc[c]))
        elif done is not None:
            st.mem.copy(done[c], acc[c])
    yield tuple(sends)
    if spare is not None:
        st.mem.release(spare)


def broadcast_down(st: Steps, tree: Tree, pieces: list[np.ndarray], have: Optional[list] = None) -> Schedule:
    """Pipelined broadcast of ``pieces`` from the root; ``have`` (root only) are requests that fill them first."""
    r = st.rank
    parent, kids = tree.parent[r], tree.children[r]
    if st.now and len(pieces) == 1 and not have:  # one message: straight through the sockets where it can go so
        got = st.recv_now(parent, pieces[0]) if parent is not None else None
        if got is not None:
            yield (got,)
        sends = unfinished(*(st.send_now(kid, pieces[0]) for kid in kids))
        if sends:
            yield sends
        return
    arriving = [st.recv(parent, piece) for piece in pieces] if parent is not None else list(have or [])
    sends = []
    for c, piece in enumerate(pieces):
        if c < len(arriving):
            yield (arriving[c],)
        sends.extend(st.send(kid, piece) for kid in kids)
    yield tuple(sends)


def _tree_allreduce(st: Steps, tree: Tree, ins: list[np.ndarray], acc: list[np.ndarray], outs: list[np.ndarray],
                    op, size: int) -> Schedule:
    at_root = tree.parent[st.rank] is None
    yield from reduce_up(st, tree, ins, acc, op, done=outs if at_root else None)
    if at_root and op.averages:
        for piece in outs:
            st.mem.scale(piece, size)
    yield from broadcast_down(st, tree, outs)


def _tree_cost(m: CostModel, n: float, lay: Layout) -> float:
    depth = log2ceil(lay.size + 1)
    k = m.messages(n / 2)
    # up and down each tree: depth steps plus one per further chunk; a rank sends about 2n in all
    wire = _double_tree_wire(lay) * n if lay.hosts > 1 else None
    # not priced as a pipeline across hosts (no ``depth``): its two trees' lanes take turns in one engine, so their
    # folds do not hide behind the link (2 ranks on 2 hosts, 16 MiB: 16.98 ms against the ring's 16.06 at 10 Gbit/s,
    # 9.5 against 8.0-8.7 unshaped)
    return m.phase(lay, 2 * (depth + k - 1), 2 * n, reduced=n, flows=m.flows(lay), messages=6 * k, wire=wire)


@functools.lru_cache(maxsize=32)
def _double_tree_wire(lay: Layout) -> float:
    """Bytes per vector byte that leave the busiest host in a double-tree allreduce: each tree edge carries
    half the vector up (from the child's host) and half down (from the parent's)."""
    out = [0.0] * lay.hosts
    host = lay.host_of
    for tree in double_tree(lay.size):
        for child, parent in tree.parent.items():
            if parent is not None and host[child] != host[parent]:
                out[host[child]] += 0.5
                out[host[parent]] += 0.5
    return max(out)


@functools.lru_cache(maxsize=32)
def _rooted_tree_wire(lay: Layout, down: bool) -> float:
    """Vectors that leave the busiest host in a binary tree rooted at rank 0: one per edge that crosses hosts,
    sent by the parent's host (``down``, broadcast) or the child's (reduce)."""
    out = [0.0] * lay.hosts
    host = lay.host_of
    tree = rooted_tree(lay.size, 0)
    for child, parent in tree.parent.items():
        if parent is not None and host[child] != host[parent]:
            out[host[parent] if down else host[child]] += 1.0
    return max(out)


@functools.lru_cache(maxsize=32)
def _rooted_tree_folds(lay: Layout) -> float:
    """Vectors a reduce tree rooted at rank 0 folds on its busiest host (one per child of an interior rank; the leaves
    fold none), per rank of the largest host: what ``phase`` takes as ``reduced``, which it stretches by the ranks on
    a core. An interior rank's own 2 vectors there would charge the leaves' folds too (4 ranks on 2 hosts of one
    core, 10 Gbit/s, 512 KiB: the tree took 765 µs and was priced 1430, against the chain's 1108 and 1280)."""
    folds = [0.0] * lay.hosts
    tree = rooted_tree(lay.size, 0)
    for rank, kids in tree.children.items():
        folds[lay.host_of[rank]] += len(kids)
    return max(folds) / max(lay.local_sizes)


@register(
    "allreduce",
    "tree",
    "Double binary tree: each half of the vector is reduced up one tree and broadcast down it, pipelined in chunks.",
    steps="2(log2 p + chunks)",
    bytes="2 n (each rank forwards in one tree)",
    cost=lambda m, n, lay: _tree_cost(m, n, lay) if lay.size > 1 else 0.0,
)
def allreduce_tree(st: Steps, call: Call) -> Schedule:
    assert call.send is not None and call.recv is not None and call.op is not None
    p = st.size
    if p == 1:
        st.mem.copy(call.recv, call.send)
        return
    halves = even_counts(call.recv.shape[0], 2)
    k = st.num_chunks(call.recv[: halves[0]].nbytes)
    scratch = st.mem.scratch(call.recv.shape[0], call.dtype)
    trees = double_tree(p)
    runs = []
    for i, (tree, ins, acc, outs) in enumerate(
        zip(trees, blocks_of(call.send, halves), blocks_of(scratch, halves), blocks_of(call.recv, halves))
    ):
        runs.append(_tree_allreduce(st.lane(1 + i), tree, pieces_of([ins], k), pieces_of([acc], k),
                                    pieces_of([outs], k), call.op, p))
    yield from concurrently(*runs)
    st.mem.release(scratch)


@register(
    "broadcast",
    "tree",
    "Pipelined binary tree from the root: log2 p deep, so small messages arrive in few steps.",
    steps="log2 p + chunks",
    bytes="2 n at interior ranks",
    cost=lambda m, n, lay: m.phase(lay, log2ceil(lay.size + 1) + m.messages(n) - 1, 2 * n, flows=m.flows(lay),
                                   messages=2 * m.messages(n), depth=log2ceil(lay.size + 1),
                                   wire=_rooted_tree_wire(lay, True) * n if lay.hosts > 1 else None) if lay.size > 1 else 0.0,
)
def broadcast_tree(st: Steps, call: Call) -> Schedule:
    assert call.recv is not None
    if st.size == 1:
        return
    yield from broadcast_down(st, rooted_tree(st.size, call.root), pieces_of([call.recv], st.num_chunks(call.recv.nbytes)))


@register(
    "reduce",
    "tree",
    "Pipelined binary tree towards the root: log2 p deep; interior ranks fold two children per chunk.",
    steps="log2 p + chunks",
    bytes="n",
    cost=lambda m, n, lay: m.phase(lay, log2ceil(lay.size + 1) + m.messages(n) - 1, n,
                                   reduced=(_rooted_tree_folds(lay) if lay.hosts > 1 else 2) * n,
                                   flows=m.flows(lay), messages=2 * m.messages(n), depth=log2ceil(lay.size + 1),
                                   wire=_rooted_tree_wire(lay, False) * n if lay.hosts > 1 else None) if lay.size > 1 else 0.0,
)
def reduce_tree(st: Steps, call: Call) -> Schedule:
    assert call.send is not None and call.op is not None
    p, r = st.size, st.rank
    at_root = r == call.root
    if p == 1:
        assert call.recv is not None
        st.mem.copy(call.recv, call.send)
    else:
        tree = rooted_tree(p, call.root)
        k = st.num_chunks(call.send.nbytes)
        ins = pieces_of([call.send], k)
        # the root folds straight into its result (the chain's way), not into scratch copied there after
        folds_into_recv = at_root and call.recv is not None
        acc = None if folds_into_recv or not tree.children[r] else st.mem.scratch(call.send.shape[0], call.dtype)
        accs = pieces_of([call.recv if folds_into_recv else acc], k) if tree.children[r] else []
        yield from reduce_up(st, tree, ins, accs, call.op)
        if acc is not None:
            st.mem.release(acc)
    if at_root and call.op.averages:
        assert call.recv is not None
        st.mem.scale(call.recv, p)
