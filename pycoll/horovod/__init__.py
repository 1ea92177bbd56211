"""Horovod's programming model on pycoll: ``import pycoll.horovod.torch as hvd`` runs a Horovod training script.

``engine`` is the framework-neutral part (one background thread per process set: named requests, negotiation
across ranks, a response cache, tensor fusion, a timeline), on NumPy arrays and a pycoll communicator;
``pycoll.horovod.torch`` is Horovod's PyTorch API over it. docs/horovod.md says what is there and what differs.
"""
