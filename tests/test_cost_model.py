"""The cost model, selection among algorithms, its logging and override, and `pycoll tune`'s fit."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys

import numpy as np
import pytest

from pycoll.algorithms import ALGORITHMS, Call, CostModel, Layout, select
from pycoll.algorithms import cost
from pycoll.tune import fit, misfit

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
F32 = np.dtype(np.float32)


def _allreduce(nbytes: int) -> Call:
    a = np.empty(nbytes // 4, np.float32)
    return Call("allreduce", F32, a, a, in_place=True)


@pytest.fixture(autouse=True)
def _builtin_model(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("PYCOLL_ALGO", raising=False)
    cost.use(CostModel(cores=64))  # no oversubscription: the shape of the model alone
    yield
    cost.use(None)


def test_small_messages_take_few_steps_and_large_ones_the_bandwidth_optimal_ring() -> None:
    flat = Layout.flat(8)
    assert select(_allreduce(8), flat).name == "doubling"
    assert select(_allreduce(64 << 20), flat).name in ("ring", "rabenseifner")
    assert select(_allreduce(64 << 20), flat).name != "doubling"


def test_hierarchical_wins_large_messages_across_hosts_and_is_refused_on_one() -> None:
    two_hosts = Layout((0, 0, 1, 1))
    assert select(_allreduce(64 << 20), two_hosts).name == "hierarchical"
    call = _allreduce(64 << 20)
    assert ALGORITHMS["allreduce"]["hierarchical"].refusal(call, Layout.flat(4)) == "all ranks share one host"
    assert ALGORITHMS["allreduce"]["hierarchical"].refusal(call, Layout((0, 1, 2))) == "every host holds a single rank"
    grid = ALGORITHMS["reduce_scatter"]["hierarchical"].refusal(call, Layout((0, 0, 1, 2, 2)))
    assert grid == "hosts hold different numbers of ranks"


def test_costs_grow_with_size_and_net_is_slower_than_shm() -> None:
    m = cost.current()
    for coll, table in ALGORITHMS.items():
        for algo in table.values():
            if algo.cost is None or algo.refusal(_allreduce(8), Layout.flat(4)) is not None:
                continue
            small, large = algo.predict(m, 1 << 10, Layout.flat(4)), algo.predict(m, 1 << 26, Layout.flat(4))
            assert 0 < small < large, f"{coll}:{algo.name}"
    ring = ALGORITHMS["allreduce"]["ring"]
    assert ring.predict(m, 1 << 24, Layout((0, 0, 1, 1))) > ring.predict(m, 1 << 24, Layout.flat(4))


def test_override_and_its_fallback(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("PYCOLL_ALGO", "allreduce:tree")
    assert select(_allreduce(8), Layout.flat(4)).name == "tree"
    monkeypatch.setenv("PYCOLL_ALGO", "allreduce:hierarchical")
    with caplog.at_level(logging.WARNING, logger="pycoll"):
        chosen = select(_allreduce(8), Layout.flat(4))
    assert chosen.name != "hierarchical"
    assert "declined this call (all ranks share one host)" in caplog.text


def test_info_logging_names_the_choice_and_the_candidates(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="pycoll"):
        select(_allreduce(1 << 20), Layout((0, 0, 1, 1)))
    line = caplog.records[-1].getMessage()
    assert line.startswith("allreduce of 1048576 bytes: ")
    for name in ("ring", "tree", "rabenseifner", "doubling", "hierarchical"):
        assert f"{name} " in line
    assert "4 ranks on 2 hosts" in line


def test_fit_recovers_constants_from_timings_of_a_known_model() -> None:
    truth = dataclasses.replace(CostModel(cores=64), shm_latency_us=300.0, shm_GBps=2.0, msg_us=5.0, reduce_GBps=3.0)
    lay = Layout.flat(4)
    points = []
    for coll in ("allreduce", "reduce_scatter", "allgather", "broadcast"):
        for name, algo in ALGORITHMS[coll].items():
            if algo.cost is None or algo.refusal(_allreduce(8), lay) is not None:
                continue
            for nbytes in (8, 4 << 10, 64 << 10, 1 << 20, 8 << 20):
                points.append({"collective": coll, "algorithm": name, "bytes": nbytes,
                               "seconds": algo.predict(truth, nbytes, lay)})
    start = CostModel(cores=64)
    assert misfit(start, points, lay) > 0.05
    fitted = fit(start, points, lay, ("shm_latency_us", "shm_GBps", "msg_us", "reduce_GBps"))
    assert misfit(fitted, points, lay) < 1e-3
    # per-step latency and per-message CPU cost trade off at small sizes (one message per step); their sum does not
    assert fitted.shm_latency_us + fitted.msg_us == pytest.approx(305.0, rel=0.05)
    assert fitted.shm_GBps == pytest.approx(2.0, rel=0.25)  # trades off a little against the reduction speed
    from pycoll.tune import predicted

    for pt in points:
        assert predicted(fitted, pt, lay) == pytest.approx(pt["seconds"], rel=0.1), pt


def test_model_file_round_trip(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = str(tmp_path / "t.json")
    saved = dataclasses.replace(CostModel(), net_GBps=0.1).save(path)
    assert cost.load(saved).net_GBps == 0.1 and cost.load(saved).source == path
    monkeypatch.setenv("PYCOLL_TUNE_FILE", "builtin")
    assert cost.load() == CostModel()
    monkeypatch.setenv("PYCOLL_TUNE_FILE", str(tmp_path / "missing.json"))
    with pytest.raises(FileNotFoundError):
        cost.load()


@pytest.mark.timeout(120)
def test_pycoll_tune_fits_and_saves(tmp_path) -> None:
    out = tmp_path / "tuning.json"
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, "-m", "pycoll", "tune", "-n", "2", "-o", str(out), "--sizes", "8,64K,1M",
                           "--iters", "3"], capture_output=True, text=True, env=env, timeout=110)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    model = cost.load(str(out))
    assert "pycoll tune on 2 ranks, 1 hosts" in json.loads(out.read_text())["source"]
    report = json.loads((tmp_path / "tuning.json.points.json").read_text())
    assert report["fitted"] == ["shm_latency_us", "shm_GBps", "msg_us", "reduce_GBps"]
    assert report["misfit_after"] <= report["misfit_before"]
    assert {pt["algorithm"] for pt in report["points"] if pt["collective"] == "allreduce"} >= {"ring", "tree", "doubling"}
    assert model.shm_GBps > 0 and "rms log error" in proc.stdout
