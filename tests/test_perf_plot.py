"""`pycoll plot`: the PNG charts drawn from a synthetic `pycoll perf` JSON file."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("matplotlib", reason="pycoll plot needs matplotlib (pip install 'pycoll[plot]')")

from pycoll.cli import main  # noqa: E402

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
SIZES = [1 << k for k in range(10, 25, 2)]  # 1K .. 16M: some <= 64K for the latency plot
PEERS = {"pycoll": 1.0, "mpi": 0.8, "gloo": 0.5}  # relative speed


def _record(peer: str, coll: str, nranks: int, size: int, speed: float, wrong: int = 0) -> dict[str, Any]:
    time_us = 5.0 + size / (1000.0 * speed) * (1 + 0.1 * nranks)
    algbw = size / time_us / 1e3
    factor = 2 * (nranks - 1) / nranks if coll == "allreduce" else 1.0
    return {"peer": peer, "collective": coll, "nranks": nranks, "bytes": size, "count": size // 4,
            "dtype": "float", "op": "sum", "root": 0, "inplace": False, "time_us": time_us,
            "algbw_GBps": algbw, "busbw_GBps": algbw * factor, "wrong": wrong, "iters": 20, "warmup": 5}


def _sweep(peers: dict[str, float], collectives: tuple[str, ...] = ("allreduce", "broadcast")) -> dict[str, Any]:
    records = [_record(p, c, n, s, speed) for c in collectives for p, speed in peers.items()
               for n in (2, 4) for s in SIZES]
    records[3]["wrong"] = 2  # one bad result: still plotted, marked, warned about
    inplace = dict(records[0], inplace=True, peer="pycoll")
    return {"meta": {"command": "pycoll perf --np 2,4", "date": "2025-01-01", "host": "test", "cpus": 2,
                     "python": "3.11.7", "pycoll": "0.1.0", "peers_skipped": {"nccl": "no CUDA GPU"}},
            "limits": {"copy_GBps": 8.1, "reduce_GBps": 5.2}, "records": records + [inplace]}


def _write(tmp_path: Path, data: Any, name: str = "sweep.json") -> str:
    path = tmp_path / name
    path.write_text(json.dumps(data) if not isinstance(data, str) else data)
    return str(path)


def _png_size(path: Path) -> tuple[int, int]:
    """(width, height) from the IHDR chunk, after checking the PNG signature."""
    head = path.read_bytes()[:24]
    assert head[:8] == PNG_SIGNATURE, f"{path.name} is not a PNG"
    assert head[12:16] == b"IHDR"
    return struct.unpack(">II", head[16:24])


def _expected(coll: str, ratio: bool = True) -> set[str]:
    names = {f"scaling_{coll}.png"}
    for n in (2, 4):
        names |= {f"busbw_{coll}_np{n}.png", f"latency_{coll}_np{n}.png"}
        names |= {f"ratio_{coll}_np{n}.png"} if ratio else set()
    return names


def test_plot_writes_every_chart(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "plots"
    assert main(["plot", _write(tmp_path, _sweep(PEERS)), "--out", str(out)]) == 0
    written = {p.name for p in out.iterdir()}
    assert written == _expected("allreduce") | _expected("broadcast")
    for path in out.iterdir():
        width, height = _png_size(path)
        assert width >= 800 and height >= 500, path.name
        assert path.stat().st_size > 20_000, path.name
    captured = capsys.readouterr()
    assert all(name in captured.out for name in written)
    assert "wrong results" in captured.err


def test_plot_image_decodes(tmp_path: Path) -> None:
    import matplotlib.image

    out = tmp_path / "plots"
    args = ["plot", _write(tmp_path, _sweep(PEERS)), "--out", str(out), "--collectives", "allreduce"]
    assert main(args) == 0
    assert {p.name for p in out.iterdir()} == _expected("allreduce")
    pixels = matplotlib.image.imread(out / "busbw_allreduce_np4.png")
    assert pixels.shape[0] > 500 and pixels.shape[1] > 800
    assert pixels.std() > 0.01  # not a blank canvas


def test_ratio_skipped_without_pycoll(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "plots"
    peers = {"mpi": 0.8, "gloo": 0.5}
    assert main(["plot", _write(tmp_path, _sweep(peers, ("allreduce",))), "--out", str(out)]) == 0
    assert {p.name for p in out.iterdir()} == _expected("allreduce", ratio=False)
    assert "ratio plot skipped" in capsys.readouterr().out


def test_single_rank_count_skips_scaling(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = _sweep(PEERS, ("reduce",))
    data["records"] = [r for r in data["records"] if r["nranks"] == 2]
    out = tmp_path / "plots"
    assert main(["plot", _write(tmp_path, data), "--out", str(out)]) == 0
    assert not (out / "scaling_reduce.png").exists()
    assert (out / "ratio_reduce_np2.png").exists()
    assert "only one rank count" in capsys.readouterr().out


def test_inplace_selection(tmp_path: Path) -> None:
    out = tmp_path / "plots"
    assert main(["plot", _write(tmp_path, _sweep(PEERS)), "--out", str(out), "--inplace", "in"]) == 0
    assert {p.name for p in out.iterdir()} == {"busbw_allreduce_np2.png", "latency_allreduce_np2.png"}


@pytest.mark.parametrize(
    "content, message",
    [
        (None, "cannot read"),
        ("{not json", "not valid JSON"),
        ({"meta": {}}, "'records' list"),
        ({"records": [{"peer": "pycoll"}]}, "missing field 'collective'"),
        ({"records": [dict(_record("mpi", "allreduce", 2, 1024, 1.0), nranks="two")]}, "'nranks'"),
        ({"records": []}, "no out-of-place records"),
    ],
)
def test_bad_input_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str], content: Any, message: str) -> None:
    path = str(tmp_path / "missing.json") if content is None else _write(tmp_path, content)
    assert main(["plot", path, "--out", str(tmp_path / "plots")]) == 2
    assert message in capsys.readouterr().err


def test_unknown_collective_exits_2(tmp_path: Path) -> None:
    args = ["plot", _write(tmp_path, _sweep(PEERS)), "--out", str(tmp_path), "--collectives", "allreduce,bcast"]
    assert main(args) == 2


def test_run_does_not_import_matplotlib() -> None:
    code = "import sys; from pycoll.cli import build_parser; build_parser(); print('matplotlib' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"
