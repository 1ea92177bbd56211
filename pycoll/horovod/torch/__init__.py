"""Horovod's PyTorch API on pycoll: ``import pycoll.horovod.torch as hvd`` in place of ``import horovod.torch as hvd``.

The tensor calls are in ``api``, init, ranks and process sets in ``processes``, the optimizer and its broadcast
helpers in ``optimizer``; this package re-exports them.
"""

from __future__ import annotations

from .api import (  # noqa: F401
    Average, Sum, Adasum, Min, Max, Product, Compression, allreduce, allreduce_, allreduce_async, allreduce_async_,
    grouped_allreduce, grouped_allreduce_, grouped_allreduce_async, grouped_allreduce_async_, allgather,
    allgather_async, broadcast, broadcast_, broadcast_async, broadcast_async_, alltoall, alltoall_async, reducescatter,
    reducescatter_async, barrier, join, broadcast_object, allgather_object,
)
from .processes import (  # noqa: F401
    ProcessSet, global_process_set, add_process_set, remove_process_set, init, shutdown, is_initialized, rank, size,
    local_rank, local_size, cross_rank, cross_size, is_homogeneous, poll, synchronize, HorovodInternalError,
    mpi_threads_supported, mpi_enabled, mpi_built, gloo_enabled, gloo_built, nccl_built, cuda_built, rocm_built,
    start_timeline,
)
from .optimizer import DistributedOptimizer, broadcast_optimizer_state, broadcast_parameters  # noqa: F401

__all__ = [
    "Average", "Sum", "Adasum", "Min", "Max", "Product", "Compression", "ProcessSet", "global_process_set",
    "add_process_set", "remove_process_set", "init", "shutdown", "is_initialized", "rank", "size", "local_rank",
    "local_size", "cross_rank", "cross_size", "is_homogeneous", "allreduce", "allreduce_", "allreduce_async",
    "allreduce_async_", "grouped_allreduce", "grouped_allreduce_", "grouped_allreduce_async",
    "grouped_allreduce_async_", "allgather", "allgather_async", "broadcast", "broadcast_", "broadcast_async",
    "broadcast_async_", "alltoall", "alltoall_async", "reducescatter", "reducescatter_async", "barrier", "join",
    "poll", "synchronize", "broadcast_object", "allgather_object", "HorovodInternalError", "mpi_threads_supported",
    "mpi_enabled", "mpi_built", "gloo_enabled", "gloo_built", "nccl_built", "cuda_built", "rocm_built",
    "start_timeline", "DistributedOptimizer", "broadcast_parameters", "broadcast_optimizer_state",
]
