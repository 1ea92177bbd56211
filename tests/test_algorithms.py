"""Algorithm registry and selection: the PYCOLL_ALGO override, refusal and fallback."""

from __future__ import annotations

import numpy as np
import pytest

from pycoll.algorithms import ALGORITHMS, COLLECTIVES, Call, Layout, register, select
from pycoll.algorithms.base import even_counts, split
from pycoll.algorithms.registry import parse_override
from pycoll.errors import InvalidArgumentError


def test_every_collective_has_a_default() -> None:
    for coll in COLLECTIVES:
        assert ALGORITHMS[coll], f"no algorithm for {coll}"
        algo = select(Call(coll, np.dtype(np.float32), recv=np.zeros(4, np.float32)), 4)
        assert algo.collective == coll and algo.description and algo.steps and algo.bytes


def test_override_syntax_and_errors() -> None:
    assert parse_override("allreduce:ring, allgather:ring") == {"allreduce": "ring", "allgather": "ring"}
    with pytest.raises(InvalidArgumentError, match="has only"):
        parse_override("allreduce:nonesuch")
    with pytest.raises(InvalidArgumentError, match="collective:algorithm"):
        parse_override("ring")


def test_forced_algorithm_that_refuses_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    @register("barrier", "picky-test", "Refuses everything (test only).", steps="0", bytes="0", refuse=lambda c, p: "never")
    def picky(st, call):  # pragma: no cover - never selected
        yield ()

    try:
        monkeypatch.setenv("PYCOLL_ALGO", "barrier:picky-test")
        assert select(Call("barrier", np.dtype(np.uint8)), Layout((0, 1, 2))).name == "dissemination"
    finally:
        del ALGORITHMS["barrier"]["picky-test"]


@pytest.mark.parametrize("n,parts", [(0, 3), (1, 3), (7, 3), (10, 5), (1000, 7)])
def test_split_is_exact_and_near_even(n: int, parts: int) -> None:
    arr = np.arange(n)
    pieces = split(arr, parts)
    assert len(pieces) == parts
    np.testing.assert_array_equal(np.concatenate(pieces), arr)
    sizes = even_counts(n, parts)
    assert max(sizes) - min(sizes) <= 1 and sum(sizes) == n
