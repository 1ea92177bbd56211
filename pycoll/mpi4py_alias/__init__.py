"""The folder `pycoll run --mpi4py` puts first on the ranks' PYTHONPATH, so that its `mpi4py` package shadows the real one."""
