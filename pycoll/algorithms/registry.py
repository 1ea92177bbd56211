"""The algorithm registry and the selection among registered algorithms, with the PYCOLL_ALGO override."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable, Optional, Union

import numpy as np

from ..arrays import DeviceArray
from ..config import bool_param, float_param, str_param
from ..errors import InvalidArgumentError
from ..ops import ORDERED
from . import cost as cost_model
from .base import Call, Layout, Schedule, Steps
from .cost import CostModel

log = logging.getLogger("pycoll")

ALGO = str_param(
    "PYCOLL_ALGO",
    "",
    "Force algorithms per collective, e.g. `allreduce:ring,broadcast:chain`; an algorithm that refuses a call falls back to the default.",
)

REPRODUCIBLE = bool_param(
    "PYCOLL_REPRODUCIBLE",
    False,
    "`1`: every reduction returns, bit for bit, the left fold of the ranks' inputs in rank order, whatever the "
    "algorithm, sizes, transport or placement (docs/reproducibility.md); algorithms that cannot keep that order "
    "decline. `Comm.reproducible` sets it per communicator.",
)

LINK_TOLERANCE = float_param(
    "PYCOLL_LINK_TOLERANCE",
    0.1,
    "Ranks on several hosts with more than one on some host: an algorithm that puts only the fewest bytes on the "
    "hosts' links (the hierarchical Allreduce, Allgather and Reduce_scatter, the Bcast and Reduce chains, a composed "
    "call) is chosen over one priced faster by up to this share of its time (default 0.1; 0: always the cheapest).",
)
# per collective, the algorithms whose bytes between hosts are the fewest the call needs (the chain follows the
# layout's ring, which keeps each host's ranks together, so it crosses each link once)
LINK_MINIMAL: dict[str, frozenset[str]] = {
    "allreduce": frozenset({"hierarchical"}), "allgather": frozenset({"hierarchical"}),
    "reduce_scatter": frozenset({"hierarchical"}), "broadcast": frozenset({"chain"}), "reduce": frozenset({"chain"}),
}

# per collective, the algorithms that win a tie of the model's prices (otherwise registration order breaks it): at two
# ranks the ring and doubling Allgather make one exchange and price alike, and the doubling's goes as one frame each
# way where it fits (``Steps.swap_now``; across hosts, ``pycoll.paired``'s two-rank form)
ON_TIES: dict[str, frozenset[str]] = {"allgather": frozenset({"doubling"})}

COLLECTIVES = (
    "allreduce",
    "reduce_scatter",
    "allgather",
    "broadcast",
    "reduce",
    "alltoall",
    "gather",
    "scatter",
    "barrier",
    "scan",
    "exscan",
)

# Vector calls whose block sizes not every rank knows: the ranks cannot choose by size (each sees a different one),
# so each takes the first of these that accepts the call, the same on every rank.
UNSIZED = {"gather": ("cma", "linear"), "scatter": ("cma", "linear"), "alltoall": ("cma", "pairwise")}

# The collectives that combine values: in reproducible mode only algorithms that keep the left fold serve them.
REDUCTIONS = frozenset({"allreduce", "reduce", "reduce_scatter", "scan", "exscan"})

Refusal = Callable[[Call, Layout], Optional[str]]
Cost = Callable[[CostModel, float, Layout], float]


@dataclass(frozen=True)
class Algorithm:
    """A registered algorithm: how to run it, what it costs, and when it declines a call."""

    collective: str
    name: str
    description: str
    steps: str  # latency term: number of sequential message steps, in p = ranks
    bytes: str  # bandwidth term: bytes each rank sends, in n = message bytes
    run: Callable[[Steps, Call], Schedule]
    refuse: Optional[Refusal] = None
    cost: Optional[Cost] = None  # seconds predicted by the model for n bytes on a layout
    # "host": runs on host arrays (a device call is staged through pinned host memory for it); "cuda": runs on
    # device buffers only (its refusal declines host calls)
    memory: str = "host"
    # combines the ranks' values in rank order, lower ranks on the left: it may serve a non-commutative op
    ordered: bool = False
    # how it gives every element the left fold ((x0 op x1) op x2) ... in rank order, bit for bit whatever the sizes,
    # transport and placement ("": it does not, and declines reproducible calls)
    reproducible: str = ""

    def refusal(self, call: Call, layout: Layout) -> Optional[str]:
        op = call.op
        if call.reproducible and not self.reproducible and self.collective in REDUCTIONS:
            return "its results are not the rank-order left fold that reproducible mode promises"
        if op is not None and op.order:  # an op the kernels do not know (MAXLOC, user-defined, ...)
            if self.memory == "cuda":
                return f"the device kernels have no {op.name}"
            if op.order == ORDERED and not self.ordered:
                return f"{op.name} is not commutative, and this algorithm does not combine the ranks in rank order"
        return self.refuse(call, layout) if self.refuse else None

    @property
    def key(self) -> str:
        return f"{self.collective}:{self.name}"

    def predict(self, model: CostModel, nbytes: float, layout: Layout) -> float:
        """Seconds the model predicts, with the latency and bandwidth factors `pycoll tune` fitted for this algorithm,
        and on a layout that tune timed, its measured residual at this size."""
        if self.cost is None:
            return 0.0
        a, b = model.correction(f"{self.key}@{model.scope(layout)}") if model.corrections else (1.0, 1.0)
        if a == b == 1.0:
            t = self.cost(model, nbytes, layout)
        else:
            lat, bw = model.split(self.cost, nbytes, layout)
            t = a * lat + b * bw
        if model.residuals:
            t *= model.residual(f"{self.key}@{model.layout_key(layout)}", nbytes)
        return t


ALGORITHMS: dict[str, dict[str, Algorithm]] = {c: {} for c in COLLECTIVES}


def register(
    collective: str,
    name: str,
    description: str,
    *,
    steps: str,
    bytes: str,
    refuse: Optional[Refusal] = None,
    cost: Optional[Cost] = None,
    memory: str = "host",
    ordered: bool = False,
    reproducible: str = "",
) -> Callable[[Callable[[Steps, Call], Schedule]], Callable[[Steps, Call], Schedule]]:
    """Decorator: add an algorithm under ``collective``/``name``; ties in cost go to the first registered.

    ``refuse(call, layout)`` returns why the algorithm cannot serve a call, from the call's size, its memory
    (host or device), its op's kind (``Op.order``) and the layout only; ``cost(model, nbytes, layout)`` predicts its
    time in seconds. ``memory`` is "host" or "cuda" (see ``Algorithm.memory``). ``ordered`` says that it combines
    the ranks' values in rank order (lower ranks on the left), so non-commutative ops may use it; ``reproducible``
    says how it gives the left fold in rank order bit for bit (see ``Algorithm.reproducible``).
    """
    if memory not in ("host", "cuda"):
        raise ValueError(f"memory must be 'host' or 'cuda', not {memory!r}")

    def wrap(fn: Callable[[Steps, Call], Schedule]) -> Callable[[Steps, Call], Schedule]:
        _cache.clear()
        table = ALGORITHMS[collective]
        if name in table:
            raise ValueError(f"algorithm {collective}:{name} registered twice")
        table[name] = Algorithm(collective, name, description, steps, bytes, fn, refuse, cost, memory, ordered,
                                reproducible)
        return fn

    return wrap


@lru_cache(maxsize=8)
@lru_cache(maxsize=32)
def parse_override(text: str) -> dict[str, str]:
    """``"allreduce:ring,allgather:ring"`` -> {collective: algorithm}; names are checked (cached: do not mutate)."""
    chosen: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        coll, sep, name = item.partition(":")
        coll, name = coll.strip().lower(), name.strip().lower()
        if not sep or coll not in ALGORITHMS:
            raise InvalidArgumentError(
                f"PYCOLL_ALGO entry {item!r} must be collective:algorithm with a collective among {', '.join(COLLECTIVES)}"
            )
        if name not in ALGORITHMS[coll]:
            raise InvalidArgumentError(
                f"PYCOLL_ALGO asks for {coll}:{name}, but {coll} has only: {', '.join(ALGORITHMS[coll])}"
            )
        chosen[coll] = name
    return chosen


@dataclass
class Choice:
    """The last selection made in this process, for logs and `pycoll perf`."""

    collective: str = ""
    algorithm: str = ""
    nbytes: int = 0
    why: Union[str, Callable[[], str]] = ""  # the reason, or a function that writes it (only when asked for)

    @property
    def reason(self) -> str:
        return self.why if isinstance(self.why, str) else self.why()


last_choice = Choice()


def on_device(call: Call) -> bool:
    """Whether the call's buffers are CUDA memory (Comm accepts both on the device or both on the host)."""
    return isinstance(call.recv, DeviceArray) or isinstance(call.send, DeviceArray)


def ranked(call: Call, layout: Layout, model: Optional[CostModel] = None) -> list[tuple[float, Algorithm]]:
    """The algorithms that accept this call, cheapest first by the model (``ON_TIES``, then registration order
    breaks ties).

    For a call on device buffers, a host algorithm's prediction includes staging the buffers through host memory.
    """
    model = model or cost_model.current()
    staged = model.staging_s(call.size_bytes) if on_device(call) else 0.0
    out = []
    for algo in ALGORITHMS[call.coll].values():
        reason = algo.refusal(call, layout)
        if reason is None:
            extra = staged if algo.memory == "host" else 0.0
            out.append((algo.predict(model, call.size_bytes, layout) + extra, algo))
        else:
            log.debug("%s: %s declined: %s", call.coll, algo.name, reason)
    first = ON_TIES.get(call.coll, frozenset())
    # prices equal to the picosecond tie (sums of the same terms in another order); stable: other ties keep
    # registration order
    out.sort(key=lambda pair: (round(pair[0], 12), pair[1].name not in first))
    return out


_cache: dict[tuple, list[tuple[float, Algorithm]]] = {}
_cache_model: list[Optional[CostModel]] = [None]  # the model the cache was filled with (compared by identity)


def ranked_cached(coll: str, nbytes: int, layout: Layout, model: CostModel, call: Call) -> list[tuple[float, Algorithm]]:
    """``ranked`` memoised per (collective, size, layout, memory) for the model in force: repeated calls skip the model.

    The model is compared by identity, not hashed: a tuned model carries tables whose hash would cost more
    than the lookup saves. Refusals may depend only on these, on ``call.vector``, ``call.reproducible`` and on the
    op's kind (``Op.order``) (nothing else in the call) for the cache to hold.
    """
    if _cache_model[0] is not model:
        _cache.clear()
        _cache_model[0] = model
    key = (coll, nbytes, layout, on_device(call), call.vector, call.op.order if call.op is not None else 0,
           call.reproducible)
    hit = _cache.get(key)
    if hit is None:
        if len(_cache) > 4096:
            _cache.clear()
        hit = _cache[key] = ranked(call, layout, model)
    return hit


def select(call: Call, layout: Layout) -> Algorithm:
    """The algorithm for this call: the override if it accepts, else the cheapest by the cost model.

    Every input (message size, layout, model constants) is the same on every rank, so all ranks choose alike.
    """
    if isinstance(layout, int):
        layout = Layout.flat(layout)
    table = ALGORITHMS[call.coll]
    forced = parse_override(ALGO.get()).get(call.coll)
    if forced is not None:
        algo = table[forced]
        reason = algo.refusal(call, layout)
        if reason is None:
            return _chose(call, algo, "forced by PYCOLL_ALGO")
        log.warning("PYCOLL_ALGO %s:%s declined this call (%s); choosing by cost", call.coll, forced, reason)
    if call.vector and call.coll in UNSIZED:
        for name in UNSIZED[call.coll]:
            algo = table.get(name)
            if algo is not None and algo.refusal(call, layout) is None:
                return _chose(call, algo, "the first that accepts a call whose sizes not every rank knows")
    model = cost_model.current()
    spanned = None if on_device(call) else span_choice(call, layout, model)
    if spanned is not None:
        shape = _shape(call)  # not the call: the reason, kept until the next choice, must not keep its buffers alive

        def why_spanned() -> str:
            nbytes = shape[1]
            lo, hi = size_span(nbytes)
            options = ranked_cached(shape[0], nbytes, layout, model, _probe(shape, nbytes))
            return f"{_why(options, spanned, layout)}; the choice at {lo} and {hi} bytes, which holds between them"
        return _chose(call, spanned, why_spanned)
    options = ranked_cached(call.coll, call.size_bytes, layout, model, call)
    if not options:
        raise InvalidArgumentError(f"no {call.coll} algorithm accepts this call")  # pragma: no cover - defaults accept all
    if len(options) == 1:
        return _chose(call, options[0][1], "the only one that accepts")
    pick = _cheapest(options, call.coll, layout)
    return _chose(call, pick, lambda: _why(options, pick, layout))


def _cheapest(options: list[tuple[float, Algorithm]], coll: str, layout: Layout) -> Algorithm:
    """The choice among ``ranked``'s options: the cheapest, or the link-minimal one within PYCOLL_LINK_TOLERANCE."""
    tolerance = link_tolerance(coll, layout)
    if tolerance and len(options) > 1:
        return ALGORITHMS[coll][preferred([(t, a.name) for t, a in options], LINK_MINIMAL[coll], tolerance)[1]]
    return options[0][1]


def _why(options: list[tuple[float, Algorithm]], pick: Algorithm, layout: Layout) -> str:
    """Why ``pick`` (written only when logged or asked for: formatting every candidate costs more than selecting)."""
    each = ", ".join(f"{a.name} {t * 1e6:.0f} us" for t, a in options)
    lean = "" if pick is options[0][1] else "; the fewest bytes between hosts within PYCOLL_LINK_TOLERANCE"
    return f"cheapest predicted ({each}; {layout.size} ranks on {layout.hosts} hosts{lean})"


# Sizes below this are chosen for by span (``size_span``): over 2 million sizes to 512 KiB, on 12 layouts of 1-3 hosts,
# 4 links and 1-2 cores a host, the choice at a span's ends held at every size inside it; past the pipelining chunk
# the model's chunk counts step inside a span and it does not always hold (6 ranks on 2 hosts, 12.7 MB Allreduce).
SPAN_LIMIT = 512 << 10
_spans: dict[tuple, Optional[Algorithm]] = {}
_span_model: list[Optional[CostModel]] = [None]  # the model the spans were chosen with (compared by identity)
_BYTES = np.dtype(np.uint8)


def size_span(nbytes: int) -> tuple[int, int]:
    """The quarter of a power-of-two octave holding ``nbytes`` ([lo, hi], lo = hi below 8 bytes): 8-9, 10-11, ...,
    1024-1279, 1280-1535, ..."""
    if nbytes < 8:
        return nbytes, nbytes
    top = 1 << (nbytes.bit_length() - 1)
    quarter = top >> 2
    lo = top + (nbytes - top) // quarter * quarter
    return lo, lo + quarter - 1


def _shape(call: Call) -> tuple:
    """What selection reads of a host call besides the layout, without its buffers."""
    return call.coll, call.size_bytes, call.op, call.root, call.vector, call.reproducible


def _probe(shape: tuple, nbytes: int) -> Call:
    """A call of ``shape`` (``_shape``) moving ``nbytes``, without buffers: what refusals and prices read (a copy of
    the shape's first probe with its size changed: building a ``Call`` costs 3 us, and a new span makes several)."""
    coll, _, op, root, vector, reproducible = shape
    key = (coll, op, root, vector, reproducible)
    template = _probes.get(key)
    if template is None:
        if len(_probes) > 256:
            _probes.clear()
        template = _probes[key] = Call(coll, _BYTES, op=op, root=root, vector=vector, reproducible=reproducible)
    probe = template.without_buffers()
    probe.total = nbytes
    return probe


_probes: dict[tuple, Call] = {}


def span_choice(call: Call, layout: Layout, model: CostModel) -> Optional[Algorithm]:
    """The model's choice for every size of the call's span, where its first size and the next span's first agree on
    it and accept the same algorithms (None: they differ, or the call is too large; choose at its own size). A
    program whose sizes vary then prices each span once, not each size (a choice costs 20-60 us of Python a
    collective), and neighbouring spans share a priced size (``ranked_cached``): a program whose sizes grow prices
    one size a new span. Every rank answers alike: the answer depends on the span, not on which of its sizes came
    first."""
    nbytes = call.size_bytes
    lo, hi = size_span(nbytes)
    if lo == hi or hi >= SPAN_LIMIT:
        return None
    if _span_model[0] is not model:
        _spans.clear()
        _span_model[0] = model
    key = (call.coll, lo, layout, call.vector, call.op.order if call.op is not None else 0, call.reproducible,
           link_tolerance(call.coll, layout))
    if key in _spans:
        return _spans[key]
    ends, shape = [], _shape(call)
    for n in (lo, hi + 1):  # the next span's first size: one byte past this span's last, and priced for that span
        options = ranked_cached(call.coll, n, layout, model, _probe(shape, n))
        ends.append((_cheapest(options, call.coll, layout) if options else None, {a.name for _, a in options}))
    (first, accepted), (last, also) = ends
    if len(_spans) > 4096:
        _spans.clear()
    _spans[key] = first if first is not None and first is last and accepted == also else None
    return _spans[key]


def span_chooser(call: Call) -> Callable[[int, Layout, CostModel], Optional[Algorithm]]:
    """``span_choice`` for calls of ``call``'s shape of any size in bytes (the function keeps no buffer alive)."""
    shape = _shape(call)
    return lambda nbytes, layout, model: span_choice(_probe(shape, nbytes), layout, model)


def link_tolerance(coll: str, layout: Layout) -> float:
    """How much slower a link-minimal algorithm of ``coll`` may be priced and still be chosen on ``layout`` (0: not
    here, or none known for ``coll``)."""
    if coll not in LINK_MINIMAL or layout.hosts < 2 or max(layout.local_sizes) < 2:
        return 0.0
    return max(LINK_TOLERANCE.get(), 0.0)


def preferred(priced: list[tuple[float, str]], minimal: frozenset[str], tolerance: float) -> tuple[float, str]:
    """Of (time, name) pairs, cheapest first: the cheapest, or the cheapest of ``minimal`` (those that put the
    fewest bytes on the links) where it is within ``tolerance`` of the cheapest's time."""
    best = priced[0]
    if best[1] in minimal or tolerance <= 0:
        return best
    lean = next((p for p in priced if p[1] in minimal), None)
    return lean if lean is not None and lean[0] <= best[0] * (1 + tolerance) else best


def _chose(call: Call, algo: Algorithm, why: Union[str, Callable[[], str]]) -> Algorithm:
    last_choice.collective, last_choice.algorithm = call.coll, algo.name
    last_choice.nbytes, last_choice.why = call.size_bytes, why
    if log.isEnabledFor(logging.INFO):
        log.info("%s of %d bytes: %s, %s", call.coll, call.size_bytes, algo.name, last_choice.reason)
    return algo
