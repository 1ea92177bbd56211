"""`mpi4py.MPI` under `pycoll run --mpi4py`: replaces itself with pycoll.MPI, so both names are one module."""

import sys

import pycoll.MPI

sys.modules[__name__] = pycoll.MPI
