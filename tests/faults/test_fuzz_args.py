"""Fuzzed arguments (hypothesis): every bad argument raises InvalidArgumentError before any communication, inputs untouched.

Each example is one call of a collective (blocking or ``I...``) or of Send/Recv with at most one defect:
wrong dtype or count, non-contiguous or read-only buffer, a non-buffer, a bad buffer spec or vector
counts, a bad root, an op the dtype cannot take, aliased send and receive buffers. A call with a defect
must raise InvalidArgumentError naming the call and leave every buffer byte for byte as it was; a call
without one must match NumPy. In-process examples run on MPI.COMM_SELF (1 rank, no launcher); the
multi-rank job runs the same generator on every rank (derandomized, so every rank draws the same calls)
and ends with a correct Allreduce. The last test prints "fuzzed inputs tried: N".
"""

from __future__ import annotations

import glob
import json
import os
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import fuzz_cases as fz  # noqa: E402
import harness  # noqa: E402

TRIED = {"in-process": 0, "ranks": 0}
SETTINGS = dict(deadline=None, derandomize=True, database=None, suppress_health_check=fz.FUZZ_SETTINGS["suppress_health_check"])


@pytest.fixture(scope="module")
def mpi():
    from pycoll import MPI

    return MPI


@pytest.fixture(scope="module")
def comm(mpi):
    """MPI.COMM_SELF: one rank, no launcher needed."""
    c = mpi.COMM_SELF
    assert c.Get_size() == 1 and c.Get_rank() == 0
    return c


def _healthy(comm, mpi):
    out = np.zeros(3, np.int64)
    comm.Allreduce(np.arange(3, dtype=np.int64), out, op=mpi.SUM)
    assert out.tolist() == [0, 1, 2]


# --------------------------------------------------------------------------------------------
# collectives on one rank
# --------------------------------------------------------------------------------------------


@settings(max_examples=2500, **SETTINGS)
@given(ex=fz.examples(1))
def test_collective_arguments(comm, mpi, ex):
    TRIED["in-process"] += 1
    problems = fz.run_one(comm, mpi, ex)
    assert not problems, "\n".join(problems)


@settings(max_examples=150, **SETTINGS)
@given(steps=st.lists(st.sampled_from(fz.STEPS), min_size=1, max_size=8), dtype=st.sampled_from(fz.DTYPES),
       n=st.integers(1, 6), seed=st.integers(0, 2**31))
def test_cached_plan_rechecks(comm, mpi, steps, dtype, n, seed):
    """Allreduce on the same arrays, changed between calls: the cached plan never lets a bad call through."""
    TRIED["in-process"] += 1
    problems = fz.run_plan_steps(comm, mpi, steps, dtype, n, seed)
    assert not problems, "\n".join(problems)


def test_comm_usable_after_fuzzing(comm, mpi):
    _healthy(comm, mpi)


# --------------------------------------------------------------------------------------------
# point-to-point on one rank: only PROC_NULL is a valid peer (no self messages)
# --------------------------------------------------------------------------------------------

BAD_PEERS = (-5, 1, 7, 1.5, "0", None, [0], np.array([0, 1]), np.float64(0.0))
BAD_TAGS = (-3, 1.5, "t", None, np.array([1, 2]))


@st.composite
def p2p_examples(draw):
    method = draw(st.sampled_from(("Send", "Isend", "Recv", "Irecv")))
    recv = method in ("Recv", "Irecv")
    buf_defects = fz.BUF_DEFECTS + fz.SIMPLE_ONLY
    if not recv:
        buf_defects = tuple(d for d in buf_defects if d not in fz.WRITE_ONLY)
    defect = draw(st.sampled_from(("",) * 3 + buf_defects + ("peer", "peer", "tag", "any_for_send")))
    if defect == "any_for_send" and recv:
        defect = ""
    return dict(method=method, defect=defect, dtype=draw(st.sampled_from(fz.DTYPES)), n=draw(st.integers(0, 5)),
                form=draw(st.sampled_from(fz.SIMPLE_FORMS)), variant=draw(st.integers(0, 40)), seed=draw(st.integers(0, 2**31)))


@settings(max_examples=500, **SETTINGS)
@given(p=p2p_examples())
def test_p2p_arguments(comm, mpi, p):
    from pycoll.errors import InvalidArgumentError

    TRIED["in-process"] += 1
    method, defect, v = p["method"], p["defect"], p["variant"]
    recv = method in ("Recv", "Irecv")
    ex = fz.Ex(coll="Bcast", nb=False, dtype=p["dtype"], n=p["n"], counts=(), root=0, op="SUM", op_as_str=False,
               in_place=False, send_form=p["form"], recv_form=p["form"], ignored_none=False,
               defect=defect if defect in fz.BUF_DEFECTS + fz.SIMPLE_ONLY else "", role="buf", variant=v, delta=1,
               other_dtype="float64", seed=p["seed"])
    b = fz.Builder(ex, 0, 1, mpi)
    buf, _ = b.simple("buf", p["n"], 1, written=recv)
    peer, tag = mpi.PROC_NULL, v % 5
    if defect == "peer":
        peer = BAD_PEERS[v % len(BAD_PEERS)]
        b.bad("bad peer")
    elif defect == "tag":
        tag = BAD_TAGS[v % len(BAD_TAGS)]
        b.bad("bad tag")
    elif defect == "any_for_send":
        peer, tag = (mpi.ANY_SOURCE, 0) if v % 2 else (mpi.PROC_NULL, mpi.ANY_TAG)
        b.bad("ANY_SOURCE / ANY_TAG on a send")
    before = [(label, base, fz._bytes(base)) for label, base in b.plan.inputs + b.plan.outputs]
    err = None
    try:
        out = getattr(comm, method)(buf, peer, tag)
        if method.startswith("I"):
            out.Wait()
    except Exception as exc:  # noqa: BLE001 - judged below
        err = exc
    where = f"{method}(peer={peer!r}, tag={tag!r}) {p}"
    if b.plan.bad:
        assert isinstance(err, InvalidArgumentError), f"{where}: must raise InvalidArgumentError ({b.plan.bad}), got {err!r}"
        assert err.op == method and method in str(err), f"{where}: error does not name {method}: {err!r}"
    else:
        assert err is None, f"{where}: valid arguments raised {err!r}"
    for label, base, old in before:  # PROC_NULL moves nothing, so nothing may change
        assert fz._bytes(base) == old, f"{where}: {label} changed"
    _healthy(comm, mpi)


# --------------------------------------------------------------------------------------------
# several ranks: size-dependent checks (counts per rank, roots < size), one rank rejecting, comm usable
# --------------------------------------------------------------------------------------------


# The arena (shared-memory slots) numbers its operations on each rank; a rank that rejects its arguments takes
# no number; peers that already started the call give theirs back, and posts carry the call number, so a
# late give-back is never mistaken for the next call (test_arena_after_one_rank_rejects).
JOBS = [
    pytest.param(3, "shm", 700, {"PYCOLL_ARENA_DISABLE": "1"}, False, id="n3-shm-stream"),
    pytest.param(2, "tcp", 500, {}, False, id="n2-tcp"),
    pytest.param(4, "shm", 400, {}, True, id="n4-shm-arena-symmetric"),
]


def _job(n, transport, env, argv, tmp_path, timeout=180):
    cmd = harness.launcher_cmd(n, argv, timeout=timeout)
    proc = harness.launch(cmd, harness.rank_env(transport, comm_timeout=30, extra=env), timeout=timeout + 30)
    results = {}
    for path in glob.glob(os.path.join(str(tmp_path), "rank*.json")):
        with open(path) as fh:
            data = json.load(fh)
        results[data["rank"]] = data
    tail = f"\nexit {proc.returncode}, {proc.wall_s:.0f} s\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    return proc, results, tail


@pytest.mark.ranks
@pytest.mark.timeout(240)
@pytest.mark.parametrize("n,transport,examples,env,symmetric", JOBS)
def test_ranks_fuzz(n, transport, examples, env, symmetric, tmp_path):
    """Every rank draws the same calls; a rank with a defect rejects, the others get RemoteError or finish."""
    argv = [harness.PYTHON, os.path.join(HERE, "fuzz_cases.py"), "--out", str(tmp_path), "--examples", str(examples),
            "--steps", "20"] + (["--symmetric"] if symmetric else [])
    proc, results, tail = _job(n, transport, env, argv, tmp_path)
    assert set(results) == set(range(n)), f"ranks that reported: {sorted(results)}{tail}"
    problems = [p for r in sorted(results) for p in results[r]["problems"]]
    assert not problems, f"{sum(r['n_problems'] for r in results.values())} problems, first ones:\n" + "\n".join(problems[:30]) + tail
    tried = {r: d["tried"] for r, d in results.items()}
    assert len(set(tried.values())) == 1, f"ranks tried different numbers of examples: {tried}"
    assert proc.returncode == 0, tail
    TRIED["ranks"] += tried[0]


ARENA_SKIP = """
import json, sys, time
import numpy as np
from pycoll import MPI
c = MPI.COMM_WORLD
a, b = np.ones(4, np.float32), np.zeros(4, np.float32)
c.Allreduce(a, b)  # the arena is set up
if c.rank == 0:
    time.sleep(0.3)  # the peers start their (arena) call first
    try:
        c.Allreduce(a, b, op=MPI.BAND)  # BAND on float32: only rank 0 rejects
    except MPI.Exception:
        pass
else:
    try:
        c.Allreduce(a, b)
    except MPI.Exception:
        pass
out = np.zeros(4, np.int64)
try:
    c.Allreduce(np.full(4, c.rank + 1, np.int64), out)
    res = out.tolist()
except Exception as exc:
    res = repr(exc)
json.dump({"rank": c.rank, "next": res}, open(f"{sys.argv[1]}/rank{c.rank}.json", "w"))
"""


@pytest.mark.ranks
@pytest.mark.timeout(120)
def test_arena_after_one_rank_rejects(tmp_path):
    """README: after an InvalidArgumentError on one rank the communicator stays usable (here on the arena path)."""
    script = tmp_path / "arena_skip.py"
    script.write_text(ARENA_SKIP)
    proc, results, tail = _job(3, "shm", {}, [harness.PYTHON, str(script), str(tmp_path)], tmp_path, timeout=60)
    assert {r: d["next"] for r, d in results.items()} == {r: [6] * 4 for r in range(3)}, tail


def test_report_count(capsys):
    total = TRIED["in-process"] + TRIED["ranks"]
    with capsys.disabled():
        print(f"\nfuzzed inputs tried: {total} (in-process {TRIED['in-process']}, per rank of the jobs {TRIED['ranks']})")
    assert TRIED["in-process"] > 0
