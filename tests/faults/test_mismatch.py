"""Mismatch matrix in real jobs: every rank that takes part in a disagreeing call raises a MismatchError."""

from __future__ import annotations

import json
import os

import pytest

import harness

HERE = os.path.dirname(os.path.abspath(__file__))
# No data flows between ranks whose Reduce roots disagree (each waits to receive): the status probe after 1 s
# of waiting finds those. A rank whose part completes locally (a buffered send) returns; its next call raises.

pytestmark = pytest.mark.ranks


def _run(n: int, transport: str, tmp_path, check_calls: bool):
    argv = [harness.PYTHON, os.path.join(HERE, "mismatch_rank.py"), str(tmp_path)]
    env = harness.rank_env(transport, extra={"PYCOLL_CHECK_CALLS": "1"} if check_calls else None)
    proc = harness.launch(harness.launcher_cmd(n, argv), env, timeout=240)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    return [json.loads((tmp_path / f"mismatch{r}.json").read_text()) for r in range(n)]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("n,transport,check_calls", [(3, "shm", False), (4, "tcp", False), (3, "shm", True)])
def test_mismatch_matrix(n: int, transport: str, check_calls: bool, tmp_path) -> None:
    ranks = _run(n, transport, tmp_path, check_calls)
    everywhere = somewhere = tried = 0
    for i, first in enumerate(ranks[0]):
        name = first["case"]
        errors = [r[i]["error"] for r in ranks]
        mismatch = ["MismatchError" in (e or {}).get("mro", ()) for e in errors]
        tried += 1
        everywhere += all(mismatch)
        somewhere += any(mismatch)
        if check_calls:
            assert all(mismatch), (name, errors)
            continue
        assert any(mismatch), (name, errors)
        for r, e in enumerate(errors):
            if e is None:  # its part completed before anyone found the mismatch: its next call raises
                assert ranks[r][i]["next"] not in (None, "completed"), (name, r, ranks[r][i])
            else:
                assert "MismatchError" in e["mro"] and e["msg"].count("called") >= 2, (name, r, e)  # both calls named
    print(f"mismatch cases on {n} ranks over {transport} (check_calls={check_calls}): {tried} tried, "
          f"{somewhere} detected, {everywhere} raised on every rank")
