"""Ranks forked from `pycoll run` once it has imported pycoll: a Python program starts as `python PROG` would, minus a second interpreter start-up and the imports every rank would repeat."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from types import FrameType
from typing import Callable, Optional, Sequence

from .config import bool_param, environ, str_param

RUN_FORK = bool_param(
    "PYCOLL_RUN_FORK",
    False,
    "`pycoll run`: 1 starts the ranks of a Python program (`python SCRIPT`, `python -c CODE` or `python -m MODULE`, "
    "by this interpreter, with the launcher's environment) by forking the launcher after it imported "
    "PYCOLL_RUN_PRELOAD, instead of starting a new interpreter per rank that imports them again (start-up about 2.6x "
    "mpiexec's instead of 3.2x here, but small calls measured slower in forked ranks). 0 (default): exec.",
)
PRELOAD = str_param(
    "PYCOLL_RUN_PRELOAD",
    "pycoll.MPI",
    "`pycoll run`, forked ranks: the modules the launcher imports before it forks them, comma-separated "
    "(e.g. pycoll.MPI,torch).",
)

# What the launcher sets per rank; every other variable must be the launcher's own for a rank to be forked
RANK_VARIABLES = frozenset({
    "PYCOLL_RANK", "PYCOLL_SIZE", "PYCOLL_LOCAL_RANK", "PYCOLL_LOCAL_SIZE", "PYCOLL_STORE_ADDR", "PYCOLL_JOB_TOKEN",
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "PYTHONPATH",
})


class Program:
    """A Python program as its command line names it: ``kind`` is "path", "code" or "module"."""

    __slots__ = ("kind", "target", "args", "path_first")

    def __init__(self, kind: str, target: str, args: list[str], path_first: Sequence[str] = ()) -> None:
        self.kind, self.target, self.args = kind, target, args
        self.path_first = list(path_first)  # directories the rank's PYTHONPATH puts before the launcher's


def python_program(cmd: Sequence[str], child_env: dict[str, str], path_first: Sequence[str] = (),
                   preset: Sequence[str] = ()) -> Optional[Program]:
    """The program ``cmd`` runs if it can be forked from this process: this interpreter (the same file in the same
    directory, so the same virtual environment) with no options but ``-c`` or ``-m``, started with the flags
    a fresh one would have, and ``child_env`` this process's environment but for the rank's variables
    (PYTHONPATH may differ by ``path_first`` in front) and ``preset``, variables the launcher sets for every rank
    and itself before ``preload`` (the thread share). None otherwise: the rank is exec'd."""
    if not RUN_FORK.get() or not hasattr(os, "fork") or len(cmd) < 2:
        return None
    if threading.current_thread() is not threading.main_thread() or not _default_flags() or not _launcher_only():
        return None
    mine = {k: v for k, v in os.environ.items() if k not in RANK_VARIABLES and k not in preset}
    theirs = {k: v for k, v in child_env.items() if k not in RANK_VARIABLES and k not in preset}
    if mine != theirs:
        return None
    own_path = os.environ.get("PYTHONPATH", "")
    expected = os.pathsep.join([*path_first, own_path]) if path_first and own_path else os.pathsep.join(path_first) or own_path
    if child_env.get("PYTHONPATH", "") != expected:
        return None
    return parse_command(cmd, child_env.get("PATH", ""), path_first)


def parse_command(cmd: Sequence[str], search_path: str, path_first: Sequence[str] = ()) -> Optional[Program]:
    """The program of ``cmd`` if it runs this interpreter (the same file in the same directory, so the same virtual
    environment; found on ``search_path``) on a script file, ``-c CODE`` or ``-m MODULE`` with no other options."""
    found = _which(cmd[0], search_path) if cmd else None
    if found is None or len(cmd) < 2 or not _same_interpreter(found):
        return None
    first, rest = cmd[1], list(cmd[2:])
    if first in ("-c", "-m"):
        if not rest:
            return None
        return Program("code" if first == "-c" else "module", rest[0], rest[1:], path_first)
    if first.startswith("-") or not os.path.isfile(first):
        return None  # other options, stdin, a directory or a zip file: a fresh interpreter handles those
    return Program("path", first, rest, path_first)


def _launcher_only() -> bool:
    """Whether every frame on the stack is the launcher's (the `pycoll` command, ``python -m pycoll``): a forked rank
    leaves by raising SystemExit through them, which must run nobody else's code (a test calling ``launch``)."""
    import runpy

    here = os.path.dirname(os.path.abspath(__file__))
    ours = {os.path.join(here, name) for name in ("cli.py", "launcher.py", "__main__.py", "forked_ranks.py")}
    ours.update((runpy.__file__, "<frozen runpy>"))  # `python -m pycoll`: runpy, frozen into 3.11's interpreter
    main_file = getattr(sys.modules.get("__main__"), "__file__", None)
    if main_file:
        ours.add(os.path.abspath(main_file))
    frame: Optional[FrameType] = sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_filename
        if name not in ours and os.path.abspath(name) not in ours:
            return False
        frame = frame.f_back
    return True


def _default_flags() -> bool:
    """Whether this interpreter runs with the flags a plain ``python PROG`` gets (then forked ranks match it)."""
    f = sys.flags
    return not (f.optimize or f.dev_mode or f.isolated or f.ignore_environment or f.no_site or f.inspect
                or f.interactive or f.verbose or f.bytes_warning or f.quiet or getattr(f, "safe_path", False)
                or sys._xoptions or sys.warnoptions)


def _which(name: str, path: str) -> Optional[str]:
    if os.sep in name:
        return name if os.access(name, os.X_OK) else None
    for d in path.split(os.pathsep):
        candidate = os.path.join(d or ".", name)
        if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    return None


def _same_interpreter(path: str) -> bool:
    mine = os.path.abspath(sys.executable)
    theirs = os.path.abspath(path)
    return (os.path.dirname(mine) == os.path.dirname(theirs)
            and os.path.realpath(mine) == os.path.realpath(theirs))


def preload(preset: Optional[dict[str, str]] = None) -> bool:
    """Import PYCOLL_RUN_PRELOAD's modules here, before forking, with ``preset`` in this process's environment while
    they load (thread pools are sized then, and the ranks inherit them); False (fork nothing) if one fails."""
    import importlib

    try:
        with environ(preset or {}):
            for name in filter(None, (m.strip() for m in PRELOAD.get().split(","))):
                importlib.import_module(name)
    except Exception:  # noqa: BLE001 - the ranks then start fresh and report the import error themselves
        return False
    return True


class ForkedRank:
    """A forked rank as the launcher handles a ``subprocess.Popen``: ``pid``, ``poll``, ``wait``. Its reaper thread
    (``reap``) is the only caller of waitpid."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: Optional[int] = None
        self._done = threading.Event()

    def reap(self) -> int:
        _, status = os.waitpid(self.pid, 0)
        self.returncode = os.waitstatus_to_exitcode(status)
        self._done.set()
        return self.returncode

    def poll(self) -> Optional[int]:
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        if not self._done.wait(timeout):
            raise subprocess.TimeoutExpired([str(self.pid)], timeout or 0.0)
        assert self.returncode is not None
        return self.returncode


def fork(program: Program, env: dict[str, str], stdin: Optional[int], outputs: Optional[tuple[int, int]],
         forget: Callable[[], None]) -> ForkedRank:
    """Fork a rank that runs ``program`` with ``env``; in the child, ``forget`` closes the launcher's own files first.
    ``stdin``: a file descriptor the rank reads as its standard input (-1: nothing, as /dev/null; None: the
    launcher's); ``outputs``: pipe write ends for the rank's stdout and stderr (None: inherit them)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()  # nothing buffered here is written twice
        except (AttributeError, ValueError, OSError):
            pass
    pid = os.fork()
    if pid:
        return ForkedRank(pid)
    try:
        os.setpgid(0, 0)  # its own process group, as an exec'd rank gets
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGTSTP, signal.SIGCONT):  # the launcher's handlers
            signal.signal(sig, signal.SIG_DFL)
        forget()
        if stdin is not None:
            fd = os.open(os.devnull, os.O_RDONLY) if stdin < 0 else stdin
            os.dup2(fd, 0)
            os.close(fd)
        if outputs is not None:
            os.dup2(outputs[0], 1)
            os.dup2(outputs[1], 2)
            os.close(outputs[0])
            os.close(outputs[1])
        os.environ.clear()
        os.environ.update(env)
        np_random = sys.modules.get("numpy.random")
        if np_random is not None:
            np_random.seed()  # NumPy's global generator draws its own seed in each rank, as in a fresh interpreter
    except BaseException:  # noqa: BLE001 - the child must never go back into the launcher
        os._exit(127)
    raise SystemExit(_run(program))


def _run(program: Program) -> int:
    """Run ``program`` as this process's ``__main__``, as the interpreter does; its exit code. Its uncaught error is
    reported by ``sys.excepthook`` from the program's own frames down. The caller raises SystemExit with the code,
    so the interpreter then exits as usual (atexit handlers, buffered files flushed)."""
    import builtins
    import types

    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = builtins
    try:
        if program.kind == "module":
            import runpy

            sys.argv = [program.target, *program.args]
            sys.path[0] = os.getcwd()
            sys.path[1:1] = program.path_first
            sys.modules["__main__"] = main
            runpy._run_module_as_main(program.target, alter_argv=True)  # type: ignore[attr-defined]
        else:
            import importlib.machinery

            if program.kind == "path":
                path = os.path.abspath(program.target)
                sys.argv = [program.target, *program.args]
                sys.path[0] = os.path.dirname(os.path.realpath(path))
                with open(path, "rb") as fh:
                    source = fh.read()
                main.__file__ = path
                main.__loader__ = importlib.machinery.SourceFileLoader("__main__", path)
                code = compile(source, path, "exec")
            else:
                sys.argv = ["-c", *program.args]
                sys.path[0] = ""
                main.__loader__ = importlib.machinery.BuiltinImporter  # type: ignore[assignment]
                code = compile(program.target, "<string>", "exec")
            sys.path[1:1] = program.path_first
            main.__spec__ = None
            sys.modules["__main__"] = main
            exec(code, main.__dict__)
    except SystemExit:
        raise
    except BaseException as exc:  # noqa: BLE001 - reported as the interpreter would, then exit 1
        tb = exc.__traceback__
        own = {__file__, getattr(sys.modules.get("runpy"), "__file__", None)}
        while tb is not None and tb.tb_frame.f_code.co_filename in own:
            tb = tb.tb_next
        sys.excepthook(type(exc), exc.with_traceback(tb), tb)  # the hook prints the exception's own traceback
        return 130 if isinstance(exc, KeyboardInterrupt) else 1
    return 0

