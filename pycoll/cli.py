"""The `pycoll` command line: `run`, `info`, and the subcommands other modules register."""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Any, Callable, Optional, Union

# Registers a subcommand: called with argparse's subparsers object, it must add one parser named
# like its entry and `set_defaults(func=handler)`, where handler(args) returns the exit code.
AddParser = Callable[["argparse._SubParsersAction"], Any]

OPTIONAL_PACKAGES = ("mpi4py", "torch", "cupy", "numba", "ml_dtypes", "pynvml")


def _version(dist: str) -> str:
    import importlib.metadata

    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _import_status(name: str) -> str:
    """The package's version if it imports, else why not."""
    try:
        mod = importlib.import_module(name)
    except ImportError:
        return "not installed"
    except Exception as exc:  # installed but broken (e.g. a missing native library)
        return f"fails to import ({type(exc).__name__}: {exc})"
    return str(getattr(mod, "__version__", None) or _version(name))


def _bootstrap_status() -> str:
    import importlib.util

    from pycoll.bootstrap.rendezvous import detect_launcher

    launcher = detect_launcher()
    notes = {
        "pycoll": "pycoll run's TCP store",
        "srun": "TCP store hosted by rank 0 on PYCOLL_MASTER_ADDR:PYCOLL_MASTER_PORT",
        "singleton": "rank 0 of 1, no launcher found",
    }
    if launcher in ("torchrun", "env"):
        has_torch = importlib.util.find_spec("torch") is not None
        note = "torch TCPStore (env://)" if has_torch else "TCP store hosted by rank 0 on MASTER_ADDR:MASTER_PORT"
    elif launcher == "mpiexec":
        has_mpi4py = importlib.util.find_spec("mpi4py") is not None
        note = "TCP store, address sent with mpi4py" if has_mpi4py else "mpi4py missing: pip install 'pycoll[mpi]'"
    else:
        note = notes[launcher]
    return f"{launcher} ({note})"


def _rdma_status() -> str:
    """The RDMA ports this host would use, best first, or why RDMA is off."""
    from pycoll.transport.rdma import RdmaTransport
    from pycoll.transport.rdma_proto import NoRdma

    try:
        ports = RdmaTransport().probe()
        return ", ".join(f"{p.label} ({p.link_layer}, lid {p.lid}, gid[{p.gid_index}] {p.gid})" for p in ports)
    except NoRdma as exc:
        return f"off ({exc})"
    except Exception as exc:  # a provider surprise: still report, never fail `pycoll info`
        return f"off ({type(exc).__name__}: {exc})"


def info_command(args: argparse.Namespace) -> int:
    """Entry point of ``pycoll info``."""
    import platform

    rows = [
        ("pycoll", _import_status("pycoll")),
        ("python", f"{platform.python_version()} ({sys.executable})"),
        ("numpy", _import_status("numpy")),
    ]
    rows += [(name, _import_status(name)) for name in OPTIONAL_PACKAGES]
    rows.append(("rdma", _rdma_status()))
    rows.append(("bootstrap", _bootstrap_status()))
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    return 0


def add_info_parser(subparsers: "argparse._SubParsersAction") -> argparse.ArgumentParser:
    """Register ``pycoll info``."""
    p = subparsers.add_parser("info", help="show versions, optional packages and the bootstrap in use")
    p.set_defaults(func=info_command)
    return p


def add_warmup_parser(subparsers: Any) -> Any:
    """`pycoll warmup`: build the ahead-of-time kernels for the current sources (``pycoll.native_build``), else
    compile every kernel signature into Numba's disk cache, so no job compiles (or waits); and the package's
    bytecode, so no rank compiles pycoll's source on import."""
    p = subparsers.add_parser("warmup", help="build the compiled kernels now (pip install does it; run after editing them)")

    def run(args: Any) -> int:
        import time

        from .algorithms.arena_jit import warm_up

        t0 = time.perf_counter()
        try:
            from . import native_build

            native_build.compile_bytecode()
            native_build.build()
        except Exception as exc:  # noqa: BLE001 - no compiler, no pycc: the JIT's cache instead
            print(f"pycoll warmup: no ahead-of-time build ({type(exc).__name__}: {exc}); filling Numba's cache")
        why = warm_up()
        if why is not None:
            print(f"pycoll warmup: the compiled path is off here: {why}")
            return 1
        print(f"pycoll warmup: kernels ready in {time.perf_counter() - t0:.1f} s")
        return 0

    p.set_defaults(func=run)
    return p


# Subcommands in help order. An entry's second item is the add-parser function itself or
# "module:function", imported only when the CLI is built (keeps heavy modules off `pycoll run`).
SUBCOMMANDS: list[tuple[str, Union[AddParser, str]]] = [
    ("run", "pycoll.launcher:add_run_parser"),
    ("info", add_info_parser),
    ("plot", "pycoll.perf.plot:add_plot_parser"),
    ("perf", "pycoll.perf.command:add_perf_parser"),
    ("tune", "pycoll.tune:add_tune_parser"),
    ("topo", "pycoll.topology.cli:add_topo_parser"),
    ("simulate", "pycoll.perf.simulate:add_simulate_parser"),
    ("warmup", add_warmup_parser),
]


def _resolve(entry: Union[AddParser, str]) -> AddParser:
    if callable(entry):
        return entry
    module, _, func = entry.partition(":")
    return getattr(importlib.import_module(module), func)


def build_parser(only: Optional[str] = None) -> argparse.ArgumentParser:
    """The top-level parser with every registered subcommand, or with subcommand ``only`` alone (start-up: `pycoll
    run` then imports neither the other subcommands' modules nor NumPy)."""
    parser = argparse.ArgumentParser(prog="pycoll", description="pycoll: collective communication for Python.")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, entry in SUBCOMMANDS:
        if only is not None and name != only:
            continue
        _resolve(entry)(subparsers)
        if name not in subparsers.choices:
            raise RuntimeError(f"the add-parser function of {name!r} did not register a subcommand {name!r}")
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    """Run the CLI; returns the exit code."""
    args_in = sys.argv[1:] if argv is None else argv
    # A known subcommand first: its parser parses the rest as the full parser would (help and errors alike).
    first = args_in[0] if args_in else None
    parser = build_parser(first if first in dict(SUBCOMMANDS) else None)
    args = parser.parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help(sys.stderr)
        return 2
    return int(func(args) or 0)
