"""Tests of ranks forked by `pycoll run` (pycoll.forked_ranks): they start as `python PROG` would, and only the CLI forks."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pycoll import forked_ranks
from pycoll.launcher import launch

from test_launcher import REPO, clean_env

# A rank reports how it started: whether it was forked (the launcher's module is already imported), its argv,
# path, main module and standard input.
REPORT = """
import json, os, sys
import numpy as np
out = {
    "forked": "pycoll.launcher" in sys.modules,
    "argv": sys.argv, "path0": sys.path[0], "name": __name__,
    "file": globals().get("__file__"), "main_is_me": sys.modules["__main__"].__dict__ is globals(),
    "stdin_eof": os.environ["PYCOLL_RANK"] != "0" and sys.stdin.read() == "",
    "rank": os.environ["PYCOLL_RANK"], "numpy_draw": float(np.random.rand()),
}
with open(os.path.join(os.environ["OUT"], "r" + out["rank"]), "w") as fh:
    json.dump(out, fh)
"""


def run_cli(argv: list[str], timeout: float = 60, cwd: Path = REPO, **env: str) -> subprocess.CompletedProcess:
    """`python -m pycoll run ARGV` with forked ranks turned on (PYCOLL_RUN_FORK=1) unless ``env`` says otherwise."""
    env.setdefault("PYCOLL_RUN_FORK", "1")
    cmd = [sys.executable, "-m", "pycoll", "run", *argv]
    return subprocess.run(cmd, cwd=cwd, env=clean_env(**env), capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


def reports(out: Path, n: int) -> list[dict]:
    return [json.loads((out / f"r{r}").read_text()) for r in range(n)]


def test_a_script_rank_is_forked_and_sees_what_python_script_gives(tmp_path):
    prog = tmp_path / "prog.py"
    prog.write_text(REPORT)
    res = run_cli(["-n", "3", "--", sys.executable, str(prog), "a", "b"], OUT=str(tmp_path))
    assert res.returncode == 0, res.stderr
    got = reports(tmp_path, 3)
    for r in got:
        assert r["forked"] is True
        assert r["argv"] == [str(prog), "a", "b"]
        assert r["path0"] == str(tmp_path)
        assert r["name"] == "__main__" and r["file"] == str(prog) and r["main_is_me"]
    assert [r["stdin_eof"] for r in got] == [False, True, True]
    # NumPy's global generator is seeded in each rank, as in separate interpreters
    assert len({r["numpy_draw"] for r in got}) == 3


def test_code_and_module_ranks_are_forked_too(tmp_path):
    res = run_cli(["-n", "2", "--", sys.executable, "-c", REPORT, "x"], OUT=str(tmp_path))
    assert res.returncode == 0, res.stderr
    for r in reports(tmp_path, 2):
        assert r["forked"] and r["argv"] == ["-c", "x"] and r["path0"] == "" and r["file"] is None
    (tmp_path / "reportmod.py").write_text(REPORT)
    res = run_cli(["-n", "2", "--", sys.executable, "-m", "reportmod", "y"], cwd=tmp_path, OUT=str(tmp_path))
    assert res.returncode == 0, res.stderr
    for r in reports(tmp_path, 2):
        assert r["forked"] and r["argv"] == [str(tmp_path / "reportmod.py"), "y"] and r["path0"] == str(tmp_path)


def test_exec_by_default_when_turned_off_or_when_the_command_has_other_options(tmp_path):
    prog = tmp_path / "prog.py"
    prog.write_text(REPORT)
    res = run_cli(["-n", "2", "--", sys.executable, str(prog)], OUT=str(tmp_path), PYCOLL_RUN_FORK="0")
    assert res.returncode == 0, res.stderr
    assert [r["forked"] for r in reports(tmp_path, 2)] == [False, False]
    res = subprocess.run([sys.executable, "-m", "pycoll", "run", "-n", "2", "--", sys.executable, str(prog)], cwd=REPO,
                         env=clean_env(OUT=str(tmp_path)), capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr  # the default: exec
    assert [r["forked"] for r in reports(tmp_path, 2)] == [False, False]
    res = run_cli(["-n", "2", "--", sys.executable, "-B", str(prog)], OUT=str(tmp_path))
    assert res.returncode == 0, res.stderr
    assert [r["forked"] for r in reports(tmp_path, 2)] == [False, False]


def test_exit_codes_and_uncaught_errors_read_as_from_python(tmp_path):
    res = run_cli(["-n", "2", "--", sys.executable, "-c", "import sys; sys.exit(3)"])
    assert res.returncode == 3
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    raise KeyError('lost')\nf()\n")
    res = run_cli(["-n", "2", "--", sys.executable, str(bad)])
    assert res.returncode == 1
    assert res.stderr.count("Traceback (most recent call last):") == 2
    # the traceback starts at the program, as Python's own does: no launcher frames
    assert "forked_ranks.py" not in res.stderr and "launcher.py" not in res.stderr
    assert f'File "{bad}", line 3, in <module>' in res.stderr and "KeyError: 'lost'" in res.stderr


def test_atexit_handlers_and_unclosed_files_of_a_forked_rank_complete(tmp_path):
    script = f"""
import atexit, os
rank = os.environ["PYCOLL_RANK"]
log = open(os.path.join({str(tmp_path)!r}, "log" + rank), "w")
log.write("written, never closed")
atexit.register(lambda: open(os.path.join({str(tmp_path)!r}, "atexit" + rank), "w").close())
"""
    res = run_cli(["-n", "2", "--", sys.executable, "-c", script])
    assert res.returncode == 0, res.stderr
    for r in range(2):
        assert (tmp_path / f"log{r}").read_text() == "written, never closed"
        assert (tmp_path / f"atexit{r}").exists()


def test_tagged_output_of_forked_ranks(tmp_path):
    res = run_cli(["-n", "3", "--tag-output", "--", sys.executable, "-c",
                   "import os, sys; r = os.environ['PYCOLL_RANK']; print('out', r); print('err', r, file=sys.stderr)"])
    assert res.returncode == 0, res.stderr
    assert sorted(res.stdout.splitlines()) == [f"[{r}] out {r}" for r in range(3)]
    assert sorted(res.stderr.splitlines()) == [f"[{r}] err {r}" for r in range(3)]


def test_a_forked_rank_holds_none_of_the_launchers_sockets(tmp_path):
    script = textwrap.dedent("""
        import os, socket, sys
        listening = []
        for fd in map(int, os.listdir("/proc/self/fd")):
            try:
                s = socket.socket(fileno=os.dup(fd))
            except OSError:
                continue
            try:
                if s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                    listening.append(fd)
            except OSError:
                pass
            finally:
                s.close()
        sys.exit(10 + len(listening) if listening else 0)
    """)
    res = run_cli(["-n", "2", "--", sys.executable, "-c", "import sys; print('pycoll.launcher' in sys.modules)\n" + script])
    assert res.returncode == 0, res.stderr
    # the two ranks share the launcher's stdout unprefixed, so their words may interleave ("TrueTrue\n\n")
    assert re.findall(r"True|False", res.stdout) == ["True", "True"], res.stdout


def test_an_in_process_launch_never_forks_its_caller(tmp_path):
    code = launch(2, [sys.executable, "-c", REPORT], env={"OUT": str(tmp_path)}, timeout=60)
    assert code == 0
    assert [r["forked"] for r in reports(tmp_path, 2)] == [False, False]


def test_which_commands_are_forked(tmp_path):
    bindir = str(Path(sys.executable).parent)
    script = tmp_path / "x.py"
    script.write_text("pass\n")
    name = Path(sys.executable).name
    for cmd, kind, target, args in (([name, str(script), "a"], "path", str(script), ["a"]),
                                    ([sys.executable, "-c", "pass", "b"], "code", "pass", ["b"]),
                                    ([name, "-m", "json.tool", "c"], "module", "json.tool", ["c"])):
        prog = forked_ranks.parse_command(cmd, bindir)
        assert prog is not None and (prog.kind, prog.target, prog.args) == (kind, target, args)
    for cmd in ([name], [name, "-"], [name, "-u", str(script)], [name, "-c"], [name, str(tmp_path / "missing.py")],
                [name, str(tmp_path)], ["/bin/true", str(script)]):
        assert forked_ranks.parse_command(cmd, bindir) is None, cmd
    assert forked_ranks.parse_command([name, str(script)], "/nonexistent") is None  # another interpreter, or none
