"""Build hooks: compile the ahead-of-time kernels (pycoll.native_build) into the package while it is installed (and,
for an editable install, its bytecode), the C shape key of a call (pycoll/_callkey.c) and the C frame swap between hosts
(pycoll/transport/_tcpframe.c), both optional: without them pycoll does the same in Python."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


class BuildPyWithKernels(build_py):
    """build_py, then the kernels: into the source tree for an editable install, else beside the built package.
    Without a compiler the install goes on, and pycoll runs Numba's JIT instead (`pycoll warmup` builds later)."""

    def run(self) -> None:
        super().run()
        if os.environ.get("PYCOLL_SKIP_KERNEL_BUILD"):
            return
        editable = getattr(self, "editable_mode", False)
        out = ROOT / "pycoll" / "_native" if editable else Path(self.build_lib) / "pycoll" / "_native"
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
        cmd = [sys.executable, "-m", "pycoll.native_build", "--out", str(out)]
        if subprocess.run(cmd, env=env, cwd=ROOT).returncode != 0:
            print("pycoll: the ahead-of-time kernels did not build; pycoll will use Numba's JIT", file=sys.stderr)
        if editable:  # pip compiles an installed package's bytecode; an editable one's source is compiled here
            import compileall

            compileall.compile_dir(str(ROOT / "pycoll"), quiet=2)


def _numpy_include() -> str:
    import numpy

    return numpy.get_include()


# optional: a failed compile leaves the Python form of the key (pycoll.executor.shape_key) in use
CALL_KEY = Extension("pycoll._callkey", ["pycoll/_callkey.c"], include_dirs=[_numpy_include()], optional=True)
# optional too: without it a frame between hosts moves in the engine's Python calls (pycoll.p2p_eager)
TCP_FRAME = Extension("pycoll.transport._tcpframe", ["pycoll/transport/_tcpframe.c"], optional=True)

setup(cmdclass={"build_py": BuildPyWithKernels}, ext_modules=[CALL_KEY, TCP_FRAME])
