"""MPI.Info (pycoll/info.py) in this process; communicator hints and the buffered-send buffer calls on 2 ranks."""

from __future__ import annotations

import json
import pickle

import pytest

import harness
from pycoll import MPI
from pycoll.errors import InfoError, InfoKeyError, InfoNoKeyError, InfoValueError, InvalidArgumentError


@pytest.fixture
def info():
    made = MPI.Info.Create()
    yield made
    made.free()


def test_create_from_mapping_pairs_and_info_keeps_order():
    for items in ({"b": "2", "a": "1"}, [("b", "2"), ("a", "1")], MPI.Info.Create({"b": "2", "a": "1"})):
        got = MPI.Info.Create(items)
        assert got.items() == [("b", "2"), ("a", "1")]
        assert (got.Get_nkeys(), got.Get_nthkey(0), got.Get_nthkey(1)) == (2, "b", "a")
        got.Free()
    with pytest.raises(TypeError, match="Info.Create"):
        MPI.Info.Create(123)
    with pytest.raises(TypeError, match="pairs"):
        MPI.Info.Create(["abc"])


def test_get_set_delete(info):
    assert info.Get("k") is None
    info.Set("k", "v1")
    info.Set("j", "w")
    info.Set("k", "v2")  # a key set again keeps its place
    assert info.keys() == ["k", "j"] and info.Get("k") == "v2"
    info.Delete("k")
    assert info.items() == [("j", "w")]
    with pytest.raises(InfoNoKeyError, match=r"Info.Delete.*'k'") as exc:
        info.Delete("k")
    assert exc.value.Get_error_class() == MPI.ERR_INFO_NOKEY
    with pytest.raises(InfoKeyError, match="Get_nthkey") as exc:
        info.Get_nthkey(1)
    assert exc.value.Get_error_class() == MPI.ERR_INFO_KEY


def test_key_and_value_limits(info):
    info.Set("k" * MPI.MAX_INFO_KEY, "v" * MPI.MAX_INFO_VAL)
    info.Set("empty", "")
    assert info.Get("k" * MPI.MAX_INFO_KEY) == "v" * MPI.MAX_INFO_VAL
    for key in ("k" * (MPI.MAX_INFO_KEY + 1), "", 7):
        with pytest.raises(InfoKeyError, match="Info.Set"):
            info.Set(key, "v")
        with pytest.raises(InfoKeyError, match="Info.Get"):
            info.Get(key)
    for value in ("v" * (MPI.MAX_INFO_VAL + 1), b"bytes", None):
        with pytest.raises(InfoValueError, match="Info.Set") as exc:
            info.Set("k", value)
        assert exc.value.Get_error_class() == MPI.ERR_INFO_VALUE
    assert isinstance(exc.value, InvalidArgumentError) and isinstance(exc.value, MPI.Exception)
    assert info.Get_nkeys() == 2  # nothing bad went in


def test_references_dup_free_and_equality(info):
    info["a"] = "1"
    ref = MPI.Info(info)
    assert ref == info and ref is not info
    ref["b"] = "2"
    assert info.keys() == ["a", "b"]  # one object, two references
    dup = info.Dup()
    assert dup != info and dup.items() == info.items()
    dup["c"] = "3"
    assert "c" not in info
    dup.Free()
    assert dup == MPI.INFO_NULL and not dup
    ref.Free()  # frees the object both refer to
    assert not info and info == MPI.INFO_NULL
    with pytest.raises(InfoError, match="null"):
        info.Get_nkeys()
    with pytest.raises(InfoError, match="Info.Free"):
        MPI.INFO_NULL.Free()


def test_mapping_protocol(info):
    info.update([("k1", "v1")], k2="v2")
    info.update({"k3": "v3"})
    assert len(info) == 3 and list(info) == ["k1", "k2", "k3"] and "k2" in info
    assert info.values() == ["v1", "v2", "v3"] and info["k3"] == "v3"
    assert info.get("nope") is None and info.get("nope", "d") == "d"
    assert info.popitem() == ("k3", "v3")
    assert info.pop("k1") == "v1" and info.pop("k1", "d") == "d"
    with pytest.raises(KeyError):
        info.pop("k1")
    with pytest.raises(KeyError):
        info["k1"]
    with pytest.raises(KeyError):
        del info["k1"]
    copy = info.copy()
    assert copy.items() == [("k2", "v2")] and copy != info
    copy.Free()
    info.clear()
    assert len(info) == 0
    with pytest.raises(KeyError):
        info.popitem()


def test_info_null_reads_as_empty_and_refuses_writes():
    null = MPI.INFO_NULL
    assert not null and len(null) == 0 and "k" not in null and null.items() == []
    assert null.get("k", "d") == "d" and null.pop("k", None) is None
    for write in (lambda: null.__setitem__("k", "v"), lambda: null.update([]), null.popitem, lambda: null["k"]):
        with pytest.raises(KeyError):
            write()
    for call, args in ((null.Get, ("k",)), (null.Set, ("k", "v")), (null.Delete, ("k",)), (null.Dup, ()),
                       (null.Get_nkeys, ()), (null.Get_nthkey, (0,))):
        with pytest.raises(InfoError, match="null") as exc:
            call(*args)
        assert exc.value.Get_error_class() == MPI.ERR_INFO
    assert null.copy() == null and null.copy() is not null
    null.clear()
    with pytest.raises(TypeError):
        MPI.Info("not an info")


def test_pickle():
    assert pickle.loads(pickle.dumps(MPI.INFO_NULL)) is MPI.INFO_NULL
    assert pickle.loads(pickle.dumps(MPI.INFO_ENV)) is MPI.INFO_ENV
    env_ref = pickle.loads(pickle.dumps(MPI.Info(MPI.INFO_ENV)))
    assert env_ref is not MPI.INFO_ENV and env_ref == MPI.INFO_ENV
    null = pickle.loads(pickle.dumps(MPI.Info()))
    assert null is not MPI.INFO_NULL and null == MPI.INFO_NULL
    mold = MPI.Info.Create([("foo", "bar"), ("answer", "42")])
    got = pickle.loads(pickle.dumps(mold))
    assert got != mold and got.items() == mold.items()
    got.Free()
    mold.Free()


def test_info_env_and_create_env():
    env = MPI.INFO_ENV
    assert env and env.Get("thread_level") == "MPI_THREAD_SERIALIZED"
    assert int(env.Get("maxprocs")) >= 1 and env.Get("wdir") and env.Get("command")
    assert env.Get("soft") is None
    for write in (lambda: env.Set("k", "v"), lambda: env.Delete("command"), env.Free, env.clear):
        with pytest.raises(InfoError, match="INFO_ENV"):
            write()
    env.free()  # predefined: nothing to do
    assert env.Get("command")
    dup = env.Dup()
    assert dup.items() == env.items()
    dup.Set("k", "v")  # a copy is writable
    dup.Free()
    made = MPI.Info.Create_env(["prog", "-x", "1"])
    assert (made.Get("command"), made.Get("argv")) == ("prog", "-x 1")
    made.Free()
    made = MPI.Info.Create_env("prog")
    assert (made.Get("command"), made.Get("argv")) == ("prog", "")
    made.Free()
    with pytest.raises(TypeError, match="Create_env"):
        MPI.Info.Create_env([1, 2])


def test_buffer_automatic():
    auto = MPI.BUFFER_AUTOMATIC
    assert not auto and int(auto) == 0 and pickle.loads(pickle.dumps(auto)) is auto


# ---- on 2 ranks: communicator hints, Attach/Detach/Flush_buffer ------------------------------------------------
COMM_JOB = r"""
import json, os, sys
import numpy as np
from pycoll import MPI
from pycoll.errors import InvalidArgumentError

comm = MPI.COMM_WORLD
rank = comm.Get_rank()
out = {}
hints = MPI.Info.Create({"a": "1"})
dup = comm.Dup(hints)
out["dup_info"] = dup.info.items()
hints.Set("late", "x")  # the communicator keeps a copy
out["after_change"] = dup.Get_info().items()
dup.Set_info(MPI.Info.Create([("b", "2"), ("a", "3")]))
out["set_info"] = dup.Get_info().items()
out["dup_of_dup"] = dup.Dup().info.items()
out["dup_with_null"] = dup.Dup_with_info(MPI.INFO_NULL).info.items()
out["idup_with_info"] = dup.Idup_with_info(MPI.Info.Create({"c": "4"}))[0].info.items()
out["ref_shares"] = MPI.Comm(dup).info.items() == dup.info.items()
dup.info = MPI.Info.Create({"d": "5"})
out["property_set"] = dup.info.items()
errors = []
for call in (lambda: dup.Set_info({"a": "1"}), lambda: dup.Dup_with_info(None), lambda: dup.Dup("x")):
    try:
        call()
    except InvalidArgumentError as exc:
        errors.append(exc.op)
out["errors"] = errors

mem = MPI.Alloc_mem(1 << 12)
try:
    dup.Attach_buffer(b"read-only")
except InvalidArgumentError as exc:
    out["readonly"] = str(exc)
dup.Attach_buffer(mem)
try:
    dup.Attach_buffer(mem)
except InvalidArgumentError as exc:
    out["double_attach"] = str(exc)
peer = 1 - rank
data = np.arange(1 << 20, dtype=np.int64) + rank  # 8 MiB, twice a shared-memory ring: leaves in the background
dup.Bsend(data, peer, 7)
out["bsend_pending"] = len(dup.__dict__.get("_bsends", []))  # under way until the peer receives it
dup.Barrier()  # no receive for it is posted before both ranks have looked (ranks are not aligned after start-up)
dup.Ibsend(data[:4], peer, 8).Wait()
got, got2 = np.empty_like(data), np.empty(4, np.int64)
dup.Recv(got, peer, 7)
dup.Recv(got2, peer, 8)
dup.Flush_buffer()
dup.Iflush_buffer().Wait()
out["bsend_ok"] = bool((got == np.arange(1 << 20) + peer).all() and (got2 == np.arange(4) + peer).all())
out["bsends_left"] = len(dup.__dict__.get("_bsends", []))
out["detach_same"] = dup.Detach_buffer() is mem
out["detach_empty"] = dup.Detach_buffer()
dup.Attach_buffer(None)
out["auto"] = dup.Detach_buffer() is MPI.BUFFER_AUTOMATIC
MPI.Attach_buffer(mem)
dup.Bsend(data, peer, 9)
dup.Recv(got, peer, 9)
MPI.Flush_buffer()
out["module_detach"] = MPI.Detach_buffer() is mem
out["module_left"] = len(dup.__dict__.get("_bsends", []))
dup.Free()
with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as fh:
    json.dump(out, fh)
"""


@pytest.mark.ranks
@pytest.mark.timeout(60)
def test_comm_hints_and_buffers_two_ranks(tmp_path):
    script = tmp_path / "comm_job.py"
    script.write_text(COMM_JOB)
    cmd = harness.launcher_cmd(2, [harness.PYTHON, str(script), str(tmp_path)], timeout=40)
    proc = harness.launch(cmd, harness.rank_env("shm"), timeout=50)
    assert proc.returncode == 0 and not proc.timed_out, proc.stderr[-4000:]
    for rank in range(2):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert got["dup_info"] == [["a", "1"]], got
        assert got["after_change"] == [["a", "1"]], got
        assert got["set_info"] == [["a", "3"], ["b", "2"]], got
        assert got["dup_of_dup"] == [["a", "3"], ["b", "2"]], got
        assert got["dup_with_null"] == [] and got["idup_with_info"] == [["c", "4"]], got
        assert got["ref_shares"] and got["property_set"] == [["a", "3"], ["b", "2"], ["d", "5"]], got
        assert got["errors"] == ["Set_info", "Dup_with_info", "Dup"], got
        assert "attached already" in got["double_attach"] and "read-only" in got["readonly"], got
        assert got["bsend_pending"] >= 1 and got["bsend_ok"] and got["bsends_left"] == 0, got
        assert got["detach_same"] and got["detach_empty"] is None and got["auto"], got
        assert got["module_detach"] and got["module_left"] == 0, got
