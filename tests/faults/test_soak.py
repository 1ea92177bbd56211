"""Short soak in CI: thousands of small and tens of large collectives leave RSS, descriptors and /dev/shm flat."""

from __future__ import annotations

import json
import os
import sys

import pytest

import harness

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from soak_rank import growth  # noqa: E402

pytestmark = pytest.mark.ranks


@pytest.mark.timeout(300)
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_short_soak_is_flat(transport: str, tmp_path) -> None:
    small, large = (20000, 100) if transport == "shm" else (5000, 30)
    argv = [harness.PYTHON, os.path.join(HERE, "soak_rank.py"), "--small", str(small), "--large", str(large),
            "--large-bytes", str(4 << 20), "--out", str(tmp_path)]
    # The compiled kernels load with the communicator, before the first sample: their one-time memory and the
    # cache files a background load opens would read as growth (a soak looks for leaks in the steady state).
    env = harness.rank_env(transport, extra={"PYCOLL_ARENA_JIT_LOAD": "now"})
    proc = harness.launch(harness.launcher_cmd(2, argv), env, timeout=240)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    for r in range(2):
        with open(tmp_path / f"soak{r}.json") as fh:
            data = json.load(fh)
        assert (data["small"], data["large"]) == (small, large)
        g = growth(data["samples"])
        print(f"rank {r} {transport}: {g}")
        assert g["fds"] == 0, f"open descriptors grew: {data['samples']}"
        assert g["shm"] == 0 and g["shm_entries_at_end"] == 0, f"/dev/shm entries: {data['samples']}"
        assert g["rss_max_bytes"] < 8 << 20, f"RSS grew by {g['rss_max_bytes']} bytes: {data['samples']}"
