"""`pycoll perf` on the command line: its parser (the options, ``pycoll.perf.options``) and the sweep it runs."""

from __future__ import annotations

import argparse
import sys

from pycoll.perf.options import add_arguments, from_namespace


def _perf_command(args: argparse.Namespace) -> int:
    from pycoll.perf.sweep import run_sweep  # heavy part imported only when perf runs

    argv = sys.argv[2:] if sys.argv[1:2] == ["perf"] else []  # else: command() rebuilds it
    return run_sweep(from_namespace(args, args._perf_parser, argv))


def add_perf_parser(subparsers: "argparse._SubParsersAction") -> argparse.ArgumentParser:
    """Register `pycoll perf`."""
    p = subparsers.add_parser("perf", help="nccl-tests style sweeps: pycoll against mpi4py, Gloo and NCCL",
                              description="nccl-tests style bandwidth sweeps of pycoll, MPI, Gloo and NCCL.")
    add_arguments(p)
    p.set_defaults(func=_perf_command, _perf_parser=p)
    return p
