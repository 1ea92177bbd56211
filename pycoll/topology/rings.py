"""Ring order and double binary trees over a topology's devices: rings follow the fastest links, hosts stay contiguous.

``ring_order`` orders ranks host by host (so a ring crosses the network once per host boundary). Inside a
host it starts at the host's first rank and goes greedily to the nearest remaining device: the highest path
bandwidth, then the nearest path class, then the lowest index. When a host has at most ``EXACT_LIMIT``
distinct devices it then checks every ring and keeps a strictly better one, where better means a faster
slowest link, then a faster next-slowest link, and so on. Ranks on the same device (CPU ranks on one NUMA
node) are always neighbours.

``trees`` builds NCCL-like double binary trees: two binary trees over the hosts in which a host that is a leaf
in one is an inner node in the other (the second tree mirrors the first for an even host count and shifts
it by one for an odd one), and inside each host a chain in ring order whose head joins the trees.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Sequence

from .model import Device, Topology

EXACT_LIMIT = 8  # distinct devices per host up to which the whole ring search runs (7! = 5040 rings)


def _key(topo: Topology, a: Device, b: Device) -> tuple[float, int]:
    p = topo.path(a, b)
    return (-p.GBps, int(p.type))  # smaller is better


def _score(order: Sequence[int], key) -> list[tuple[float, int]]:
    """Edge keys of the closed ring ``order``, worst first (compare lists: the smaller, the better ring)."""
    edges = [key(order[i], order[(i + 1) % len(order)]) for i in range(len(order))] if len(order) > 1 else []
    return sorted(edges, reverse=True)


def _host_ring(topo: Topology, uniq: list[Device]) -> list[int]:
    memo: dict[tuple[int, int], tuple[float, int]] = {}

    def key(i: int, j: int) -> tuple[float, int]:
        if (i, j) not in memo:
            memo[(i, j)] = _key(topo, uniq[i], uniq[j])
        return memo[(i, j)]

    order, rest = [0], list(range(1, len(uniq)))
    while rest:
        nxt = min(rest, key=lambda j: (key(order[-1], j), j))
        order.append(nxt)
        rest.remove(nxt)
    if not 2 < len(uniq) <= EXACT_LIMIT:
        return order
    best = _score(order, key)
    if best[0] == min(key(i, j) for i in range(len(uniq)) for j in range(len(uniq)) if i != j):
        return order  # its slowest link is already the fastest link there is
    for perm in itertools.permutations(range(1, len(uniq))):
        score = _score((0, *perm), key)
        if score < best:
            best, order = score, [0, *perm]
    return order


def ring_order(topo: Topology, devices: Sequence[Device]) -> list[int]:
    """A ring over ``devices`` (one per rank) as indices into ``devices``: hosts in order and contiguous, and
    inside a host the order whose links are fastest (see the module's doc). Deterministic."""
    by_host: dict[int, list[int]] = {}
    for i, d in enumerate(devices):
        by_host.setdefault(d.host, []).append(i)
    order: list[int] = []
    for h in sorted(by_host):
        groups: dict[Device, list[int]] = {}
        for i in by_host[h]:
            groups.setdefault(devices[i], []).append(i)
        uniq = list(groups)
        for u in _host_ring(topo, uniq):
            order += groups[uniq[u]]
    return order


def comm_ring(topo: Topology, devices: Sequence[Device]) -> list[int]:
    """The ring a communicator of ranks on ``devices`` walks (indices into ``devices``; the runtime and `pycoll topo`
    both use it): ``ring_order``, except that a host whose ranks all run on CPUs keeps them in rank order (their
    NUMA nodes share memory, and the single-host algorithms and tuned costs assume rank order)."""
    by_host: dict[int, list[int]] = {}
    for i, d in enumerate(devices):
        by_host.setdefault(d.host, []).append(i)
    order: list[int] = []
    for h in sorted(by_host):
        mine = by_host[h]
        if all(devices[i].kind == "cpu" for i in mine):
            order += mine
        else:
            order += [mine[j] for j in ring_order(topo, [devices[i] for i in mine])]
    return order


def ring_bottleneck(topo: Topology, devices: Sequence[Device], order: Sequence[int]) -> tuple[int, int, float, str]:
    """The ring's slowest link: (from index, to index, GB/s, path class); of equally slow links the farthest
    class, then the first in ring order."""
    worst, worst_key = (0, 0, float("inf"), "LOC"), None
    for i in range(len(order)):
        a, b = order[i], order[(i + 1) % len(order)]
        p = topo.path(devices[a], devices[b])
        key = (p.GBps, -int(p.type))
        if worst_key is None or key < worst_key:
            worst, worst_key = (a, b, p.GBps, p.name), key
    return worst


def _btree_parents(n: int) -> list[int]:
    """Parent position of each position 0..n-1 in a balanced binary tree rooted at 0 (root: -1).

    Position p > 0 with lowest set bit b sits in in-order numbering: its children are p - b/2 and p + b/2; its
    parent is p + b or p - b, whichever has the lowest set bit 2b, or p - b when p + b is past the end. Position
    0 adopts the largest power of two below n."""
    parents = [-1] * n
    for p in range(1, n):
        b = p & -p
        up = p + b if (p // (2 * b)) % 2 == 0 else p - b
        parents[p] = up if up < n else p - b
    return parents


@dataclass
class DoubleTree:
    """Two binary trees over hosts (``parents[t][host]`` is the parent host, -1 at the root) and each host's chain
    of ranks (indices into the devices given to ``trees``), head first; ``labels`` name each rank's device."""

    hosts: list[int]
    parents: tuple[dict[int, int], dict[int, int]]
    chains: dict[int, list[int]]
    host_names: dict[int, str] = field(default_factory=dict)
    labels: list[str] = field(default_factory=list)

    def children(self, tree: int, host: int) -> list[int]:
        return [h for h in self.hosts if self.parents[tree][h] == host]

    def root(self, tree: int) -> int:
        return next(h for h in self.hosts if self.parents[tree][h] == -1)

    def __str__(self) -> str:
        name = lambda h: self.host_names.get(h, f"host{h}")  # noqa: E731
        lines = []
        if len(self.hosts) > 1:
            for t in (0, 1):
                edges = []
                stack = [self.root(t)]
                while stack:  # breadth first from the root
                    h = stack.pop(0)
                    kids = self.children(t, h)
                    if kids:
                        edges.append(f"{name(h)} > {' '.join(name(k) for k in kids)}")
                    stack += kids
                lines.append(f"tree {t} (root {name(self.root(t))}): " + "; ".join(edges))
        else:
            lines.append("one host: no tree between hosts")
        for h in self.hosts:
            chain = self.chains[h]
            shown = [self.labels[i] if self.labels else str(i) for i in chain]
            if len(shown) > 16:
                shown = shown[:8] + [f"... ({len(shown) - 12} more)"] + shown[-4:]
            lines.append(f"chain in {name(h)}: " + " > ".join(shown))
        return "\n".join(lines)


def trees(topo: Topology, devices: Sequence[Device]) -> DoubleTree:
    """NCCL-like double binary trees over the hosts of ``devices``, with a chain (in ring order) inside each host."""
    order = ring_order(topo, devices)
    chains: dict[int, list[int]] = {}
    for i in order:
        chains.setdefault(devices[i].host, []).append(i)
    hosts = list(chains)
    n = len(hosts)
    pos_parent = _btree_parents(n)
    first = {hosts[p]: (hosts[pos_parent[p]] if pos_parent[p] >= 0 else -1) for p in range(n)}
    # the second tree: host j takes position n-1-j (even n) or j-1 mod n (odd n) in the same shape
    pos2 = [(n - 1 - j) if n % 2 == 0 else (j - 1) % n for j in range(n)]
    host_at2 = {pos2[j]: hosts[j] for j in range(n)}
    second = {host_at2[p]: (host_at2[pos_parent[p]] if pos_parent[p] >= 0 else -1) for p in range(n)}
    labels = [label(topo, d, multi=False) for d in devices]
    return DoubleTree(hosts, (first, second), chains, {h: topo.hosts[h].name for h in hosts}, labels)


def label(topo: Topology, d: Device, multi: bool = False) -> str:
    """A device as `pycoll topo` prints it: GPU0, mlx5_0, numa1; with ``multi``, prefixed by its host's name."""
    what = f"GPU{d.id}" if d.kind == "gpu" else (f"numa{d.id}" if d.kind == "cpu" else str(d.id))
    return f"{topo.hosts[d.host].name}:{what}" if multi else what
