"""Error behaviour: bad arguments, mismatched collectives, timeouts and dead peers raise the documented typed errors."""

from __future__ import annotations

import pytest

import harness

pytestmark = pytest.mark.ranks

PEER_LOST = ("PeerFailureError", "RemoteError")  # ProtocolError is a PeerFailureError


def _is(info, *names) -> bool:
    """Whether a recorded exception is (a subclass of) one of ``names``."""
    return bool(info) and any(name in info.get("mro", [info.get("class")]) for name in names)


def _outcomes(res, case_id):
    return res.records(f"errors.{case_id}")


def _fail(res, why):
    pytest.fail(f"{why}\n\n{res.report()}", pytrace=False)


# --------------------------------------------------------------------------------------------
# bad arguments: InvalidArgumentError before any communication, buffers untouched, comm usable
# --------------------------------------------------------------------------------------------


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "n,transport", [pytest.param(1, "shm", id="n1-shm"), pytest.param(3, "shm", id="n3-shm"), pytest.param(2, "tcp", id="n2-tcp")]
)
def test_bad_arguments(n, transport, tmp_path):
    """Each bad-argument kind (dtype, size, contiguity, read-only, root, op/dtype, recvcounts) on every rank."""
    res = harness.run_cases(n, ["errors.bad_args_*"], transport=transport, out_dir=str(tmp_path), job_timeout=80)
    res.assert_ok()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", harness.transports())
def test_recv_truncation(transport, tmp_path):
    """Receiving a message into a too-small buffer raises InvalidArgumentError; the comm stays usable."""
    res = harness.run_cases(2, ["errors.recv_truncation"], transport=transport, out_dir=str(tmp_path), job_timeout=40)
    res.assert_ok()


@pytest.mark.timeout(90)
def test_bad_argument_on_one_rank_does_not_hang(tmp_path):
    """Only rank 0 passes a bad op: it raises InvalidArgumentError; the others raise a PycollError instead of hanging."""
    res = harness.run_cases(3, ["errors.asymmetric_bad_arg"], out_dir=str(tmp_path), job_timeout=60)
    res.assert_ok()
    got = _outcomes(res, "asymmetric_bad_arg")
    if set(got) != {0, 1, 2}:
        _fail(res, f"not every rank recorded an outcome: {got}")
    if not _is(got[0], "InvalidArgumentError"):
        _fail(res, f"rank 0 (bad op) raised {got[0]}, expected InvalidArgumentError")
    for r in (1, 2):
        if not _is(got[r], "PycollError"):
            _fail(res, f"rank {r} did not raise a PycollError: {got[r]}")


def test_foreign_error_on_one_rank_keeps_later_calls_in_line(tmp_path):
    """A non-pycoll exception while one rank reads its arguments (here a TypeError) still consumes the call's number
    on that rank and tells the others, so they neither hang nor meet the next call's messages (the case checks
    the later calls' data)."""
    res = harness.run_cases(3, ["errors.foreign_error_on_one_rank_keeps_calls_in_line"], out_dir=str(tmp_path), job_timeout=60)
    res.assert_ok()
    got = _outcomes(res, "foreign_error_on_one_rank_keeps_calls_in_line")
    if set(got) != {0, 1, 2}:
        _fail(res, f"not every rank recorded an outcome: {got}")
    if not _is(got[0], "TypeError"):
        _fail(res, f"rank 0 raised {got[0]}, expected its own TypeError")
    for r in (1, 2):  # a non-root may finish its send before the root's refusal reaches it
        if got[r].get("class") is not None and not _is(got[r], "PycollError"):
            _fail(res, f"rank {r} raised something other than a PycollError: {got[r]}")


# --------------------------------------------------------------------------------------------
# mismatches. With PYCOLL_CHECK_CALLS=1: every rank raises MismatchError, naming its own call,
# no buffer changes and the communicator still works. By default: never a hang, inputs intact,
# and a MismatchError wherever data flows between ranks that disagree.
# --------------------------------------------------------------------------------------------

# case -> the operation each rank calls, as a function of (rank, size)
MISMATCHES = {
    "mismatch_collective": lambda r, n: "Allreduce" if r == 0 else "Allgather",
    "mismatch_count": lambda r, n: "Allreduce",
    "mismatch_dtype": lambda r, n: "Allreduce",
    "mismatch_op": lambda r, n: "Allreduce",
    "mismatch_root": lambda r, n: "Bcast",
    "mismatch_reduce_root": lambda r, n: "Reduce",
    "mismatch_barrier_vs_bcast": lambda r, n: "Barrier" if r == n - 1 else "Bcast",
}
# Rooted calls whose roots disagree can look consistent to every pair of neighbours.
DATA_FLOW_DETECTS = {"mismatch_collective", "mismatch_count", "mismatch_dtype", "mismatch_op"}


def _check_ops(res, case_id, n, got):
    for r, info in got.items():
        name = MISMATCHES[case_id](r, n)
        if info.get("class") and (not info.get("op") or name not in info["op"]):
            _fail(res, f"rank {r} called {name} but its error's .op is {info.get('op')!r}")


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    "case_id,n,transport",
    [pytest.param(c, 3, "shm", id=f"{c}-n3-shm") for c in MISMATCHES]
    + [pytest.param("mismatch_count", 2, "tcp", id="mismatch_count-n2-tcp"),
       pytest.param("mismatch_root", 4, "tcp", id="mismatch_root-n4-tcp"),
       pytest.param("mismatch_collective", 5, "shm", id="mismatch_collective-n5-shm")],
)
def test_mismatch_checked(case_id, n, transport, tmp_path):
    res = harness.run_cases(
        n, [f"errors.{case_id}"], transport=transport, out_dir=str(tmp_path), job_timeout=60,
        env={"PYCOLL_CHECK_CALLS": "1"},
    )
    res.assert_ok()  # no buffer changed, and the next Allreduce on the communicator worked
    got = _outcomes(res, case_id)
    if set(got) != set(range(n)):
        _fail(res, f"not every rank recorded an outcome: {got}")
    bad = {r: i for r, i in got.items() if not _is(i, "MismatchError")}
    if bad:
        _fail(res, f"with PYCOLL_CHECK_CALLS=1 every rank must raise MismatchError: {bad}")
    _check_ops(res, case_id, n, got)


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    "case_id,n,transport",
    [pytest.param(c, 3, "shm", id=f"{c}-n3-shm") for c in MISMATCHES]
    + [pytest.param("mismatch_count", 2, "tcp", id="mismatch_count-n2-tcp"),
       pytest.param("mismatch_collective", 4, "tcp", id="mismatch_collective-n4-tcp")],
)
def test_mismatch_default(case_id, n, transport, tmp_path):
    res = harness.run_cases(n, [f"errors.{case_id}"], transport=transport, out_dir=str(tmp_path), job_timeout=60)
    res.assert_ok()  # every rank returned (no hang) and its input buffers were unchanged
    got = _outcomes(res, case_id)
    if set(got) != set(range(n)):
        _fail(res, f"not every rank recorded an outcome: {got}")
    allowed = ("MismatchError", "RemoteError", "PeerFailureError")
    bad = {r: i for r, i in got.items() if i.get("class") is not None and not _is(i, *allowed)}
    if bad:
        _fail(res, f"ranks raised something other than {allowed}: {bad}")
    if case_id in DATA_FLOW_DETECTS and not any(_is(i, "MismatchError") for i in got.values()):
        _fail(res, f"no rank raised MismatchError: {got}")
    _check_ops(res, case_id, n, got)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("case_id,opname,finder", [
    ("mismatch_alltoallv_sizes", "Alltoallv", 1),  # the reader of the block finds it
    ("mismatch_gatherv_sizes", "Gatherv", 0),  # the root finds it
    ("mismatch_gatherv_large", "Gatherv", 0),  # the root finds it in the sender's table, as the sender in the root's
])
def test_mismatch_vector_sizes(case_id, opname, finder, tmp_path):
    """Sizes that only some ranks know disagree: the rank that knows both raises MismatchError naming the other and
    the byte counts, and every rank returns with its inputs unchanged."""
    n = 3
    res = harness.run_cases(n, [f"errors.{case_id}"], transport="shm", out_dir=str(tmp_path), job_timeout=60)
    res.assert_ok()
    got = _outcomes(res, case_id)
    if set(got) != set(range(n)):
        _fail(res, f"not every rank recorded an outcome: {got}")
    found = got[finder]
    if not _is(found, "MismatchError") or opname not in (found.get("op") or "") or "bytes" not in found.get("cause", ""):
        _fail(res, f"rank {finder} should raise MismatchError in {opname} naming the byte counts: {found}")
    allowed = ("MismatchError", "RemoteError", "PeerFailureError")
    bad = {r: i for r, i in got.items() if i.get("class") is not None and not _is(i, *allowed)}
    if bad:
        _fail(res, f"ranks raised something other than {allowed}: {bad}")


@pytest.mark.timeout(90)
def test_a_failure_reported_for_a_later_call_spares_the_calls_before_it(tmp_path):
    """A rank that got ahead reports a failure in call 2 before the others made call 1: their call 1 goes on and
    completes (it used to raise CommunicatorBrokenError as it started), and call 2 raises the report everywhere."""
    res = harness.run_cases(3, ["errors.failure_reported_for_a_later_call"], transport="shm", out_dir=str(tmp_path),
                            job_timeout=60)
    res.assert_ok()


# --------------------------------------------------------------------------------------------
# timeouts: comm.timeout = 2 and a rank that never joins
# --------------------------------------------------------------------------------------------

TIMEOUTS = {
    # case: (n, the absent rank as a function of n, op name)
    "timeout_allreduce": (2, lambda n: n - 1, "Allreduce"),
    "timeout_allreduce_warm": (2, lambda n: n - 1, "Allreduce"),
    "timeout_recv": (2, lambda n: n - 1, "Recv"),
    "timeout_wait": (2, lambda n: n - 1, "Iallreduce"),
    "timeout_barrier": (3, lambda n: 0, "Barrier"),
}


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    "case_id,n,transport",
    [pytest.param(c, v[0], "shm", id=f"{c}-n{v[0]}-shm") for c, v in TIMEOUTS.items()]
    + [pytest.param("timeout_allreduce", 3, "tcp", id="timeout_allreduce-n3-tcp"),
       pytest.param("timeout_allreduce_warm", 2, "tcp", id="timeout_allreduce_warm-n2-tcp")],
)
def test_timeout(case_id, n, transport, tmp_path):
    _, absent_of, opname = TIMEOUTS[case_id]
    absent = absent_of(n)
    res = harness.run_cases(n, [f"errors.{case_id}"], transport=transport, out_dir=str(tmp_path), job_timeout=60)
    res.assert_ok()
    got = _outcomes(res, case_id)
    waiting = [r for r in range(n) if r != absent]
    for r in waiting:
        info = got.get(r)
        if n == 2:
            # the only peer is the absent one: a TimeoutError that names it
            if not _is(info, "TimeoutError"):
                _fail(res, f"rank {r} raised {info}, expected TimeoutError")
        elif not _is(info, "TimeoutError", "RemoteError", "PeerFailureError", "CommunicatorBrokenError"):
            _fail(res, f"rank {r} raised {info}, expected TimeoutError (or RemoteError after another rank's timeout)")
        if _is(info, "TimeoutError"):
            if not info.get("peers"):
                _fail(res, f"rank {r}: TimeoutError names no peer: {info}")
            if absent not in info["peers"] and n == 2:
                _fail(res, f"rank {r}: TimeoutError names peers {info['peers']}, not the absent rank {absent}")
            if not info.get("op") or opname not in info["op"]:
                _fail(res, f"rank {r}: TimeoutError .op {info.get('op')!r} does not name {opname}")
    timeouts = [got[r] for r in waiting if _is(got.get(r), "TimeoutError")]
    if not timeouts:
        _fail(res, f"no rank raised TimeoutError: {got}")
    if not any(absent in t["peers"] for t in timeouts):
        _fail(res, f"no TimeoutError names the absent rank {absent}: {timeouts}")


@pytest.mark.timeout(60)
def test_timeout_default_from_env(tmp_path):
    """comm.timeout starts at $PYCOLL_TIMEOUT and is per communicator."""
    res = harness.run_cases(2, ["errors.timeout_default_from_env"], out_dir=str(tmp_path), comm_timeout=77, job_timeout=40)
    res.assert_ok()


# --------------------------------------------------------------------------------------------
# dead peers: a rank that os._exit(3)s makes the others raise PeerFailureError / RemoteError
# --------------------------------------------------------------------------------------------


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    "case_id,n,transport",
    [
        pytest.param("dead_peer", 3, "shm", id="between-n3-shm"),
        pytest.param("dead_peer", 3, "tcp", id="between-n3-tcp"),
        pytest.param("dead_peer", 2, "shm", id="between-n2-shm"),
        pytest.param("dead_peer", 2, "tcp", id="between-n2-tcp"),
        pytest.param("dead_peer_midstream", 3, "shm", id="midstream-n3-shm"),
        pytest.param("dead_peer_midstream", 4, "tcp", id="midstream-n4-tcp"),
    ],
)
def test_dead_peer(case_id, n, transport, tmp_path):
    """The survivors' comm.timeout is 120 s; the test's 90 s limit means they noticed without it.

    PYCOLL_LAUNCH_GRACE=60 keeps the launcher from stopping the survivors before they report.
    """
    victim = 1 % n if case_id == "dead_peer" else n - 1
    res = harness.run_cases(
        n, [f"errors.{case_id}"], transport=transport, out_dir=str(tmp_path), job_timeout=75,
        comm_timeout=120, env={"PYCOLL_LAUNCH_GRACE": "60"},
    )
    got = _outcomes(res, case_id)
    if res.proc.returncode == 0:
        _fail(res, "the launcher exited 0 although a rank exited with code 3")
    if got.get(victim, {}).get("class") != "victim":
        _fail(res, f"the victim rank {victim} did not get to its exit: {got}")
    for r in range(n):
        if r == victim:
            continue
        d = res.ranks.get(r)
        if d is None or not d.get("finished"):
            _fail(res, f"survivor rank {r} did not finish (still blocked on the dead peer?)")
        if d.get("failures"):
            _fail(res, f"survivor rank {r} recorded failures")
        info = got.get(r)
        if not _is(info, *PEER_LOST):
            _fail(res, f"survivor rank {r} raised {info}, expected PeerFailureError or RemoteError")
        if not info.get("op") or "Allreduce" not in info["op"]:
            _fail(res, f"survivor rank {r}: .op {info.get('op')!r} does not name Allreduce")
    named = [r for r in range(n) if r != victim and victim in (got[r].get("peers") or [])]
    if not named:
        _fail(res, f"no survivor's error names the dead rank {victim}: {got}")
