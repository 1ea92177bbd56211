"""Which peers can run here (with a one-line reason when not) and the command that launches each."""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import sys
from pathlib import Path
from typing import Optional


def inside_mpi_job() -> bool:
    """True when this process is a rank of an mpiexec job (MPICH/Hydra or Open MPI)."""
    return any(k in os.environ for k in ("PMI_RANK", "OMPI_COMM_WORLD_RANK"))


def find_mpiexec() -> Optional[str]:
    """mpiexec next to sys.executable (a venv's mpich), else on PATH."""
    local = Path(sys.executable).parent / "mpiexec"
    if local.exists() and os.access(local, os.X_OK):
        return str(local)
    return shutil.which("mpiexec")


def _missing(module: str) -> Optional[str]:
    return None if importlib.util.find_spec(module) is not None else f"{module} is not installed"


def unavailable(peer: str, in_mpi: bool = False, dtype: str = "float", hosts: Optional[int] = None) -> Optional[str]:
    """None if the peer can run, else a one-line reason."""
    if peer == "pycoll":
        return None
    if hosts and not in_mpi and peer in ("mpi", "nccl"):
        return f"{'mpiexec' if peer == 'mpi' else 'nccl'} is not run on virtual hosts (--hosts); pycoll and gloo are"
    if peer == "mpi":
        if dtype == "bfloat16":
            return "MPI has no bfloat16 datatype"
        reason = _missing("mpi4py")
        if reason or in_mpi:
            return reason
        return None if find_mpiexec() else "no mpiexec next to python or on PATH"
    if peer in ("gloo", "nccl"):
        reason = _missing("torch")
        if reason:
            return reason
        if in_mpi:
            return "runs only under pycoll run, not inside an mpiexec job"
        try:
            import torch.distributed as dist
        except Exception as exc:  # broken install
            return f"torch.distributed fails to import ({type(exc).__name__})"
        if not dist.is_available():
            return "torch was built without torch.distributed"
        if peer == "gloo":
            return None if dist.is_gloo_available() else "torch was built without gloo"
        import torch
        if not torch.cuda.is_available():
            return "no CUDA GPU on this machine"
        return None if dist.is_nccl_available() else "torch was built without nccl"
    return f"unknown peer {peer}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch_command(peer: str, nranks: int, spec_json: str, hosts: Optional[int] = None,
                   link_rate: Optional[str] = None, env_extra: Optional[dict[str, str]] = None
                   ) -> tuple[list[str], dict[str, str]]:
    """argv and environment of one job: mpiexec for mpi, `pycoll run` (on virtual hosts with hosts) for the others."""
    worker = [sys.executable, "-m", "pycoll.perf.worker", "--spec", spec_json]
    env = dict(os.environ)
    env.update(env_extra or {})
    if peer == "mpi":
        return [find_mpiexec() or "mpiexec", "-n", str(nranks), *worker], env
    run = [sys.executable, "-m", "pycoll", "run", "-n", str(nranks)]
    if hosts:
        run += ["--hosts", str(hosts)] + (["--link-rate", link_rate] if link_rate else [])
    if peer in ("gloo", "nccl"):
        env["MASTER_PORT"] = str(free_port())
        if hosts:  # the worker takes host 0's address from PYCOLL_STORE_ADDR; gloo must use the virtual link
            from pycoll.netns import HOST_IFNAME

            env.pop("MASTER_ADDR", None)
            env["GLOO_SOCKET_IFNAME"] = HOST_IFNAME
        else:
            env["MASTER_ADDR"] = "127.0.0.1"
    return [*run, "--", *worker], env
