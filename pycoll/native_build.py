"""Builds the ahead-of-time kernels (``pycoll.native``) with Numba's compiler, and the package's bytecode: at
install, or by `pycoll warmup`.

Each family is one extension module exporting every signature of its kernels: the arena and staged kernels' from
the table in ``algorithms._arena_signatures``, the point-to-point kernels' from their decorators. Beside it goes a
JSON file with each export's parameters and the dtype that selects it, which ``pycoll.native`` reads without Numba.
The families build in parallel processes (one to two minutes each on one core).
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Optional

from . import native

FAMILIES = ("arena", "staged", "p2p")
_STAGED = ("broadcast", "pipe_broadcast", "blocks", "pipe_blocks")  # the arena kernels of the ``staged`` family


def _kernel_table(kind: str) -> dict[str, tuple[Any, list[Any]]]:
    """Kernel name -> (its Numba dispatcher, its signatures with return types), for ``kind``."""
    from numba.core.registry import CPUDispatcher

    if kind in ("arena", "staged"):
        from .algorithms import _arena_kernels as module
        from .algorithms._arena_signatures import signatures

        return {name: (getattr(module, name), sigs) for name, sigs in signatures().items()
                if (name in _STAGED) == (kind == "staged")}
    from . import p2p_kernels as module  # explicit signatures: compiled (or loaded) by the import

    table = {}
    for name, fn in vars(module).items():
        if isinstance(fn, CPUDispatcher) and not name.startswith("_") and fn.nopython_signatures:
            table[name] = (fn, list(fn.nopython_signatures))
    return table


def _arg_spec(ty: Any) -> Optional[dict[str, Any]]:
    """How ``pycoll.native`` checks an argument of Numba type ``ty``: an array's dtype, rank and layout; None else."""
    from numba import types

    if isinstance(ty, types.Array):
        return {"dtype": str(ty.dtype) if str(ty.dtype) != "bool" else "bool", "ndim": ty.ndim, "layout": ty.layout}
    return None


def build_family(kind: str, out_dir: Path) -> Path:
    """Compile family ``kind`` into ``out_dir``: the extension module and its JSON table; the module's path."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the pycc module's pending deprecation, Numba's pedantic IR notes
        from numba.pycc import CC

        table = _kernel_table(kind)
        name = native.module_name(kind, native.source_hash(kind))
        out_dir.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=out_dir))
        previous_tempdir, tempfile.tempdir = tempfile.tempdir, str(work)  # the compiler's probes go with work
        try:
            cc = CC(name)
            cc.output_dir = str(work)
            cc.verbose = False
            described: dict[str, Any] = {}
            for kname, (dispatcher, sigs) in table.items():
                params = list(inspect.signature(dispatcher.py_func).parameters)
                exports: list[dict[str, Any]] = []
                seen: set[tuple] = set()
                for sig in sigs:
                    specs = [_arg_spec(a) for a in sig.args]
                    shape = tuple(tuple(sorted(s.items())) if s else None for s in specs)
                    if shape in seen:  # differs only in read-only flags, which compiled exports do not check
                        continue
                    seen.add(shape)
                    symbol = f"{kname}__{len(exports)}"
                    cc.export(symbol, sig.return_type(*sig.args))(dispatcher.py_func)
                    exports.append({"symbol": symbol, "args": specs})
                key = _distinguishing(exports)
                for ex in exports:
                    ex["dtype"] = ex["args"][key]["dtype"] if key is not None else None
                described[kname] = {"params": params, "exports": exports}
            cc.compile()
            built = next(work.glob(f"{name}*"))
            target = out_dir / built.name
            os.replace(built, target)
            (out_dir / f"{name}.json").write_text(json.dumps({"kind": kind, "kernels": described}, indent=1))
        finally:
            tempfile.tempdir = previous_tempdir
            shutil.rmtree(work, ignore_errors=True)
    for old in out_dir.glob(f"_pycoll_{kind}_kernels_*"):  # earlier builds of this family
        if not old.name.startswith(name):
            old.unlink(missing_ok=True)
    return target


def _distinguishing(exports: list[dict[str, Any]]) -> Optional[int]:
    """The first argument whose dtype differs between every two exports (None for a single export)."""
    if len(exports) < 2:
        return None
    for i in range(len(exports[0]["args"])):
        specs = [ex["args"][i] for ex in exports]
        if all(specs) and len({s["dtype"] for s in specs}) == len(specs):
            return i
    raise ValueError("exports of one kernel must differ in one argument's dtype")


def target_dir() -> Path:
    """Where a build goes: the package's own folder when writable, else the user cache."""
    package, cache = native.build_dirs()
    try:
        package.mkdir(exist_ok=True)
        probe = package / f".write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
        return package
    except OSError:
        return cache


def build(out_dir: Optional[Path] = None, families: tuple[str, ...] = FAMILIES, quiet: bool = False) -> list[Path]:
    """Build every family not yet built for the current sources, each in its own process, in parallel."""
    out = out_dir or target_dir()
    todo = [k for k in families if not _current(k, out)]
    procs = [(k, subprocess.Popen([sys.executable, "-m", "pycoll.native_build", "--family", k, "--out", str(out)],
                                  stdout=subprocess.DEVNULL if quiet else None)) for k in todo]
    failed = [k for k, p in procs if p.wait() != 0]
    native.forget()
    if failed:
        raise RuntimeError(f"building the {', '.join(failed)} kernels failed (see the output above)")
    return [out / native.module_name(k, native.source_hash(k)) for k in families]


def compile_bytecode(*folders: Path) -> bool:
    """Write the bytecode of pycoll's modules (and of ``folders``) where it is missing or stale. Python reads it even
    under PYTHONDONTWRITEBYTECODE, which stops it from writing any: without it every rank compiled pycoll's source
    on import (0.3 s of a 0.4 s import here), which an editable install never writes either. False where a folder
    could not be written (a read-only install has its bytecode from pip already)."""
    import compileall

    ok = True
    for folder in (Path(__file__).resolve().parent, *folders):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                ok = bool(compileall.compile_dir(str(folder), quiet=2, workers=1)) and ok
            except OSError:
                ok = False
    return ok


def _current(kind: str, folder: Path) -> bool:
    return (folder / f"{native.module_name(kind, native.source_hash(kind))}.json").is_file()


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pycoll.native_build", description=__doc__.splitlines()[0])
    p.add_argument("--family", choices=FAMILIES, help="build one family here (default: all, in parallel)")
    p.add_argument("--out", type=Path, help="output folder (default: the package's _native folder, else the cache)")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    if args.family:
        path = build_family(args.family, args.out or target_dir())
        print(f"pycoll: built {path.name} in {time.perf_counter() - t0:.0f} s")
    else:
        build(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
