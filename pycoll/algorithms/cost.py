"""The cost model that ranks algorithms: latency x steps + bytes / bandwidth, per link class, with saved constants.

Two link classes: ``shm`` (ranks on one host) and ``net`` (ranks on different hosts). Each has a
latency per message step and a bandwidth per rank. Reductions cost bytes / ``reduce_GBps``, copies bytes / ``copy_GBps``, and every
message costs ``msg_us`` of CPU (the Python engine's per-message work, which chunking multiplies).
When a host holds more ranks than it has cores, CPU-bound terms stretch by ``local ranks / cores`` and each
dependent wait on one host costs a scheduler hand-over (``handovers``). Arena copies and reductions whose
calls fit in the last-level cache run faster (``cached``, ``copy_s``, ``reduce_s``).

`pycoll tune` measures the constants on the machine at hand and saves them (see ``save``); otherwise
the defaults below, measured on a 2-core VM, apply. On the exact layout it timed, tune also keeps each
algorithm's measured / predicted ratio per size (``residuals``), so selection there follows the timings.

``CostModel.from_topology`` builds the model for ranks placed on a topology instead: link terms from its
paths and NICs, device constants for GPU ranks (`pycoll simulate`; docs/simulator.md).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import os
from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Any, Optional, Sequence

from ..config import str_param
from .base import Layout
from .cost_topology import model_from_topology

if TYPE_CHECKING:  # the topology package is imported only when a model is built from one
    from ..topology.model import Device, Topology

TUNE_FILE = str_param(
    "PYCOLL_TUNE_FILE",
    "",
    "Cost-model constants written by `pycoll tune` (default: ~/.cache/pycoll/tuning.json when present, else built-in "
    "defaults; `builtin` forces the defaults).",
)
BUILTIN = "builtin"
# The version of the cost functions that saved constants were fitted with. Version 2 counts the bytes that
# really leave a host in tree and recursive halving/doubling algorithms (``phase``'s ``wire``); version 1 charged
# every rank's bytes to its host's link, and `pycoll tune` then fitted the network constants to that count.
# Version 3 bounds cma by the rank's own copies or the host's memory (``host_memory_GBps``); a file from before
# keeps its other constants, and its cma terms are the built-in ones at its memory speed. Version 4 charges the
# hand-overs of ranks that outnumber their host's cores across hosts too, as on one host (``handovers``). Version 5
# lets the cores' work hide behind the link across hosts, and pipelines pay the latency of their hops only (``phase``).
# Version 6 charges a rank's core for the bytes it moves through sockets (``tcp_GBps``), which bounds a call where
# the link is faster than the cores (an unshaped veth pair). Version 7 charges a Reduce tree's folds across hosts to
# the cores of the host that does most of them, not two vectors to every rank. Version 8 prices a link whose measured
# rate the cores bounded at the cores' rate in cache (``cost_topology.wire_GBps``). Version 9 gives groups that cross
# the hosts at once (``sharing_links``) their share of the hosts' cores as well as of their links.
FORMULA = 9
log = logging.getLogger("pycoll")


def default_path() -> str:
    return os.path.join(os.path.expanduser("~"), ".cache", "pycoll", "tuning.json")


@dataclass(frozen=True)
class CostModel:
    """Constants of the model; see the module docstring for what each term means."""

    shm_latency_us: float = 60.0
    shm_GBps: float = 3.0
    # A dependent step between hosts: `pycoll tune --links-only` measured 6.3-6.5 us one way between two namespace
    # hosts (9.8 on 2026-11-28), and a 2-rank 8 B Allreduce across them takes 8-9 us. It was 120 while every step
    # went through the Python engine.
    net_latency_us: float = 10.0
    net_GBps: float = 1.0
    # One core's rate through a TCP socket, one side of it (the copy into or out of the kernel and the protocol's
    # work): a rank that sends and receives across hosts at once pays for both. Between two namespace hosts on this
    # VM, 16 MiB crossed one way at 3.9-4.0 GB/s as one frame through C and both ways at once at 2.0 each way
    # (perf/results/multihost/model-unshaped-link-measured/). `pycoll tune --hosts` measures it with the link.
    tcp_GBps: float = 4.0
    # ... and this much faster where the host's ranks' buffers stay in its last-level cache (2 ranks, 1-4 MiB against
    # 16 MiB both ways at once)
    tcp_cache_speedup: float = 1.5
    reduce_GBps: float = 6.0
    msg_us: float = 25.0
    cores: int = 0  # 0: os.cpu_count() of the rank that loads the model
    chunk_bytes: int = 512 << 10
    # Arena algorithms (one host): a meeting of all ranks on shared flags, one pulled chunk, the chunk's size,
    # and the speed of a plain or cross-memory copy.
    arena_sync_us: float = 6.0
    arena_step_us: float = 8.0
    arena_chunk: int = 256 << 10
    arena_stage: int = 4 << 20
    copy_GBps: float = 8.0
    # A rank's cross-memory copies on its own core (the kernel pins each page it copies: 2 ranks, a lone reader
    # at 256 MiB moves 0.84 of np.copyto's rate), and what the host's memory carries for all its ranks at once,
    # in copies a second (a copy reads and writes each byte); see shared.cma_cost.
    cma_GBps: float = 6.8
    host_memory_GBps: float = 12.3
    # Arena copies and reductions whose data stays in the host's last-level cache between calls run this much
    # faster (measured on this VM: 2 ranks, 4 MiB pipes against 64 MiB ones); 0 bytes: this machine's cache.
    cache_bytes: int = 0
    cache_speedup: float = 2.3
    # A cross-memory-attach call's fixed cost, and each of its meetings: they run as a scheduled generator, not
    # inline, and each peer's buffer is read with its own system calls (2 ranks at 64 KiB: 78-91 us with 2
    # meetings, 119 with 3, against 13-18 staged).
    cma_call_us: float = 25.0
    cma_sync_us: float = 25.0
    # ... and the whole fixed cost of a cma call that runs inline, as one compiled kernel call (post, meet, copies,
    # wait: direct_cma's programs; 2 ranks, 16 KiB Bcast: 9 us a call, against 5 for a Barrier).
    cma_inline_us: float = 6.0
    # ... and in cache its chunked pulls and their reductions run this much faster, and its whole-buffer kernel
    # copies this much (2 ranks, 1-4 MiB against 16-64 MiB, buffers on huge pages as `pycoll perf` allocates them;
    # from 4 KiB pages the kernel pins 512 times as many pages and the copies gain about what the pulls do).
    cma_cache_speedup: float = 1.3
    cma_copy_cache_speedup: float = 3.0
    # Ranks that outnumber cores: a wait on a flag or message of a descheduled peer costs a hand-over through
    # the scheduler (a sleep, a wake-up, a turn on the core); see ``handovers``.
    handover_us: float = 150.0
    # ... and a meeting of the compiled one-meeting arena kernels (slots, oneshot, cma), which yield the core to the
    # peer they wait for: 2 ranks bound to one core, 8 B-4 KiB back to back, a slots Bcast or Reduce took 31-34 us
    # where two arena meetings account for 12 (oneshot Allreduce 25-26 us). The pipelined arena paths (staged, the
    # chunked Bcast) hand chunks back and forth and keep ``handover_us``: 64 MiB on 4 ranks over 2 cores, staged
    # took 67 ms against cma's 35.
    arena_handover_us: float = 20.0
    # Per-algorithm scale factors fitted by `pycoll tune`: ("allreduce:ring@shm", latency x, bandwidth x).
    corrections: tuple[tuple[str, float, float], ...] = ()
    # Measured / predicted time at the sizes `pycoll tune` timed, per algorithm and exact layout (see ``residual``):
    # ("allreduce:ring@hosts=0.0.1.1", ((bytes, ratio), ...)).
    residuals: tuple[tuple[str, tuple[tuple[int, float], ...]], ...] = ()
    # Device ranks (a model taken from a topology, see ``from_topology``): kernels reduce while the data streams, so a
    # phase costs the slower of its transfer and its reduction, not their sum; and a fixed cost per call (a kernel
    # launch), the same for every algorithm, which the simulator adds and selection can ignore.
    fused: bool = False
    call_us: float = 0.0
    # Device buffers on one host (pycoll/algorithms/cuda_ipc.py). An IPC phase's fixed cost: a stream synchronisation,
    # a meeting on the host arena's flags and a kernel launch (estimated from CUDA's documented launch and sync
    # latencies, not yet measured); a kernel's reads of a peer GPU's memory through CUDA IPC (PCIe unless the
    # topology says NVLink); copies within one GPU's memory; and the staged path's copies between device and
    # pinned host memory, each a fixed cost plus bytes over PCIe.
    ipc_sync_us: float = 20.0
    ipc_GBps: float = 12.0
    device_GBps: float = 1000.0
    stage_us: float = 10.0
    stage_GBps: float = 12.0
    formula: int = FORMULA  # see FORMULA
    source: str = field(default="built-in defaults", compare=False)

    # ---- per-algorithm corrections ----------------------------------------------------------------
    @staticmethod
    def scope(lay: Layout) -> str:
        return "net" if lay.hosts > 1 else "shm"

    def correction(self, key: str) -> tuple[float, float]:
        for name, lat, bw in self.corrections:
            if name == key:
                return lat, bw
        return 1.0, 1.0

    @staticmethod
    def layout_key(lay: Layout) -> str:
        """The exact layout a residual table was measured on: each rank's host, e.g. ``hosts=0.0.1.1``."""
        return "hosts=" + ".".join(map(str, lay.host_of))

    def residual(self, key: str, nbytes: float) -> float:
        """The tuned ratio measured / predicted for ``key`` at ``nbytes``; 1.0 where the layout was never timed.

        Between timed sizes the ratio is interpolated linearly in log(size) and log(ratio); beyond them
        it stays at the nearest timed size's.
        """
        for name, table in self.residuals:
            if name != key:
                continue
            x = math.log(max(nbytes, 1.0))
            pts = [(math.log(max(b, 1)), math.log(r)) for b, r in table]
            if x <= pts[0][0]:
                return math.exp(pts[0][1])
            for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
                if x <= x1:
                    w = (x - x0) / (x1 - x0) if x1 > x0 else 1.0
                    return math.exp(y0 + w * (y1 - y0))
            return math.exp(pts[-1][1])
        return 1.0

    @functools.cached_property
    def latency_only(self) -> "CostModel":
        """This model with infinite bandwidths: what remains of a cost is its latency (and per-message) part."""
        inf = float("inf")
        return dataclasses.replace(self, shm_GBps=inf, net_GBps=inf, tcp_GBps=inf, reduce_GBps=inf, copy_GBps=inf,
                                   cma_GBps=inf, ipc_GBps=inf, device_GBps=inf, stage_GBps=inf, host_memory_GBps=inf,
                                   corrections=(), residuals=())

    def at_memory_speed(self, copy_GBps: float, reduce_GBps: float) -> "CostModel":
        """This model on a host whose memory copies at ``copy_GBps`` and reduces at ``reduce_GBps`` out of cache
        (`pycoll perf`'s limit line): the other memory-bound rates (cross-memory copies, the host's total) in
        proportion to the copy rate."""
        scale = copy_GBps / self.copy_GBps
        return dataclasses.replace(self, copy_GBps=copy_GBps, reduce_GBps=reduce_GBps, cma_GBps=self.cma_GBps * scale,
                                   host_memory_GBps=self.host_memory_GBps * scale)

    def split(self, cost_fn, nbytes: float, lay: Layout) -> tuple[float, float]:
        """(latency part, bandwidth part) of an uncorrected cost function's prediction."""
        total = cost_fn(self, nbytes, lay)
        lat = cost_fn(self.latency_only, nbytes, lay)
        return lat, max(total - lat, 0.0)

    # ---- building blocks the algorithms' cost functions use -------------------------------------
    def sharing_links(self, flows: int) -> "CostModel":
        """The model as seen by one of ``flows`` concurrent inter-host groups that share each host's link and its
        cores (kept per ``flows``: a ranking asks for a few, and building a model costs 14 us). The rails of a
        Reduce_scatter_block composed on 2 hosts of 2 ranks, 1 core a host, 2 and 8 MiB on each rail: 1.08 and 5.96
        ms, priced 0.53 and 2.03 with a core to each rail, 1.37 and 5.26 with the cores shared."""
        flows = max(flows, 1)
        model = self._sharing.get(flows)
        if model is None:
            model = self._sharing[flows] = dataclasses.replace(
                self, net_GBps=self.net_GBps / flows, cores=(self.cores or machine_cores()) / flows)
        return model

    @functools.cached_property
    def _sharing(self) -> dict[int, "CostModel"]:
        """``sharing_links``'s models, by flow count."""
        return {}

    def over(self, lay: Layout) -> float:
        """How much CPU-bound work stretches when a host runs more ranks than it has cores."""
        cores = self.cores or machine_cores()
        return max(1.0, max(lay.local_sizes, default=1) / cores)

    def cached(self, footprint: float) -> float:
        """The share of a host's accesses that hit its last-level cache when calls touch ``footprint`` bytes.

        Repeated calls over the same buffers stay cached while they fit in three quarters of the cache; past
        the whole cache, streaming evicts what the next call needs first, so nearly nothing hits.
        """
        size = self.cache_bytes or last_level_cache()
        if size <= 0 or footprint <= 0.75 * size:
            return 1.0 if size > 0 else 0.0
        return max(0.0, (size - footprint) / (0.25 * size))

    def copy_s(self, nbytes: float, footprint: float) -> float:
        """Seconds to copy ``nbytes`` between a host's ranks when its calls touch ``footprint`` bytes."""
        return self.memory_s(nbytes, self.copy_GBps, footprint)

    def reduce_s(self, nbytes: float, footprint: float) -> float:
        """Seconds to reduce ``nbytes`` into a result, as ``copy_s``."""
        return self.memory_s(nbytes, self.reduce_GBps, footprint)

    def memory_s(self, nbytes: float, GBps: float, footprint: float) -> float:
        """Seconds to move ``nbytes`` at ``GBps`` out of cache, faster for the share of it that hits."""
        hit = self.cached(footprint)
        return nbytes / (GBps * 1e9) * (1.0 - hit + hit / self.cache_speedup)

    def handovers(self, lay: Layout, waits: float, each_us: Optional[float] = None) -> float:
        """Seconds that ``waits`` dependent waits on peers cost when a host has more ranks than cores: the peer a
        rank waits for is often descheduled, and each such wait is a trip through the scheduler (``each_us``, by
        default ``handover_us``)."""
        return waits * (self.handover_us if each_us is None else each_us) * 1e-6 if self.over(lay) > 1 else 0.0

    def arena_handovers(self, lay: Layout, waits: float) -> float:
        """``handovers`` for the meetings of the one-meeting arena kernels, which yield the core to the peer they wait for."""
        return self.handovers(lay, waits, self.arena_handover_us)

    def socket_copies(self, host: Layout, each_way: float) -> float:
        """Seconds of a rank's core spent copying ``each_way`` bytes into a socket and as many out of one (a copy
        each) where the ranks of ``host`` (one host's) outnumber its cores; 0 where each has a core of its own, and
        the copies run beside the other ranks' work."""
        over = self.over(host)
        return 2 * each_way / (self.copy_GBps * 1e9) * over if over > 1 else 0.0

    def staging_s(self, nbytes: float) -> float:
        """Seconds a device call spends staged through pinned host memory: its input copied out, its result back."""
        return 2 * (self.stage_us * 1e-6 + nbytes / (self.stage_GBps * 1e9))

    def link(self, lay: Layout) -> tuple[float, float]:
        """(latency s, bandwidth B/s) of the slowest link between the layout's ranks."""
        if lay.hosts > 1:
            return self.net_latency_us * 1e-6, self.net_GBps * 1e9
        return self.shm_latency_us * 1e-6, self.shm_GBps * 1e9

    def messages(self, nbytes: float) -> int:
        """Pipelined messages a transfer of ``nbytes`` is cut into."""
        return max(1, math.ceil(nbytes / self.chunk_bytes))

    def phase(self, lay: Layout, steps: float, nbytes: float, *, reduced: float = 0.0, flows: float = 1.0,
              messages: Optional[float] = None, wire: Optional[float] = None, local: float = 0.0,
              footprint: float = 0.0, depth: Optional[float] = None, sides: float = 2.0) -> float:
        """Seconds for ``steps`` dependent message steps moving ``nbytes`` per rank over the layout's slowest link.

        ``flows`` ranks of one host share the host's network link at once; ``reduced`` bytes are
        combined by each rank; ``messages`` defaults to one pipelined message per chunk per step.
        Across hosts, an algorithm that knows which of its messages leave a host gives ``wire``: the bytes
        that leave the busiest host (replacing ``nbytes * flows``), and ``local``: the bytes a rank moves
        in steps that stay inside hosts, at the intra-host bandwidth. The rest of a rank's bytes move while
        the network carries its share, so where hosts hold several ranks the phase takes at least their
        time over the intra-host link (a ring across hosts is as slow as its slowest hop). Where a host's ranks
        outnumber its cores, every message is a dependent wait on a peer that may be descheduled, on any link.
        On one host, an algorithm that gives ``footprint`` (the bytes the host's ranks touch in a call) moves and
        reduces its bytes through the shared-memory transport faster while they stay in cache (``memory_s``).

        Across hosts the link and the ranks' cores work at once: while one message crosses, the cores post the next,
        so the link's time and the CPU's overlap but for one message of each step. A pipeline (``depth`` given: the
        dependent hops, where ``steps`` counts a step per chunk, as a chain's p - 1) also folds chunk k while chunk
        k + 1 arrives, and pays the link's latency per hop only; the other algorithms exchange a step's whole frames
        and fold them after (2 ranks at 10 Gbit/s, 16 MiB: recursive doubling 16.7-17.4 ms, the link's 14.2 and the
        fold's 2.8; the chain Reduce 14.2, as its Bcast). The cores' work includes their sockets' copies: a rank's
        bytes across hosts at ``tcp_GBps`` for each of ``sides`` (2: it receives as much as it sends; 1: one way,
        as in a chain between two hosts), which bound the call where the link is faster than the cores. One way, the
        sending host's cores copy while the receiving host's fold, so a chain's folds cost only where they outlast
        the copies (a two-rank Reduce, 16 MiB unshaped: 4.1-6.0 ms, the one-way frame's time; priced 8.3 as the sum,
        5.6 as the larger). On one host
        moving bytes is itself the cores' work, so the terms add up.
        """
        lat, bw = self.link(lay)
        over = self.over(lay)
        msgs = steps * self.messages(nbytes / max(steps, 1)) if messages is None else messages
        cpu = steps * lat + msgs * self.msg_us * 1e-6
        red = reduced / (self.reduce_GBps * 1e9)
        if lay.hosts > 1:
            moved = (nbytes * flows if wire is None else wire) / bw
            if max(lay.local_sizes) > 1:  # meanwhile, the steps between ranks of one host use the host's own links
                moved = max(moved, (nbytes - local) / (self.shm_GBps * 1e9))
            if local:
                moved += local / (self.shm_GBps * 1e9)
            if self.fused:
                return cpu * over + max(moved, red * over)
            hops = steps if depth is None else depth
            # a pipeline folds chunk k while chunk k+1 arrives; a step that exchanges whole frames folds them after
            hidden_red, after = (red * over, 0.0) if depth is not None else (0.0, red * over)
            # messages posted at once, one hop each (depth 1): a rank waiting on a descheduled peer waits while the
            # link carries the others, so its hand-overs hide behind the link. Where a message waits for the one
            # before (steps, or a pipeline's hops inside a host) nothing crosses meanwhile (4 ranks on 2 hosts of one
            # core, 10 Gbit/s: the pairwise Alltoall 1 MiB 0.94-1.02 ms against 1.41 priced with its hand-overs
            # after the link; the Bcast chain 16 MiB 18.7-19.6 against 14.9 priced with them hidden)
            handovers = self.handovers(lay, msgs)
            hidden_handovers, after = (handovers, after) if depth == 1 else (0.0, after + handovers)
            work = msgs * self.msg_us * 1e-6 * over + hidden_red + hidden_handovers
            unhidden = min(moved, work) * min(1.0, hops / max(msgs, 1))  # each step's first message waits for the other
            # the sockets copy while the bytes cross, on the host's cores: the bytes leaving the busiest host (and as
            # many arriving, for ``sides`` 2) over its cores, less what the hidden hand-overs above already hold (the
            # peer a rank waits on runs meanwhile, copying)
            leaving = (nbytes - local) * flows if wire is None else wire
            hit = self.cached(2 * nbytes * max(lay.local_sizes))  # the host's ranks' buffers, sent and received
            copies = (sides * leaving / max(lay.local_sizes) / (self.tcp_GBps * 1e9) * over
                      * (1.0 - hit + hit / self.tcp_cache_speedup))
            copies = max(copies - hidden_handovers, 0.0)
            if sides <= 1.0:
                # one way (a chain between two hosts): the sending host's cores copy into the sockets and fold for
                # its ranks but the chain's first, while the receiving host's cores fold for all of theirs
                # (``work`` holds the receiving host's folds; the sending host's work exceeds it by its copies less
                # one rank's folds)
                work += max(copies - hidden_red / max(lay.local_sizes), 0.0)
            else:
                work += copies
            return hops * lat * over + max(moved, work) + unhidden + after
        if self.fused:
            return (cpu + max(nbytes / bw, red)) * over
        if footprint:
            red = self.reduce_s(reduced, footprint)
            return (cpu + red + self.memory_s(nbytes, bw / 1e9, footprint)) * over + self.handovers(lay, msgs)
        return (cpu + red + nbytes / bw) * over + self.handovers(lay, msgs)

    def ring(self, lay: Layout, steps: float, nbytes: float, reduced: float = 0.0, footprint: float = 0.0,
             depth: Optional[float] = None, messages: Optional[float] = None) -> float:
        """A ring in the layout's ring order: each host's link carries one flow per place the ring leaves the host
        (``messages``: as ``phase``'s, the messages the bytes go in; default, one per chunk)."""
        flows, sides = _ring_flows(lay, depth is not None)
        return self.phase(lay, steps, nbytes, reduced=reduced, flows=flows, messages=messages,
                          footprint=footprint, depth=depth, sides=sides)

    def flows(self, lay: Layout) -> float:
        """Flows sharing a host link when every rank may talk off-host at once."""
        return float(max(lay.local_sizes, default=1)) if lay.hosts > 1 else 1.0

    # ---- a model from a topology ---------------------------------------------------------------
    @classmethod
    def from_topology(cls, topo: "Topology", placement: Sequence["Device"], kind: Optional[str] = None,
                      base: Optional["CostModel"] = None) -> "CostModel":
        """The model for ranks placed on ``placement`` (rank r on device ``placement[r]``) of ``topo``.

        The links come from the topology: intra-host, the slowest path between ranks that follow each other
        on a host; across hosts, the NICs a host's ranks can drive, added up. GPU ranks ("gpu") take device
        constants (no Python per-message cost, reductions at memory speed, fused with the transfer); CPU ranks
        ("cpu") keep ``base``'s fitted host constants (default: the built-in ones). Tuned corrections and
        residuals are dropped: they belong to the layout they were measured on. docs/simulator.md has every
        constant and its source.
        """
        return model_from_topology(topo, placement, kind or (placement[0].kind if placement else "cpu"),
                                   base if base is not None else cls())

    # ---- persistence ---------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["corrections"] = {name: [lat, bw] for name, lat, bw in self.corrections}
        out["residuals"] = {name: [[b, r] for b, r in table] for name, table in self.residuals}
        return out

    @staticmethod
    def from_json(data: dict[str, Any], source: str = "") -> "CostModel":
        known = {f.name for f in fields(CostModel)}
        values = {k: v for k, v in data.items() if k in known}
        values["corrections"] = tuple(sorted((k, float(v[0]), float(v[1])) for k, v in dict(values.get("corrections") or {}).items()))
        values["residuals"] = tuple(sorted(
            (k, tuple(sorted((int(b), float(r)) for b, r in v))) for k, v in dict(values.get("residuals") or {}).items() if v))
        values["formula"] = FORMULA
        tuned_net = any(c[0].endswith("@net") for c in values["corrections"]) or any(_multi_host(r[0]) for r in values["residuals"])
        if int(data.get("formula", 1)) < FORMULA and tuned_net:  # tuned across hosts with older cost functions
            default = CostModel()
            values.update(net_latency_us=default.net_latency_us, net_GBps=default.net_GBps)
            values["corrections"] = tuple(c for c in values["corrections"] if not c[0].endswith("@net"))
            values["residuals"] = tuple(r for r in values["residuals"] if not _multi_host(r[0]))
            log.warning("cost model %s was tuned across hosts with older cost functions: its network terms are dropped "
                        "(re-run `pycoll tune --hosts N` to fit them again)", source or "(unnamed)")
        if int(data.get("formula", 1)) < 3 and "copy_GBps" in values:
            default = CostModel()
            scale = float(values["copy_GBps"]) / default.copy_GBps
            values.update(cma_GBps=default.cma_GBps * scale, host_memory_GBps=default.host_memory_GBps * scale,
                          cma_call_us=default.cma_call_us, cma_sync_us=default.cma_sync_us)
            values["corrections"] = tuple(c for c in values["corrections"] if ":cma@" not in c[0])
            values["residuals"] = tuple(r for r in values["residuals"] if ":cma@" not in r[0])
        if source:
            values["source"] = source
        return CostModel(**values)

    def save(self, path: Optional[str] = None) -> str:
        path = path or TUNE_FILE.get() or default_path()
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(self.to_json(), f, indent=2)
        os.replace(tmp, path)
        return path


@functools.lru_cache(maxsize=256)
def _ring_flows(lay: Layout, chain: bool) -> tuple[int, float]:
    """(flows, sides) of a ring in the layout's ring order (``CostModel.ring``; a chain's last rank sends to no
    one): the most places the ring leaves one host, and the directions a host's link carries the bytes in (a ring's
    both, a chain's one)."""
    order = lay.order
    p = len(order)
    leaving, arriving = [0] * max(lay.hosts, 1), [0] * max(lay.hosts, 1)
    for i in range(p - 1 if chain else p):
        a, b = lay.host_of[order[i]], lay.host_of[order[(i + 1) % p]]
        if a != b:
            leaving[a] += 1
            arriving[b] += 1
    sides = max((o + i) / max(o, i, 1) for o, i in zip(leaving, arriving))
    return max(leaving + [1]), max(sides, 1.0)


@functools.lru_cache(maxsize=None)
def machine_cores() -> int:
    """``os.cpu_count()``, read once (it reads sysfs: 6 us, and a ranking asks a few dozen times)."""
    return os.cpu_count() or 1


@functools.lru_cache(maxsize=None)
def last_level_cache(sysfs: str = "/sys/devices/system/cpu/cpu0/cache") -> int:
    """Bytes of this machine's largest CPU cache (sysfs), 0 when unknown."""
    best = 0
    try:
        entries = os.listdir(sysfs)
    except OSError:
        return 0
    for name in entries:
        if not name.startswith("index"):
            continue
        try:
            with open(os.path.join(sysfs, name, "type")) as f:
                if f.read().strip() == "Instruction":
                    continue
            with open(os.path.join(sysfs, name, "size")) as f:
                text = f.read().strip().upper()
        except OSError:
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        try:
            best = max(best, int(text.rstrip("KMG")) * scale)
        except ValueError:
            continue
    return best


def _multi_host(key: str) -> bool:
    """Whether a residual's key (``allreduce:ring@hosts=0.0.1.1``) names a layout of several hosts."""
    _, _, where = key.partition("@hosts=")
    return len(set(where.split("."))) > 1


def load(path: Optional[str] = None) -> CostModel:
    """The tuned constants from ``path``, PYCOLL_TUNE_FILE or the default file, else the built-in defaults."""
    explicit = path or TUNE_FILE.get()
    if explicit == BUILTIN:
        return CostModel()
    candidate = explicit or default_path()
    try:
        with open(candidate) as f:
            return CostModel.from_json(json.load(f), source=candidate)
    except FileNotFoundError:
        if explicit:
            raise
        return CostModel()


_current: Optional[CostModel] = None


def current() -> CostModel:
    """The model in force in this process (set by the runtime from rank 0's, so all ranks agree)."""
    global _current
    if _current is None:
        _current = load()
    return _current


def use(model: Optional[CostModel]) -> None:
    global _current
    _current = model


def log2ceil(p: int) -> int:
    return max(0, (p - 1).bit_length())


def pow2floor(p: int) -> int:
    return 1 << (p.bit_length() - 1) if p > 0 else 0
