"""Collective algorithms, each registered by name with its cost, and the selection among them."""

from __future__ import annotations

from . import ring, chain, direct, tree, halving_doubling, hierarchical, shared, staged, cuda_ipc, scan, ordered, slots, direct_cma, owner  # noqa: F401, I001  (import order = tie order)
from .base import CHUNK_SIZE, Call, Layout, Steps
from .check import CHECK_CALLS, verify_call
from .cost import CostModel
from .registry import ALGO, ALGORITHMS, COLLECTIVES, Algorithm, last_choice, ranked, register, select

__all__ = [
    "CHECK_CALLS", "verify_call", "ALGO", "ALGORITHMS", "CHUNK_SIZE", "COLLECTIVES", "Algorithm", "Call", "CostModel",
    "Layout", "Steps", "last_choice", "ranked", "register", "select",
]
