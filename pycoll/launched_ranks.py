"""The ranks `pycoll run` starts: exec'd or forked, in process groups of the launcher's session, their output tagged,
the terminal forwarded to rank 0, signalled, stopped, and killed with the launcher."""

from __future__ import annotations

import os
import queue
import select
import signal
import subprocess
import sys
import threading
import time
from typing import IO, Any, Callable, Optional

from pycoll import forked_ranks

# Seconds between SIGTERM and SIGKILL when the launcher stops ranks.
_TERM_TO_KILL = 3.0


class Tagger:
    """Copies a child's pipe to our stream line by line, each line prefixed with ``[rank] ``."""

    def __init__(self, rank: int, pipe: IO[bytes], out: Any, lock: threading.Lock) -> None:
        self.thread = threading.Thread(target=self._run, args=(rank, pipe, out, lock), daemon=True)
        self.thread.start()

    @staticmethod
    def _run(rank: int, pipe: IO[bytes], out: Any, lock: threading.Lock) -> None:
        tag = f"[{rank}] ".encode()
        binary = getattr(out, "buffer", None)
        with pipe:
            for line in iter(pipe.readline, b""):
                if not line.endswith(b"\n"):
                    line += b"\n"
                with lock:
                    if binary is not None:
                        binary.write(tag + line)
                        binary.flush()
                    else:
                        out.write((tag + line).decode(errors="replace"))
                        out.flush()


_PR_SET_PDEATHSIG = 1  # prctl(2)


def killed_with_us() -> Optional[Callable[[], None]]:
    """What a rank runs between its fork and its program so that the kernel kills it when this launcher's process
    goes, even by SIGKILL (Linux's parent-death signal; hydra's proxies likewise kill their ranks when mpiexec
    goes): None where that is not to be had. The parent is the thread that forks: the one that waits for the ranks."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    launcher = os.getpid()

    def die_with_launcher() -> None:
        prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        if os.getppid() != launcher:  # it went before the call: nobody would send the signal now
            os.kill(os.getpid(), signal.SIGKILL)

    return die_with_launcher


class Job:
    """The running ranks: spawn, wait, signal, and stop them."""

    def __init__(self) -> None:
        self.die_with_us = killed_with_us()
        self.procs: list[Any] = []  # subprocess.Popen, or forked_ranks.ForkedRank
        self.exits: "queue.Queue[tuple[int, int]]" = queue.Queue()
        self.taggers: list[Tagger] = []
        self.pipes: list[IO[bytes]] = []  # our ends of forked ranks' output pipes (a later fork closes its copies)

    def spawn(self, rank: int, cmd: list[str], env: dict[str, str], tag_output: bool, cpu: Optional[int] = None) -> None:
        """Start one rank; ``cpu``: the one CPU it may run on (None: any)."""
        pipe = subprocess.PIPE if tag_output else None
        stdin = stdin_of(rank)
        # Own process group per rank (we forward signals ourselves and can kill whole trees), in our session: the
        # scheduler's autogroups are per session, and ranks in groups of their own ignore each other's sched_yield
        try:
            proc = subprocess.Popen(
                cmd,
                env=env,
                stdin=subprocess.DEVNULL if stdin == -1 else stdin,
                stdout=pipe,
                stderr=pipe,
                process_group=0,
                preexec_fn=self.die_with_us,  # a ctypes call, ready before the fork (as Ray starts its workers)
            )
        finally:
            if stdin is not None and stdin >= 0:
                os.close(stdin)
        self.procs.append(proc)
        if cpu is not None:
            try:  # ``ip netns exec`` replaces itself with the command: the binding stays with the rank
                os.sched_setaffinity(proc.pid, {cpu})
            except OSError:  # it already exited: its exit code tells
                pass
        if tag_output:
            lock = OUTPUT_LOCK
            assert proc.stdout is not None and proc.stderr is not None
            self.taggers.append(Tagger(rank, proc.stdout, sys.stdout, lock))
            self.taggers.append(Tagger(rank, proc.stderr, sys.stderr, lock))
        threading.Thread(target=self._reap, args=(rank, proc), daemon=True).start()

    def fork(self, rank: int, program: forked_ranks.Program, env: dict[str, str], tag_output: bool,
             forget: Callable[[], None]) -> None:
        """``spawn`` by forking this process (see pycoll.forked_ranks); ``forget`` closes our files in the child."""
        outputs = (os.pipe(), os.pipe()) if tag_output else None

        def forget_all() -> None:
            if self.die_with_us is not None:
                self.die_with_us()
            forget()
            for pipe in self.pipes:
                pipe.close()
            if outputs is not None:
                os.close(outputs[0][0])
                os.close(outputs[1][0])

        stdin = stdin_of(rank)
        try:  # in the child this raises SystemExit once the program has run: only the launcher goes on below
            proc = forked_ranks.fork(program, env, stdin, (outputs[0][1], outputs[1][1]) if outputs else None,
                                     forget_all)
        except OSError:  # no fork: nothing started
            for fd in (fd for pair in outputs or () for fd in pair):
                os.close(fd)
            if stdin is not None and stdin >= 0:
                os.close(stdin)
            raise
        if stdin is not None and stdin >= 0:  # the child took it (and leaves with SystemExit: never here)
            os.close(stdin)
        self.procs.append(proc)
        if outputs is not None:
            os.close(outputs[0][1])
            os.close(outputs[1][1])
            self.pipes += [os.fdopen(outputs[0][0], "rb"), os.fdopen(outputs[1][0], "rb")]
        threading.Thread(target=lambda: self.exits.put((rank, proc.reap())), daemon=True).start()

    def copy_forked_outputs(self) -> None:
        """Start copying the forked ranks' output pipes, once all are forked: a copying thread holds our stdout's
        lock while it writes, and a rank forked then would find that lock taken by a thread it does not have."""
        for k, pipe in enumerate(self.pipes):
            self.taggers.append(Tagger(k // 2, pipe, sys.stdout if k % 2 == 0 else sys.stderr, OUTPUT_LOCK))

    def _reap(self, rank: int, proc: subprocess.Popen) -> None:
        self.exits.put((rank, proc.wait()))

    def running(self) -> list[subprocess.Popen]:
        return [p for p in self.procs if p.poll() is None]

    def signal_all(self, sig: int) -> None:
        for proc in self.procs:
            try:
                os.killpg(proc.pid, sig)  # the rank and anything it started
            except (ProcessLookupError, PermissionError):
                pass

    def suspend(self, _signum: int, _frame: Any) -> None:
        """SIGTSTP (Ctrl-Z): stop every rank's group, then this process, as a shell's job stops whole; the ranks sit
        in process groups of their own, which the terminal's signal does not reach."""
        self.signal_all(signal.SIGTSTP)
        ours = signal.signal(signal.SIGTSTP, signal.SIG_DFL)
        try:
            os.kill(os.getpid(), signal.SIGTSTP)  # stopped here until SIGCONT (not at all where our group is orphaned)
        finally:
            signal.signal(signal.SIGTSTP, ours)

    def resume(self, _signum: int, _frame: Any) -> None:
        """SIGCONT (`fg`, `bg`): the ranks go on with us."""
        self.signal_all(signal.SIGCONT)

    def stop(self) -> None:
        """SIGTERM every group, then SIGKILL what is left after _TERM_TO_KILL seconds."""
        if self.running():
            self.signal_all(signal.SIGTERM)
            deadline = time.monotonic() + _TERM_TO_KILL
            for proc in self.procs:
                try:
                    proc.wait(max(deadline - time.monotonic(), 0.0))
                except subprocess.TimeoutExpired:
                    pass
        # Kill every group, even of ranks that exited: their children may linger.
        self.signal_all(signal.SIGKILL)
        for proc in self.procs:
            proc.wait()
        for tagger in self.taggers:
            tagger.thread.join(timeout=5.0)


OUTPUT_LOCK = threading.Lock()


def foreground() -> bool:
    """Whether this process's group holds our terminal (stdin) in the foreground: only then may it read it."""
    try:
        return os.tcgetpgrp(0) == os.getpgrp()
    except OSError:
        return False


def stdin_of(rank: int) -> Optional[int]:
    """What a rank reads as its standard input: -1 (nothing) but for rank 0, which reads ours (None); where ours is
    a terminal, through a pipe that a thread here fills from it (the descriptor of its read end), as mpiexec
    forwards it: a rank's process group is in the background of the terminal's session, where a read would stop it.
    A launcher started in the background gives rank 0 nothing; one put there later stops forwarding until it is
    in the foreground again (it never reads the terminal from the background, which would stop it)."""
    if rank != 0:
        return -1
    try:
        if not os.isatty(0):
            return None
    except OSError:
        return None
    if not foreground():
        return -1
    read_end, write_end = os.pipe()

    def forward() -> None:
        try:
            while True:
                if not select.select([0], [], [], 0.5)[0]:
                    continue
                if not foreground():
                    time.sleep(0.5)
                    continue
                data = os.read(0, 1 << 16)
                if not data:
                    break
                os.write(write_end, data)
        except OSError:  # rank 0 is gone, or our terminal
            pass
        finally:
            os.close(write_end)

    threading.Thread(target=forward, name="pycoll-stdin", daemon=True).start()
    return read_end
