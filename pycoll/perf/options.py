"""Command-line options of `pycoll perf` (nccl-tests' flags) and the parsed, validated settings."""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Optional

from pycoll.config import parse_size

PEERS = ("pycoll", "mpi", "gloo", "nccl")
# The default list (nccl-tests' six); the rest run when named with -C.
DEFAULT_COLLECTIVES = ("allreduce", "reduce_scatter", "allgather", "broadcast", "reduce", "alltoall")
COLLECTIVES = DEFAULT_COLLECTIVES + ("gather", "scatter", "sendrecv", "scan", "barrier", "pingpong", "p2p_bw")
BUFFERS = ("spec", "array", "fresh")  # how pycoll and mpi4py get their buffers (torch peers ignore it)
OPS = ("sum", "prod", "min", "max", "avg")
# nccl-tests type name -> NumPy dtype name; aliases map to the nccl-tests spelling below.
DTYPES = {
    "float": "float32", "double": "float64", "half": "float16", "bfloat16": "bfloat16",
    "int8": "int8", "uint8": "uint8", "int32": "int32", "uint32": "uint32", "int64": "int64", "uint64": "uint64",
}
DTYPE_ALIASES = {"float32": "float", "float64": "double", "float16": "half", "bf16": "bfloat16", "int": "int32",
                 "char": "int8", "uint": "uint32"}
ITEMSIZE = {"float32": 4, "float64": 8, "float16": 2, "bfloat16": 2, "int8": 1, "uint8": 1,
            "int32": 4, "uint32": 4, "int64": 8, "uint64": 8}


@dataclass
class PerfOptions:
    """Validated `pycoll perf` settings."""

    nps: list[int] = field(default_factory=lambda: [2])
    peers: list[str] = field(default_factory=lambda: list(PEERS))
    collectives: list[str] = field(default_factory=lambda: list(DEFAULT_COLLECTIVES))
    minbytes: int = 8
    maxbytes: int = 256 << 20
    stepfactor: int = 2
    iters: int = 20
    warmup: int = 5
    min_time: float = 0.02  # small points run more iterations, until about this many seconds of timed calls
    max_iters: int = 1000  # ... but no more iterations than this
    check: int = 1
    dtype: str = "float"
    op: str = "sum"
    inplace: str = "both"
    root: int = 0
    json: Optional[str] = None
    progress: bool = True
    timeout: float = 600.0
    hosts: Optional[int] = None  # virtual hosts (pycoll.netns); None: all ranks on this host as usual
    link_rate: Optional[str] = None
    algos: list[str] = field(default_factory=list)  # forced "collective:name" runs besides the automatic one
    interleave: bool = False  # forced algorithms run inside the automatic pycoll job, per point
    reproducible: bool = False  # also pycoll in reproducible mode (PYCOLL_REPRODUCIBLE=1), as `pycoll[reproducible]`
    rounds: int = 1  # every job this many times, order rotated each round; the median per point is reported
    device: str = "host"  # where the buffers live: host (NumPy) or cuda (CuPy / numba.cuda / torch CUDA tensors)
    buffers: str = "spec"  # spec: [buf, count, MPI.FLOAT]; array: bare arrays; fresh: new arrays every iteration
    argv: list[str] = field(default_factory=list)

    @property
    def np_dtype(self) -> str:
        return DTYPES[self.dtype]

    @property
    def itemsize(self) -> int:
        return ITEMSIZE[self.np_dtype]

    def sizes(self) -> list[int]:
        """-b, then times -f until past -e (as nccl-tests)."""
        out, size = [], self.minbytes
        while size <= self.maxbytes:
            out.append(size)
            size *= self.stepfactor
        return out

    def modes(self) -> list[bool]:
        """The in-place flags measured: out-of-place first."""
        return {"both": [False, True], "out": [False], "in": [True]}[self.inplace]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def command(self) -> str:
        """The command line as typed, or an equivalent one when built without argv."""
        if self.argv:
            return " ".join(["pycoll", "perf", *self.argv])
        flags = [f"--np {','.join(map(str, self.nps))}", f"--peers {','.join(self.peers)}",
                 f"-C {','.join(self.collectives)}", f"-b {self.minbytes} -e {self.maxbytes} -f {self.stepfactor}",
                 f"-n {self.iters} -w {self.warmup} --min-time {self.min_time:g} --max-iters {self.max_iters}",
                 f"-c {self.check} -d {self.dtype} -o {self.op}",
                 f"--inplace {self.inplace} -r {self.root}"]
        if self.hosts:
            flags.append(f"--hosts {self.hosts}" + (f" --link-rate {self.link_rate}" if self.link_rate else ""))
        if self.algos:
            flags.append(f"--algos {','.join(self.algos)}")
        if self.reproducible:
            flags.append("--reproducible")
        if self.interleave:
            flags.append("--interleave")
        if self.rounds > 1:
            flags.append(f"--rounds {self.rounds}")
        if self.device != "host":
            flags.append(f"--device {self.device}")
        if self.buffers != "spec":
            flags.append(f"--buffers {self.buffers}")
        return " ".join(["pycoll", "perf", *flags])

    def algo_groups(self) -> list[tuple[str, list[str]]]:
        """Forced runs: (algorithm name, the chosen collectives it is forced for), one job each."""
        groups: dict[str, list[str]] = {}
        for item in self.algos:
            coll, _, name = item.partition(":")
            groups.setdefault(name, []).append(coll)
        return [(name, [c for c in self.collectives if c in colls]) for name, colls in groups.items()]


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"bad size {text!r}: {exc}") from None


def _choices_list(choices: tuple[str, ...]) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        items = [t.strip() for t in text.split(",") if t.strip()]
        bad = [t for t in items if t not in choices]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"unknown {', '.join(bad) or 'empty list'}; choose from {', '.join(choices)}")
        return list(dict.fromkeys(items))
    return parse


def _np_list(text: str) -> list[int]:
    try:
        values = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad rank counts {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"rank counts must be >= 1, got {text!r}")
    return values


def _positive(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value
    return parse


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds >= 0, got {text}")
    return value


def _dtype(text: str) -> str:
    name = DTYPE_ALIASES.get(text, text)
    if name not in DTYPES:
        raise argparse.ArgumentTypeError(f"unknown type {text!r}; choose from {', '.join(DTYPES)}")
    return name


def _rate(text: str) -> str:
    from pycoll.config import parse_rate

    try:
        parse_rate(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def resolve_algos(spec: Optional[str], collectives: list[str]) -> list[str]:
    """`--algos` to "collective:name" items: "all" (every registered algorithm of each chosen collective),
    "coll:name" items, or bare names (that algorithm for each chosen collective that has it). ValueError if unknown."""
    if not spec:
        return []
    from pycoll.algorithms import ALGORITHMS

    out: list[str] = []
    for item in (t.strip().lower() for t in spec.split(",")):
        if not item:
            continue
        if item == "all":
            out += [f"{c}:{name}" for c in collectives for name in ALGORITHMS.get(c, {})]
        elif ":" in item:
            coll, _, name = item.partition(":")
            if coll not in collectives:
                raise ValueError(f"{item}: {coll} is not among the collectives measured (-C {','.join(collectives)})")
            if name not in ALGORITHMS.get(coll, {}):
                raise ValueError(f"{item}: {coll} has only {', '.join(ALGORITHMS.get(coll, {})) or 'no algorithms'}")
            out.append(item)
        else:
            found = [f"{c}:{item}" for c in collectives if item in ALGORITHMS.get(c, {})]
            if not found:
                raise ValueError(f"no chosen collective has an algorithm named {item!r}")
            out += found
    return list(dict.fromkeys(out))


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The nccl-tests style flags."""
    p.add_argument("--np", type=_np_list, default=[2], metavar="N[,N...]", help="rank counts, e.g. 1,2,4 (default 2)")
    p.add_argument("--peers", type=_choices_list(PEERS), default=list(PEERS), metavar="LIST",
                   help=f"implementations to compare, run one after another (default {','.join(PEERS)})")
    p.add_argument("-C", "--coll", "--collectives", dest="collectives", type=_choices_list(COLLECTIVES),
                   default=list(DEFAULT_COLLECTIVES), metavar="LIST",
                   help=f"collectives, from {','.join(COLLECTIVES)} (default {','.join(DEFAULT_COLLECTIVES)})")
    p.add_argument("-b", "--minbytes", type=_size, default=8, metavar="SIZE", help="smallest size, K/M/G suffixes (default 8)")
    p.add_argument("-e", "--maxbytes", type=_size, default=256 << 20, metavar="SIZE", help="largest size (default 256M)")
    p.add_argument("-f", "--stepfactor", type=_positive(2), default=2, metavar="F", help="size multiplier (default 2)")
    p.add_argument("-n", "--iters", type=_positive(1), default=20, help="timed iterations per size (default 20)")
    p.add_argument("-w", "--warmup_iters", dest="warmup", type=_positive(0), default=5, help="warm-up iterations (default 5)")
    p.add_argument("--min-time", dest="min_time", type=_seconds, default=0.02, metavar="S",
                   help="run a point more than -n times where its calls (timed in the warm-up) would take less than S "
                        "seconds in all, as OSU runs small messages more often: steadier medians (default 0.02; 0: "
                        "exactly -n)")
    p.add_argument("--max-iters", dest="max_iters", type=_positive(1), default=1000, metavar="N",
                   help="the most timed iterations --min-time may give a point (default 1000)")
    p.add_argument("-c", "--check", type=int, choices=(0, 1), default=1, help="check results against NumPy (default 1)")
    p.add_argument("-d", "--datatype", dest="dtype", type=_dtype, default="float", help="nccl-tests type name (default float)")
    p.add_argument("-o", "--op", choices=OPS, default="sum", help="reduction op (default sum)")
    p.add_argument("--inplace", choices=("both", "in", "out"), default="both", help="which buffer modes (default both)")
    p.add_argument("-r", "--root", type=_positive(0), default=0, help="root of broadcast and reduce (default 0)")
    p.add_argument("--json", metavar="FILE", default=None, help="write all records to FILE")
    p.add_argument("--no-progress", dest="progress", action="store_false",
                   help="no progress bar (it is drawn on stderr only when stderr is a terminal)")
    p.add_argument("--timeout", type=float, default=600.0, metavar="S", help="seconds each job may run (default 600)")
    p.add_argument("--hosts", type=_positive(1), default=None, metavar="H",
                   help="spread each job's ranks over H virtual hosts (network namespaces; needs root)")
    p.add_argument("--link-rate", dest="link_rate", type=_rate, default=None, metavar="RATE",
                   help="with --hosts: shape each virtual link to RATE, e.g. 1gbit")
    p.add_argument("--algos", default=None, metavar="LIST",
                   help="also run pycoll once per forced algorithm: 'all' or e.g. allreduce:ring,allreduce:tree")
    p.add_argument("--reproducible", action="store_true",
                   help="also run pycoll in reproducible mode (PYCOLL_REPRODUCIBLE=1: every reduction the rank-order "
                        "left fold, bit for bit), reported as pycoll[reproducible]")
    p.add_argument("--interleave", action="store_true",
                   help="with --algos or --reproducible: measure those runs inside the automatic pycoll job, "
                        "alternating with it iteration by iteration, so that the machine's drifts do not pass for an "
                        "algorithm's")
    p.add_argument("--rounds", type=_positive(1), default=1, metavar="R",
                   help="run every job R times, rotating the job order each round, and report each point's median "
                        "time over the rounds: peers then share the machine's drifts alike (default 1)")
    p.add_argument("--device", choices=("host", "cuda"), default="host",
                   help="where the buffers live: host memory, or the GPU (CuPy or numba.cuda arrays for pycoll, CUDA "
                        "tensors for gloo and nccl; the limit line is then the device-to-device copy) (default host)")
    p.add_argument("--buffers", choices=BUFFERS, default="spec",
                   help="how pycoll and mpi get buffers: spec passes [buf, count, MPI.FLOAT] with the peer's own "
                        "datatype, as programs do; array passes bare NumPy arrays; fresh allocates new arrays before "
                        "every timed iteration (allocation and first touch untimed). gloo and nccl ignore it "
                        "(default spec)")


def from_namespace(ns: argparse.Namespace, parser: argparse.ArgumentParser, argv: list[str]) -> PerfOptions:
    """Cross-checks that single flags can't do; errors go through parser.error (exit 2)."""
    if ns.minbytes > ns.maxbytes:
        parser.error(f"-b {ns.minbytes} is larger than -e {ns.maxbytes}")
    if ns.minbytes == 0:
        parser.error("-b must be at least 1 byte")
    if ns.root >= min(ns.np):
        parser.error(f"--root {ns.root} is not a rank of the smallest job ({min(ns.np)} ranks)")
    if ns.link_rate and not ns.hosts:
        parser.error("--link-rate needs --hosts")
    if ns.hosts and min(ns.np) < ns.hosts:
        parser.error(f"--np {min(ns.np)} leaves some of the {ns.hosts} hosts without ranks")
    try:
        algos = resolve_algos(ns.algos, ns.collectives)
    except ValueError as exc:
        parser.error(f"--algos {exc}")
    keys = PerfOptions.__dataclass_fields__.keys()
    values = {k: getattr(ns, k) for k in keys if hasattr(ns, k) and k not in ("nps", "algos")}
    return PerfOptions(nps=ns.np, argv=list(argv), algos=algos, **values)


def build_parser(prog: str = "pycoll perf") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="nccl-tests style bandwidth sweeps of pycoll, MPI, Gloo and NCCL.")
    add_arguments(p)
    return p


def parse_args(argv: list[str]) -> PerfOptions:
    """Parse `pycoll perf` arguments (without the subcommand name)."""
    parser = build_parser()
    return from_namespace(parser.parse_args(argv), parser, argv)
