"""Collective algorithms, each registered by name with its cost, and the selection among them."""

from __future__ import annotations

from . import chain, direct, ring  # noqa: F401  (importing registers them)
from .base import CHUNK_SIZE, Call, Steps
from .check import CHECK_CALLS, verify_call
from .registry import ALGO, ALGORITHMS, COLLECTIVES, Algorithm, register, select

__all__ = ["CHECK_CALLS", "verify_call", "ALGO", "ALGORITHMS", "CHUNK_SIZE", "COLLECTIVES", "Algorithm", "Call", "Steps", "register", "select"]
