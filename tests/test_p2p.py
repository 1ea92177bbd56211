"""Point-to-point on 1..5 ranks over shm (2, 3 and 5 over tcp): tags, wildcards and Status, self-sends, large two-way traffic."""

from __future__ import annotations

import pytest

import harness

pytestmark = [pytest.mark.ranks, pytest.mark.timeout(180)]


@pytest.mark.parametrize(
    "n,transport", [pytest.param(n, t, id=f"n{n}-{t}") for n, t in harness.jobs()]
)
def test_p2p(n, transport, tmp_path):
    res = harness.run_cases(n, ["p2p.*"], transport=transport, out_dir=str(tmp_path), job_timeout=140)
    res.assert_ok()
    print(f"{res.label}: {res.proc.wall_s:.1f} s; slowest: {res.slowest()}; notes: {res.notes()}")


@pytest.mark.parametrize("n", [3, 4])
def test_p2p_compiled_eager(n, tmp_path):
    """The same cases with the kernels loaded before the first call, so eager sends and receives run compiled
    (3 and 4 ranks on 2 cores: the oversubscribed spin)."""
    res = harness.run_cases(n, ["p2p.*"], transport="shm", out_dir=str(tmp_path), job_timeout=140,
                            env={"PYCOLL_ARENA_JIT_LOAD": "now"})
    res.assert_ok()


def test_p2p_over_tcp_with_frames_moved_in_python_and_writes_in_odd_slices(tmp_path):
    """The same cases over TCP on 3 ranks with the C frame swap off (PYCOLL_TCP_FRAME_C=0): the engine's Python
    path for small frames between hosts, which a build without pycoll/transport/_tcpframe.c runs; and the engine's
    writes cut every 1000 bytes (PYCOLL_TCP_PUSH_SLICE), so a write ends inside a header, a payload or its padding."""
    res = harness.run_cases(3, ["p2p.*"], transport="tcp", out_dir=str(tmp_path), job_timeout=140,
                            env={"PYCOLL_TCP_FRAME_C": "0", "PYCOLL_TCP_PUSH_SLICE": "1000"})
    res.assert_ok()
