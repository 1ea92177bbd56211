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


def _torch_dist_missing() -> Optional[str]:
    """None when torch.distributed imports, else why not."""
    reason = _missing("torch")
    if reason:
        return reason
    try:
        import torch.distributed as dist
    except Exception as exc:  # broken install
        return f"torch.distributed fails to import ({type(exc).__name__})"
    return None if dist.is_available() else "torch was built without torch.distributed"


def _torch_cuda_missing() -> Optional[str]:
    import torch

    return None if torch.cuda.is_available() else "no CUDA GPU on this machine"


def _torch_nccl_missing() -> Optional[str]:
    reason = _torch_dist_missing() or _torch_cuda_missing()
    if reason:
        return reason
    import torch.distributed as dist

    return None if dist.is_nccl_available() else "torch was built without nccl"


def _cupy_nccl_missing() -> Optional[str]:
    from pycoll.perf import devices

    if devices.simulator():
        return "numba's CUDA simulator is on (NUMBA_ENABLE_CUDASIM), and CuPy needs a real GPU"
    reason = _missing("cupy")
    if reason:
        return reason
    try:
        import cupy
        from cupy.cuda import nccl

        nccl.get_version()
    except Exception as exc:  # CuPy built without NCCL, or the NCCL library is not found
        return f"cupy.cuda.nccl is unusable ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # no driver
        return f"CuPy finds no CUDA driver ({type(exc).__name__})"
    return None if count > 0 else "CuPy sees no CUDA GPU"


def nccl_route() -> tuple[Optional[str], str]:
    """How the nccl peer reaches NCCL: ("torch" or "cupy", "") or (None, why neither can).

    torch.distributed's nccl backend first, CuPy's cupy.cuda.nccl where torch lacks CUDA or NCCL;
    PYCOLL_PERF_NCCL=torch or =cupy allows only that one."""
    forced = os.environ.get("PYCOLL_PERF_NCCL", "").strip().lower()
    routes = {"torch": _torch_nccl_missing, "cupy": _cupy_nccl_missing}
    if forced and forced not in routes:
        return None, f"PYCOLL_PERF_NCCL={forced!r}: choose torch or cupy"
    reasons = []
    for name, missing in routes.items():
        if forced and name != forced:
            continue
        why = missing()
        if why is None:
            return name, ""
        reasons.append((name, why))
    if len(reasons) == 1:
        return None, reasons[0][1]
    (_, t), (_, c) = reasons
    if t == c or (t == "no CUDA GPU on this machine" and c in ("cupy is not installed", "CuPy sees no CUDA GPU")):
        return None, t
    return None, f"torch: {t}; CuPy: {c}"


def unavailable(peer: str, in_mpi: bool = False, dtype: str = "float", hosts: Optional[int] = None,
                device: str = "host") -> Optional[str]:
    """None if the peer can run, else a one-line reason."""
    if peer == "pycoll":
        if device == "cuda":
            from pycoll.perf import devices

            return devices.numba_cuda_missing()
        return None
    if hosts and not in_mpi and peer == "nccl":
        return "nccl is not run on virtual hosts (--hosts): they have no GPUs of their own"
    if peer == "mpi":
        if device == "cuda":
            return "--device cuda: the mpi peer moves host buffers only (pip's MPICH is not built CUDA-aware)"
        if dtype == "bfloat16":
            return "MPI has no bfloat16 datatype"
        reason = _missing("mpi4py")
        if reason or in_mpi:
            return reason
        return None if find_mpiexec() else "no mpiexec next to python or on PATH"
    if peer in ("gloo", "nccl"):
        if in_mpi:
            return _missing("torch") or "runs only under pycoll run, not inside an mpiexec job"
        if peer == "nccl":
            return nccl_route()[1] or None
        reason = _torch_dist_missing()
        if reason:
            return reason
        import torch.distributed as dist

        if not dist.is_gloo_available():
            return "torch was built without gloo"
        return _torch_cuda_missing() if device == "cuda" else None
    return f"unknown peer {peer}"


def job_unavailable(peer: str, nranks: int, gpus: int) -> Optional[str]:
    """None if one job of ``nranks`` ranks can run, else why not: NCCL takes one GPU per rank."""
    if peer == "nccl" and nranks > gpus:
        return (f"NCCL refuses {nranks} ranks on {gpus} GPU{'' if gpus == 1 else 's'} in one communicator "
                "(\"Duplicate GPU detected\"): it takes one GPU per rank")
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch_command(peer: str, nranks: int, spec_json: str, hosts: Optional[int] = None,
                   link_rate: Optional[str] = None, env_extra: Optional[dict[str, str]] = None
                   ) -> tuple[list[str], dict[str, str]]:
    """argv and environment of one job: mpiexec for mpi, `pycoll run` for the others; with ``hosts``, on that
    many virtual hosts."""
    worker = [sys.executable, "-m", "pycoll.perf.worker", "--spec", spec_json]
    env = dict(os.environ)
    env.update(env_extra or {})
    if peer == "mpi":
        if hosts:  # mpiexec inside the virtual hosts, its traffic between them on their links (pycoll.perf.mpi_hosts)
            return [sys.executable, "-m", "pycoll.perf.mpi_hosts", "-n", str(nranks), "--hosts", str(hosts),
                    *(["--link-rate", link_rate] if link_rate else []), "--", *worker], env
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
