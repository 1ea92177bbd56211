"""Tests of `pycoll run`: exit codes, tagged output, timeouts, grace kills, signals and clean-up."""

from __future__ import annotations

import argparse
import contextlib
import glob
import os
import select
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Iterator

import pytest

from harness import eventually
from pycoll.launcher import launch

REPO = Path(__file__).resolve().parents[1]
# Variables that would make a child think another launcher started it.
_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
_LAUNCHER_PREFIXES = ("PYCOLL_", "SLURM_", "PMI_", "PMIX_", "OMPI_", "TORCHELASTIC_")


def clean_env(**extra: str) -> dict[str, str]:
    env = {
        k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARS and not k.startswith(_LAUNCHER_PREFIXES)
    }
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
    env.update(extra)
    return env


def pycoll_run(args: list[str], script: str, timeout: float = 60, **env: str) -> subprocess.CompletedProcess:
    """Run `python -m pycoll run ARGS -- python -c SCRIPT` and capture its output."""
    cmd = [sys.executable, "-m", "pycoll", "run", *args, "--", sys.executable, "-c", textwrap.dedent(script)]
    return subprocess.run(cmd, cwd=REPO, env=clean_env(**env), capture_output=True, text=True, timeout=timeout)


def process_state(pid: int) -> str:
    """The state letter of /proc/PID/stat (R, S, T, Z, ...), or "gone"."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return "gone"


def alive(pid: int) -> bool:
    """True if pid runs (a zombie waiting for a non-reaping init counts as dead)."""
    return process_state(pid) not in ("Z", "gone")


def wait_for_files(paths: list[Path], limit: float = 30.0) -> None:
    written = lambda: all(p.exists() and p.stat().st_size for p in paths)  # noqa: E731 - not just created
    assert eventually(written, limit, poll=0.05), f"never appeared: {[str(p) for p in paths if not p.exists()]}"


def read_pids(tmp_path: Path) -> list[int]:
    return [int(p.read_text()) for p in sorted(tmp_path.glob("pid*"))]


# Every rank writes its pid (and its sleeping grandchild's) into DIR.
PIDS = """
import os, pathlib, subprocess, sys
d = pathlib.Path(os.environ["DIR"]); r = os.environ["PYCOLL_RANK"]
kid = subprocess.Popen(["sleep", "1000"])
(d / f"pid{r}.kid").write_text(str(kid.pid))
(d / f"pid{r}").write_text(str(os.getpid()))
"""


@pytest.mark.timeout(60)
def test_all_ranks_succeed():
    res = pycoll_run(
        ["-n", "3"],
        """
        import os
        e = os.environ
        line = f"rank {e['PYCOLL_RANK']} of {e['PYCOLL_SIZE']} {e['PYCOLL_LOCAL_RANK']} {e['PYCOLL_LOCAL_SIZE']} {e['PYCOLL_STORE_ADDR']}\\n"
        os.write(1, line.encode())  # one write: ranks share the pipe, and unbuffered prints would interleave
        """,
    )
    assert res.returncode == 0, res.stderr
    lines = sorted(res.stdout.splitlines())
    assert [ln.split()[:6] for ln in lines] == [["rank", str(r), "of", "3", str(r), "3"] for r in range(3)]
    assert len({ln.split()[6] for ln in lines}) == 1 and lines[0].split()[6].startswith("127.0.0.1:")
    assert res.stderr == ""


@pytest.mark.timeout(60)
def test_failing_rank_code_is_returned_and_named():
    res = pycoll_run(["-n", "3"], "import os, sys; sys.exit(3 if os.environ['PYCOLL_RANK'] == '1' else 0)")
    assert res.returncode == 3
    assert "rank 1 exited with code 3" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1


@pytest.mark.timeout(60)
def test_rank_killed_by_signal_gives_128_plus_signal():
    res = pycoll_run(
        ["-n", "2"],
        "import os, signal\nif os.environ['PYCOLL_RANK'] == '0': os.kill(os.getpid(), signal.SIGKILL)",
    )
    assert res.returncode == 128 + signal.SIGKILL
    assert "rank 0 was killed by SIGKILL" in res.stderr


@pytest.mark.timeout(60)
def test_tag_output_prefixes_every_line():
    res = pycoll_run(
        ["-n", "2", "--tag-output"],
        """
        import os, sys
        r = os.environ["PYCOLL_RANK"]
        print(f"out {r} a"); print(f"out {r} b")
        sys.stderr.write(f"err {r} no newline")
        """,
    )
    assert res.returncode == 0, res.stderr
    assert sorted(res.stdout.splitlines()) == ["[0] out 0 a", "[0] out 0 b", "[1] out 1 a", "[1] out 1 b"]
    assert sorted(res.stderr.splitlines()) == ["[0] err 0 no newline", "[1] err 1 no newline"]
    # Lines of one rank keep their order.
    assert [ln for ln in res.stdout.splitlines() if ln.startswith("[1]")] == ["[1] out 1 a", "[1] out 1 b"]


@pytest.mark.timeout(90)
def test_timeout_returns_124_and_leaves_nothing_running(tmp_path):
    res = pycoll_run(
        ["-n", "3", "--timeout", "6"],
        PIDS
        + """
import signal, time
if r == "2":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # needs the SIGKILL
time.sleep(1000)
""",
        DIR=str(tmp_path),
    )
    assert res.returncode == 124, res.stderr
    assert "timeout after 6 s" in res.stderr
    pids = read_pids(tmp_path)
    assert len(pids) == 6  # 3 ranks, each with a child: all started before the timeout
    assert [p for p in pids if alive(p)] == []


@pytest.mark.timeout(90)
def test_grace_kill_of_rank_that_hangs_after_another_failed(tmp_path):
    res = pycoll_run(
        ["-n", "2"],
        PIDS
        + """
import signal, time
if r == "0":
    while not (d / "pid1").exists():
        time.sleep(0.05)
    sys.exit(5)
signal.signal(signal.SIGTERM, signal.SIG_IGN)
time.sleep(1000)
""",
        DIR=str(tmp_path),
        PYCOLL_LAUNCH_GRACE="0.5",
    )
    assert res.returncode == 5, res.stderr
    assert "rank 0 exited with code 5" in res.stderr
    pids = read_pids(tmp_path)
    assert len(pids) == 4 and [p for p in pids if alive(p)] == []


@pytest.mark.timeout(90)
def test_grace_lets_other_ranks_finish(tmp_path):
    res = pycoll_run(
        ["-n", "2"],
        """
        import os, pathlib, sys, time
        d = pathlib.Path(os.environ["DIR"])
        if os.environ["PYCOLL_RANK"] == "0":
            sys.exit(4)
        time.sleep(1)
        (d / "finished").write_text("yes")
        """,
        DIR=str(tmp_path),
        PYCOLL_LAUNCH_GRACE="30",
    )
    assert res.returncode == 4
    assert (tmp_path / "finished").exists()


@pytest.mark.timeout(90)
def test_sigint_is_forwarded_to_every_rank(tmp_path):
    script = textwrap.dedent(
        """
        import os, pathlib, signal, time
        d = pathlib.Path(os.environ["DIR"]); r = os.environ["PYCOLL_RANK"]
        def on_int(signum, frame):
            (d / f"sigint{r}").write_text("got it")
            os._exit(7)
        signal.signal(signal.SIGINT, on_int)
        (d / f"pid{r}").write_text(str(os.getpid()))
        time.sleep(1000)
        """
    )
    cmd = [sys.executable, "-m", "pycoll", "run", "-n", "2", "--", sys.executable, "-c", script]
    proc = subprocess.Popen(cmd, cwd=REPO, env=clean_env(DIR=str(tmp_path)), stderr=subprocess.PIPE, text=True)
    try:
        wait_for_files([tmp_path / "pid0", tmp_path / "pid1"])
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 7, err
    assert (tmp_path / "sigint0").exists() and (tmp_path / "sigint1").exists()
    assert [p for p in read_pids(tmp_path) if alive(p)] == []


# Every rank writes its pid into DIR, then sleeps.
SLEEPER = """
import os, pathlib, time
(pathlib.Path(os.environ["DIR"]) / f"pid{os.environ['PYCOLL_RANK']}").write_text(str(os.getpid()))
time.sleep(1000)
"""


@contextlib.contextmanager
def _sleepers(tmp_path: Path, fork: str) -> Iterator[tuple[subprocess.Popen, list[int]]]:
    """`pycoll run -n 2` of SLEEPER (rank 0 forked where ``fork`` is "1"), once both ranks run: (launcher, rank pids);
    whatever is left of them is killed on the way out."""
    cmd = [sys.executable, "-m", "pycoll", "run", "-n", "2", "--", sys.executable, "-c", SLEEPER]
    proc = subprocess.Popen(cmd, cwd=REPO, env=clean_env(DIR=str(tmp_path), PYCOLL_RUN_FORK=fork),
                            stderr=subprocess.PIPE, text=True)
    pids: list[int] = []
    try:
        wait_for_files([tmp_path / "pid0", tmp_path / "pid1"])
        pids = read_pids(tmp_path)
        yield proc, pids
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in pids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("fork", ["0", "1"])
def test_a_hangup_stops_every_rank(tmp_path, fork):
    # the terminal closed or the ssh session dropped: the ranks go with the launcher, which cleans up
    with _sleepers(tmp_path, fork) as (proc, pids):
        proc.send_signal(signal.SIGHUP)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 128 + signal.SIGHUP, err
        assert "SIGHUP" in err
        assert [p for p in pids if alive(p)] == []


@pytest.mark.timeout(90)
@pytest.mark.parametrize("fork", ["0", "1"])
def test_ctrl_z_stops_every_rank_and_fg_resumes_them(tmp_path, fork):
    # the terminal's SIGTSTP reaches the launcher's group only: it stops the ranks' groups, and SIGCONT (fg, bg)
    # sends them on
    with _sleepers(tmp_path, fork) as (proc, pids):
        proc.send_signal(signal.SIGTSTP)
        states = lambda: [process_state(p) for p in pids]  # noqa: E731
        assert eventually(lambda: all(x == "T" for x in states()), 10.0, poll=0.05), states()
        proc.send_signal(signal.SIGCONT)
        assert eventually(lambda: all(x in ("S", "R") for x in states()), 10.0, poll=0.05), states()
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=60)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("fork", ["0", "1"])
def test_ranks_die_with_a_killed_launcher(tmp_path, fork):
    # SIGKILL leaves the launcher no word: the kernel's parent-death signal takes the ranks (exec'd and forked)
    with _sleepers(tmp_path, fork) as (proc, pids):
        proc.kill()
        proc.wait(timeout=30)
        assert eventually(lambda: not any(alive(p) for p in pids), 10.0, poll=0.05), [p for p in pids if alive(p)]


@pytest.mark.parametrize("fork", ["0", "1"])
def test_ranks_share_the_launchers_session_each_in_a_group_of_its_own(tmp_path, fork):
    # one session (the scheduler's autogroup: ranks sharing a core hand it over with sched_yield), and a process group
    # per rank for the signals; with PYCOLL_RUN_FORK=1 rank 0 is forked from the launcher, the others started afresh
    script = tmp_path / "ids.py"
    # one write per rank: the ranks share our stdout, and unbuffered (PYTHONUNBUFFERED) a print's items interleave
    script.write_text("import os\nos.write(1, f\"ids {os.environ['PYCOLL_RANK']} {os.getsid(0)} {os.getpgid(0)} "
                      "{os.getpid()}\\n\".encode())\n")
    cmd = [sys.executable, "-m", "pycoll", "run", "-n", "3", "--", sys.executable, str(script)]
    out = subprocess.run(cmd, cwd=REPO, env=clean_env(PYCOLL_RUN_FORK=fork), capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    rows = sorted(line.split()[1:] for line in out.stdout.splitlines() if line.startswith("ids "))
    assert [r[0] for r in rows] == ["0", "1", "2"]
    for _, sid, pgid, pid in rows:
        assert int(sid) == os.getsid(0) and int(pgid) == int(pid)


def _on_a_terminal(tmp_path: Path, job: list[str], typed: bytes) -> tuple[int, bytes]:
    """Run ``job`` as the session leader of a new terminal (stdin, stdout and stderr on it) after typing ``typed``
    into it: its exit code and everything the terminal showed."""
    import fcntl
    import pty
    import termios

    master, slave = pty.openpty()

    def lead_the_terminal() -> None:
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)

    proc = subprocess.Popen(job, cwd=REPO, env=clean_env(), stdin=slave, stdout=slave, stderr=slave,
                            start_new_session=True, preexec_fn=lead_the_terminal)
    os.close(slave)
    seen = b""
    try:
        os.write(master, typed)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # until the job ends and the terminal with it
            if not select.select([master], [], [], 0.5)[0]:
                continue
            try:
                seen += os.read(master, 4096)
            except OSError:
                break
        code = proc.wait(timeout=5)
    finally:
        for pid in _session_members(proc.pid):  # a stopped launcher and its ranks too, where the test failed
            os.kill(pid, signal.SIGKILL)
        proc.wait(timeout=5)
        os.close(master)
    return code, seen


def _session_members(sid: int) -> list[int]:
    """Every live process of session ``sid``."""
    found = []
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(stat) as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":
            found.append(int(stat.split("/")[2]))
    return found


_READ_LINE = ("import os, sys\nline = sys.stdin.readline()\n"
              "os.write(1, f\"rank {os.environ['PYCOLL_RANK']} read {line!r}\\n\".encode())\n")  # one write


def test_rank_0_reads_the_launchers_terminal(tmp_path):
    # the launcher leads a session on a terminal; the ranks' groups are in its background, where a read of the
    # terminal would stop them (SIGTTIN): rank 0 reads it through the launcher, as under mpiexec
    script = tmp_path / "read.py"
    script.write_text(_READ_LINE)
    code, seen = _on_a_terminal(tmp_path, [sys.executable, "-m", "pycoll", "run", "-n", "2", "--", sys.executable,
                                           str(script)], b"hello\n")
    assert code == 0, seen.decode(errors="replace")
    assert b"rank 0 read 'hello\\n'" in seen and b"rank 1 read ''" in seen, seen.decode(errors="replace")


def test_a_launcher_in_the_background_leaves_the_terminal_alone(tmp_path):
    # started in the background of a shell with job control, the launcher must not read the terminal (the read
    # would stop it): rank 0 reads nothing and the job ends
    script = tmp_path / "read.py"
    script.write_text(_READ_LINE)
    job = f"{sys.executable} -m pycoll run -n 2 -- {sys.executable} {script}"
    code, seen = _on_a_terminal(tmp_path, ["bash", "-c", f"set -m; {job} & wait $!; echo job ended $?"], b"")
    assert code == 0, seen.decode(errors="replace")
    assert b"rank 0 read ''" in seen and b"job ended 0" in seen, seen.decode(errors="replace")


@pytest.mark.timeout(90)
def test_sigterm_to_launcher_stops_the_job(tmp_path):
    cmd = [sys.executable, "-m", "pycoll", "run", "-n", "2", "--", sys.executable, "-c", PIDS + "import time; time.sleep(1000)"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=clean_env(DIR=str(tmp_path)), stderr=subprocess.PIPE, text=True)
    try:
        wait_for_files([tmp_path / "pid0", tmp_path / "pid1", tmp_path / "pid0.kid", tmp_path / "pid1.kid"])
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert [p for p in read_pids(tmp_path) if alive(p)] == []


@pytest.mark.timeout(90)
def test_shm_files_of_the_job_are_removed(tmp_path):
    other = Path(f"/dev/shm/pycoll-notthisjob{os.getpid()}-0")
    if not Path("/dev/shm").is_dir():
        pytest.skip("no /dev/shm on this system")
    other.write_bytes(b"keep")
    try:
        res = pycoll_run(
            ["-n", "2"],
            """
            import os, pathlib
            from pycoll.bootstrap import bootstrap, publish_all
            info = bootstrap(30)
            pathlib.Path(f"/dev/shm/pycoll-{info.job_id}-{info.rank}").write_bytes(b"x")
            publish_all(info, "made", b"1", 30)
            print(info.job_id)
            """,
        )
        assert res.returncode == 0, res.stderr
        job_ids = set(res.stdout.split())
        assert len(job_ids) == 1
        assert glob.glob(f"/dev/shm/pycoll-{job_ids.pop()}-*") == []
        assert other.exists()
    finally:
        other.unlink(missing_ok=True)


@pytest.mark.timeout(60)
def test_missing_command_returns_127():
    cmd = [sys.executable, "-m", "pycoll", "run", "-n", "2", "--", "/nonexistent/pycoll-test-binary"]
    res = subprocess.run(cmd, cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=60)
    assert res.returncode == 127
    assert "cannot start rank 0" in res.stderr


@pytest.mark.timeout(60)
def test_cli_usage_errors():
    base = [sys.executable, "-m", "pycoll", "run"]
    no_cmd = subprocess.run(base + ["-n", "2"], cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=60)
    assert no_cmd.returncode == 2 and "no command" in no_cmd.stderr
    no_n = subprocess.run(base + ["true"], cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=60)
    assert no_n.returncode == 2 and "-n" in no_n.stderr
    # Without "--" the command's own options are left to it.
    plain = subprocess.run(
        base + ["-n", "1", sys.executable, "-c", "import sys; print(sys.argv[1:])", "-x", "--y"],
        cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=60,
    )
    assert plain.returncode == 0, plain.stderr
    assert plain.stdout.strip() == "['-x', '--y']"


@pytest.mark.timeout(60)
def test_programmatic_launch(tmp_path, monkeypatch):
    for k in list(os.environ):
        if k in _LAUNCHER_VARS or k.startswith(_LAUNCHER_PREFIXES):
            monkeypatch.delenv(k)
    script = "import os, pathlib; pathlib.Path(os.environ['DIR'], os.environ['PYCOLL_RANK']).write_text(os.environ['FOO'])"
    code = launch(3, [sys.executable, "-c", script], env={"DIR": str(tmp_path), "FOO": "bar"}, timeout=50)
    assert code == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["0", "1", "2"]
    assert {p.read_text() for p in tmp_path.iterdir()} == {"bar"}
    assert launch(2, [sys.executable, "-c", "import sys; sys.exit(9)"], timeout=50) == 9
    with pytest.raises(ValueError):
        launch(0, ["true"])


def test_plan_hosts_blocks():
    from pycoll.launcher import plan_hosts

    assert plan_hosts(4, 2) == [2, 2]
    assert plan_hosts(5, 3) == [2, 2, 1]
    assert plan_hosts(7, 3) == [3, 2, 2]
    assert plan_hosts(3, 1) == [3]
    assert plan_hosts(5, None, [2, 1, 2]) == [2, 1, 2]
    assert plan_hosts(5, 3, [1, 3, 1]) == [1, 3, 1]
    for n, hosts, per_host in [(1, 2, None), (4, 0, None), (5, 2, [2, 1, 2]), (4, None, [2, 1]), (3, None, [3, 0])]:
        with pytest.raises(ValueError):
            plan_hosts(n, hosts, per_host)


@pytest.mark.timeout(60)
def test_hosts_usage_errors():
    base = [sys.executable, "-m", "pycoll", "run"]
    for args, words in [
        (["-n", "1", "--hosts", "2"], "leaves hosts without ranks"),
        (["-n", "3", "--link-rate", "1gbit"], "--link-rate needs --hosts"),
        (["-n", "3", "--hosts", "2", "--link-rate", "warp9"], "bad link rate"),
        (["-n", "3", "--ranks-per-host", "1,1"], "adds up to 2"),
        (["-n", "3", "--hosts", "2", "--ranks-per-host", "1,1,1"], "lists 3 hosts"),
        (["-n", "3", "--hosts", "2", "PYCOLL_BIND=spread"], "PYCOLL_BIND must be auto or none, got 'spread'"),
    ]:
        env = clean_env()
        for arg in [a for a in args if a.startswith("PYCOLL_")]:  # an environment setting, not an argument
            args = [a for a in args if a != arg]
            env[arg.split("=")[0]] = arg.split("=")[1]
        res = subprocess.run(base + args + ["true"], cwd=REPO, env=env, capture_output=True, text=True,
                             timeout=60)
        assert res.returncode == 2 and words in res.stderr, (args, res.stderr)


def test_hosts_unavailable_is_a_clear_error(monkeypatch, capsys):
    from pycoll import launcher, netns

    monkeypatch.setattr(netns, "prerequisite_missing", lambda need_tc=False: "network namespaces need root")
    args = argparse.Namespace(cmd=["--", "true"], n=2, hosts=2, ranks_per_host=None, link_rate=None, timeout=None,
                              tag_output=False)
    assert launcher.run_command(args) == 1
    assert "--hosts needs network namespaces" in capsys.readouterr().err


@pytest.mark.timeout(60)
def test_ranks_get_their_share_of_the_cores_unless_the_user_says(tmp_path, monkeypatch):
    from pycoll import launcher, machine

    monkeypatch.setattr(machine, "usable_cores", lambda: 8)
    assert launcher.thread_share(3, {}) == {"OMP_NUM_THREADS": "2"}
    assert launcher.thread_share(16, {}) == {"OMP_NUM_THREADS": "1"}  # never none
    assert launcher.thread_share(1, {}) == {}  # one rank keeps every core
    for name in launcher.THREAD_VARS:
        assert launcher.thread_share(3, {name: "4"}) == {}  # the user's choice stands
    assert launcher.thread_share(3, {"OMP_NUM_THREADS": ""}) == {"OMP_NUM_THREADS": "2"}  # empty says nothing
    monkeypatch.undo()
    for k in list(os.environ):
        if k in _LAUNCHER_VARS or k.startswith(_LAUNCHER_PREFIXES) or k in launcher.THREAD_VARS:
            monkeypatch.delenv(k)
    script = ("import os, pathlib; pathlib.Path(os.environ['DIR'], os.environ['PYCOLL_RANK'])"
              ".write_text(os.environ.get('OMP_NUM_THREADS', '-'))")
    share = str(max(1, machine.usable_cores() // 2))
    assert launch(2, [sys.executable, "-c", script], env={"DIR": str(tmp_path)}, timeout=50) == 0
    assert [p.read_text() for p in sorted(tmp_path.iterdir())] == [share, share]
    assert launch(2, [sys.executable, "-c", script], env={"DIR": str(tmp_path), "OMP_NUM_THREADS": "3"},
                  timeout=50) == 0
    assert [p.read_text() for p in sorted(tmp_path.iterdir())] == ["3", "3"]


@pytest.mark.timeout(60)
def test_forked_ranks_inherit_the_share_the_launcher_loaded_under():
    script = """
    import os, sys
    import numpy  # noqa: F401  (preloaded in the launcher, with its thread pool)
    line = f"RANK {os.environ['PYCOLL_RANK']} {os.environ.get('OMP_NUM_THREADS')} {'pycoll.launcher' in sys.modules}\\n"
    os.write(1, line.encode())  # one write: the forked ranks share the launcher's stdout, unbuffered where
    # PYTHONUNBUFFERED is set, and a print of several items then interleaves ("RANKRANK 1 1 True" failed CI once)
    """
    env = {k: "" for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}
    res = pycoll_run(["-n", "2"], script, PYCOLL_RUN_FORK="1", **env)
    assert res.returncode == 0, res.stderr
    from pycoll.machine import usable_cores

    share = str(max(1, usable_cores() // 2))
    lines = sorted(line for line in res.stdout.splitlines() if line.startswith("RANK"))
    assert lines == [f"RANK 0 {share} True", f"RANK 1 {share} True"]  # forked, and told their share


def test_virtual_hosts_leaders_get_cpus_of_their_own():
    """Every host's first rank gets the next CPU, then every host's second rank, round the CPUs: with a CPU per
    rank each rank has one of its own; where the ranks outnumber the CPUs, the leaders are apart."""
    from pycoll.launcher import cpu_binding

    assert cpu_binding([2, 2], [0, 1]) == [0, 0, 1, 1]  # leaders 0 and 2 apart
    assert cpu_binding([3, 1], [4, 6]) == [4, 4, 6, 6]
    assert cpu_binding([2, 1, 2], [0, 1]) == [0, 1, 1, 0, 0]  # leaders 0, 2, 3 on 0, 1, 0
    assert cpu_binding([2, 2], [0, 1, 2]) == [0, 2, 1, 0]
    assert cpu_binding([2, 2], [0, 1, 2, 3]) == [0, 2, 1, 3]
    assert cpu_binding([1, 1], [0, 1]) == [0, 1]  # two ranks never begin on one CPU
    assert cpu_binding([1, 1], [3, 5, 7]) == [3, 5]
    assert cpu_binding([1, 1], [0]) == [0, 0]
    assert cpu_binding([2, 2], []) == [None] * 4  # nothing known: the scheduler decides


@pytest.mark.timeout(120)
@pytest.mark.parametrize("extra", [0, 1])  # a CPU for each rank, and one rank more than CPUs
def test_ranks_on_virtual_hosts_are_bound(tmp_path, monkeypatch, extra):
    from pycoll import launcher, machine, netns

    missing = netns.prerequisite_missing(False)
    if missing:
        pytest.skip(missing)
    for k in list(os.environ):
        if k in _LAUNCHER_VARS or k.startswith(_LAUNCHER_PREFIXES):
            monkeypatch.delenv(k)
    cpus = sorted(machine.affinity())
    n = max(len(cpus) + extra, 2)
    script = ("import os, pathlib; pathlib.Path(os.environ['DIR'], os.environ['PYCOLL_RANK'])"
              ".write_text(','.join(map(str, sorted(os.sched_getaffinity(0)))))")
    assert launch(n, [sys.executable, "-c", script], env={"DIR": str(tmp_path)}, hosts=2, timeout=100) == 0
    got = [(tmp_path / str(r)).read_text() for r in range(n)]
    want = launcher.cpu_binding(launcher.plan_hosts(n, 2), cpus if machine.usable_cores() >= len(cpus) else [])
    assert got == [str(c) if c is not None else ",".join(map(str, cpus)) for c in want]
    if extra == 0 and len(cpus) >= 2 and machine.usable_cores() >= len(cpus):
        assert sorted(got) == sorted(map(str, cpus)), got  # a CPU of its own each
    assert launch(n, [sys.executable, "-c", script], env={"DIR": str(tmp_path), "PYCOLL_BIND": "none"}, hosts=2,
                  timeout=100) == 0
    assert {(tmp_path / str(r)).read_text() for r in range(n)} == {",".join(map(str, cpus))}
    with pytest.raises(ValueError, match="PYCOLL_BIND must be auto or none, got 'spread'"):
        launch(n, [sys.executable, "-c", script], env={"PYCOLL_BIND": "spread"}, hosts=2, timeout=100)
