"""pycoll perf: nccl-tests style sweeps against MPI, Gloo and NCCL, and their plots."""
