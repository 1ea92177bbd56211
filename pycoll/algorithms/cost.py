"""The cost model that ranks algorithms: latency x steps + bytes / bandwidth, per link class, with saved constants.

Two link classes: ``shm`` (ranks on one host) and ``net`` (ranks on different hosts). Each has a
latency per message step and a bandwidth per rank. Reductions cost bytes / ``reduce_GBps``, copies bytes / ``copy_GBps``, and every
message costs ``msg_us`` of CPU (the Python engine's per-message work, which chunking multiplies).
When a host holds more ranks than it has cores, CPU-bound terms stretch by ``local ranks / cores``.

`pycoll tune` measures the constants on the machine at hand and saves them (see ``save``); otherwise
the defaults below, measured on a 2-core VM, apply. On the exact layout it timed, tune also keeps each
algorithm's measured / predicted ratio per size (``residuals``), so selection there follows the timings.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Optional

from ..config import str_param
from .base import Layout

TUNE_FILE = str_param(
    "PYCOLL_TUNE_FILE",
    "",
    "Cost-model constants written by `pycoll tune` (default: ~/.cache/pycoll/tuning.json when present, else built-in "
    "defaults; `builtin` forces the defaults).",
)
BUILTIN = "builtin"


def default_path() -> str:
    return os.path.join(os.path.expanduser("~"), ".cache", "pycoll", "tuning.json")


@dataclass(frozen=True)
class CostModel:
    """Constants of the model; see the module docstring for what each term means."""

    shm_latency_us: float = 60.0
    shm_GBps: float = 4.0
    net_latency_us: float = 120.0
    net_GBps: float = 1.0
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
    cma_GBps: float = 5.5
    # Per-algorithm scale factors fitted by `pycoll tune`: ("allreduce:ring@shm", latency x, bandwidth x).
    corrections: tuple[tuple[str, float, float], ...] = ()
    # Measured / predicted time at the sizes `pycoll tune` timed, per algorithm and exact layout (see ``residual``):
    # ("allreduce:ring@hosts=0.0.1.1", ((bytes, ratio), ...)).
    residuals: tuple[tuple[str, tuple[tuple[int, float], ...]], ...] = ()
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
        return dataclasses.replace(self, shm_GBps=inf, net_GBps=inf, reduce_GBps=inf, copy_GBps=inf, cma_GBps=inf, corrections=(), residuals=())

    def split(self, cost_fn, nbytes: float, lay: Layout) -> tuple[float, float]:
        """(latency part, bandwidth part) of an uncorrected cost function's prediction."""
        total = cost_fn(self, nbytes, lay)
        lat = cost_fn(self.latency_only, nbytes, lay)
        return lat, max(total - lat, 0.0)

    # ---- building blocks the algorithms' cost functions use -------------------------------------
    def over(self, lay: Layout) -> float:
        """How much CPU-bound work stretches when a host runs more ranks than it has cores."""
        cores = self.cores or os.cpu_count() or 1
        return max(1.0, max(lay.local_sizes, default=1) / cores)

    def link(self, lay: Layout) -> tuple[float, float]:
        """(latency s, bandwidth B/s) of the slowest link between the layout's ranks."""
        if lay.hosts > 1:
            return self.net_latency_us * 1e-6, self.net_GBps * 1e9
        return self.shm_latency_us * 1e-6, self.shm_GBps * 1e9

    def messages(self, nbytes: float) -> int:
        """Pipelined messages a transfer of ``nbytes`` is cut into."""
        return max(1, math.ceil(nbytes / self.chunk_bytes))

    def phase(self, lay: Layout, steps: float, nbytes: float, *, reduced: float = 0.0, flows: float = 1.0,
              messages: Optional[float] = None) -> float:
        """Seconds for ``steps`` dependent message steps moving ``nbytes`` per rank over the layout's slowest link.

        ``flows`` ranks of one host share the host's network link at once; ``reduced`` bytes are
        combined by each rank; ``messages`` defaults to one pipelined message per chunk per step.
        """
        lat, bw = self.link(lay)
        over = self.over(lay)
        msgs = steps * self.messages(nbytes / max(steps, 1)) if messages is None else messages
        cpu = steps * lat + msgs * self.msg_us * 1e-6 + reduced / (self.reduce_GBps * 1e9)
        if lay.hosts > 1:
            return cpu * over + nbytes * flows / bw
        return (cpu + nbytes / bw) * over

    def ring(self, lay: Layout, steps: float, nbytes: float, reduced: float = 0.0) -> float:
        """A ring in rank order: each host's link carries one flow per place the ring leaves the host."""
        p = lay.size
        leaving = [0] * max(lay.hosts, 1)
        for r in range(p):
            if lay.host_of[r] != lay.host_of[(r + 1) % p]:
                leaving[lay.host_of[r]] += 1
        return self.phase(lay, steps, nbytes, reduced=reduced, flows=max(leaving + [1]))

    def flows(self, lay: Layout) -> float:
        """Flows sharing a host link when every rank may talk off-host at once."""
        return float(max(lay.local_sizes, default=1)) if lay.hosts > 1 else 1.0

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
