"""Loads the kernels compiled ahead of time (at install, or by `pycoll warmup`): ready at the first call, no Numba.

Each kernel family (``arena``: the arena's small collectives; ``staged``: its pipelined ones; ``p2p``: the eager
point-to-point steps) is one extension module built by ``pycoll.native_build`` with Numba's ahead-of-time compiler, beside a JSON file that lists its
exports: every kernel signature, its parameters and the dtype that selects it. The module's name carries a hash of
the kernel sources it was built from (``SOURCES``), so a build older than the sources is never loaded: the caller
then takes Numba's just-in-time path (``arena_jit``), as it does where no build exists or ``PYCOLL_KERNELS=jit``.

Compiled exports trust their arguments (a wrong dtype, rank or layout is read as if right), so a ``KernelSet``
gives three views of each kernel: ``ks.name(...)`` checks every array argument and raises TypeError as Numba's
dispatcher does; ``ks.fast(name, dtype)`` checks only the arguments that come from users (``USER_PARAMS``);
``ks.raw(name, dtype)`` checks nothing, for call sites whose arguments were checked when their plan was made.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.machinery
import importlib.util
import json
import logging
import os
import sys
import threading
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np

from .config import str_param

log = logging.getLogger("pycoll")

KERNELS = str_param(
    "PYCOLL_KERNELS", "auto",
    "Which compiled kernels run: `auto` (the ahead-of-time build when it matches the sources, else Numba's JIT with "
    "its disk cache, loaded in the background), `aot` (the same, but say at the first call when no build matches) "
    "or `jit` (always Numba's JIT).",
)
NATIVE_DIR = str_param(
    "PYCOLL_NATIVE_DIR", "",
    "Folder for the ahead-of-time kernel builds when the package folder is not writable (default: "
    "$XDG_CACHE_HOME/pycoll/native, else ~/.cache/pycoll/native).",
)

PACKAGE = Path(__file__).resolve().parent
# The files each family's compiled code depends on (constants, layouts, intrinsics), relative to the package.
_ARENA_SOURCES = ("algorithms/_arena_kernels.py", "algorithms/_arena_signatures.py", "transport/atomics.py",
                  "transport/cma.py", "pages.py", "transport/arena.py", "ops.py", "native_build.py")
SOURCES: dict[str, tuple[str, ...]] = {
    "arena": _ARENA_SOURCES,  # the small collectives and Barrier
    "staged": _ARENA_SOURCES,  # the staged pipes' chunk loops (apart, so the two build in parallel)
    "p2p": ("p2p_kernels.py", "p2p_addresses.py", "p2p_split.py", "p2p_lane.py", "transport/atomics.py",
            "transport/cma.py", "transport/shm.py", "pages.py", "native_build.py"),
}
# Parameters that carry a user's buffer (or a view of one): the only ones ``fast`` checks.
USER_PARAMS = frozenset({"send", "recv", "buf", "payload", "dst"})

_lock = threading.Lock()
_loaded: dict[str, Optional["KernelSet"]] = {}
_why: dict[str, str] = {}


def source_hash(kind: str) -> str:
    """A hash of the sources the ``kind`` family is compiled from, and of the interpreter's ABI."""
    return _hash_of(SOURCES[kind])


@functools.lru_cache(maxsize=None)
def _hash_of(sources: tuple[str, ...]) -> str:
    """Once per process and list of sources: the arena and staged families share theirs (2-3 ms a reading)."""
    h = hashlib.sha256(sys.implementation.cache_tag.encode())
    for rel in sources:
        h.update(rel.encode())
        h.update((PACKAGE / rel).read_bytes())
    return h.hexdigest()[:16]


def module_name(kind: str, digest: str) -> str:
    return f"_pycoll_{kind}_kernels_{digest}"


def build_dirs() -> list[Path]:
    """Where builds are looked for, in order: the package's own ``_native`` folder, then the user cache."""
    cache = NATIVE_DIR.get() or os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"),
                                             "pycoll", "native")
    return [PACKAGE / "_native", Path(cache)]


def load(kind: str) -> Optional["KernelSet"]:
    """The ``kind`` family's ahead-of-time kernels, or None (``why(kind)`` says why) when none match the sources."""
    got = _loaded.get(kind, False)
    if got is not False:
        return got  # type: ignore[return-value]
    with _lock:
        if kind not in _loaded:
            _loaded[kind] = _load(kind)
    return _loaded[kind]


def load_together(kinds: tuple[str, ...]) -> Optional["KernelSet"]:
    """Several families' kernels as one set (the arena's small and staged collectives), or None unless all load."""
    key = "+".join(kinds)
    got = _loaded.get(key, False)
    if got is not False:
        return got  # type: ignore[return-value]
    sets = [load(k) for k in kinds]
    merged = None
    if all(ks is not None for ks in sets):
        merged = KernelSet(key, None, {"kernels": {}})
        for ks in sets:
            merged.absorb(ks)  # type: ignore[union-attr]
    with _lock:
        _loaded[key] = merged
    return merged


def why(kind: str) -> str:
    """Why ``load(kind)`` gave None ('' if it did not; several kinds: the first reason)."""
    return next((_why[k] for k in kind.split("+") if _why.get(k)), "")


def forget() -> None:
    """Drop what ``load`` found (after a build, or in tests)."""
    with _lock:
        _loaded.clear()
        _why.clear()
    _hash_of.cache_clear()


def _load(kind: str) -> Optional["KernelSet"]:
    if KERNELS.get() == "jit":
        _why[kind] = "PYCOLL_KERNELS=jit"
        return None
    try:
        digest = source_hash(kind)
    except OSError as exc:  # sources not shipped: nothing to match a build against
        _why[kind] = f"kernel sources unreadable ({exc})"
        return None
    name = module_name(kind, digest)
    for folder in build_dirs():
        table = folder / f"{name}.json"
        if not table.is_file():
            continue
        suffixes = importlib.machinery.EXTENSION_SUFFIXES
        binary = next((folder / f"{name}{s}" for s in suffixes if (folder / f"{name}{s}").is_file()), None)
        if binary is None:
            continue
        try:
            spec = importlib.util.spec_from_file_location(name, binary)
            assert spec is not None and spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return KernelSet(kind, module, json.loads(table.read_text()))
        except Exception as exc:  # noqa: BLE001 - a broken build: say so, run on the JIT path
            _why[kind] = f"the build {binary} did not load ({type(exc).__name__}: {exc})"
            log.warning("pycoll: %s", _why[kind])
            return None
    _why[kind] = f"no ahead-of-time build of the {kind} kernels matches the sources (run `pycoll warmup`)"
    if KERNELS.get() == "aot":
        log.warning("pycoll: %s", _why[kind])
    return None


_CHECK = {"C": "{a}.flags.c_contiguous", "F": "{a}.flags.f_contiguous", "A": "True"}


class KernelSet:
    """One family's compiled exports, by kernel name: checked, user-checked and raw views (see the module doc)."""

    def __init__(self, kind: str, module: Any, table: dict[str, Any]) -> None:
        self.kind, self.module = kind, module
        self._raw: dict[tuple[str, Optional[np.dtype]], Callable[..., Any]] = {}
        self._fast: dict[tuple[str, Optional[np.dtype]], Callable[..., Any]] = {}
        self._variants: dict[str, tuple[list[str], list[tuple]]] = {}
        for name, entry in table["kernels"].items():
            variants = []
            for ex in entry["exports"]:
                fn = getattr(module, ex["symbol"])
                dtype = np.dtype(ex["dtype"]) if ex["dtype"] is not None else None
                self._raw[(name, dtype)] = fn
                variants.append((dtype, fn, ex["args"]))
            if len(variants) == 1:
                self._raw[(name, None)] = variants[0][1]
            self._variants[name] = (entry["params"], variants)

    def absorb(self, other: "KernelSet") -> None:
        """Take ``other``'s kernels into this set."""
        self._raw.update(other._raw)
        self._variants.update(other._variants)

    def __getattr__(self, name: str) -> Callable[..., Any]:
        """The checked kernel ``name`` (made at its first use, then kept as an attribute)."""
        try:
            params, variants = self.__dict__["_variants"][name]
        except KeyError:
            raise AttributeError(f"no compiled kernel {name!r} in the {self.__dict__.get('kind')} family") from None
        if len(variants) == 1 and all(spec is None for spec in variants[0][2]):
            checked = variants[0][1]  # scalars only (the point-to-point kernels): the export converts them itself
        else:
            checked = _dispatcher(name, params, variants, every=True)
        setattr(self, name, checked)
        return checked

    def raw(self, name: str, dtype: Any = None) -> Callable[..., Any]:
        """The export itself for ``dtype`` (None: the kernel's only one): no argument is checked."""
        return self._raw[(name, None if dtype is None else np.dtype(dtype))]

    def fast(self, name: str, dtype: Any = None) -> Callable[..., Any]:
        """The export for ``dtype`` (None: chosen by the user arguments' dtype), checking only the user arguments."""
        key = (name, None if dtype is None else np.dtype(dtype))
        fn = self._fast.get(key)
        if fn is None:
            params, variants = self._variants[name]
            chosen = variants if key[1] is None else [v for v in variants if v[0] == key[1]]
            if not chosen:
                raise KeyError(key)
            fn = self._fast[key] = _dispatcher(name, params, chosen, every=False)
        return fn


def _dispatcher(name: str, params: list[str], variants: list[tuple], every: bool) -> Callable[..., Any]:
    """A Python function with the kernel's parameters that checks its array arguments (all, or the users' only) and
    calls the export matching them; TypeError, as Numba's dispatcher raises, when none does.

    Where a parameter's dtype tells the variants apart, a small front picks the variant by it and each variant's
    check is compiled at its first use: compiling them all at once (a dozen dtypes of a kernel with ten arrays) cost
    3 ms inside a program's first call of that kernel."""
    checked = [i for i, p in enumerate(params) if every or p in USER_PARAMS]
    key = None  # the first parameter whose dtype tells the variants apart
    if len(variants) > 1:
        for i in range(len(params)):
            specs = [v[2][i] for v in variants]
            if all(s is not None for s in specs) and len({s["dtype"] for s in specs}) == len(specs):
                key = i
                break
    if key is None:
        return _checking(name, params, variants, checked)
    by_dtype = {np.dtype(v[0]): v for v in variants}
    per: dict[Any, Callable[..., Any]] = {}

    def build(dtype: Any) -> Callable[..., Any]:
        variant = by_dtype.get(dtype) if isinstance(dtype, np.dtype) else None
        fn = per[dtype] = _checking(name, params, [variant] if variant is not None else [], checked)
        return fn

    env: dict[str, Any] = {"_per": per, "_build": build}
    arg = params[key]
    call = ", ".join(params)
    _define(name, env, [f"def {name}({call}):",
                        f"    _dt = getattr({arg}, 'dtype', None)",
                        "    _f = _per.get(_dt)",
                        f"    return (_f if _f is not None else _build(_dt))({call})"])
    return env[name]


def _checking(name: str, params: list[str], variants: list[tuple], checked: list[int]) -> Callable[..., Any]:
    """The function that tries ``variants`` in turn, checking the ``checked`` parameters, and calls the first match."""
    env: dict[str, Any] = {"_nd": np.ndarray, "_TypeError": TypeError, "_name": name}
    lines = [f"def {name}({', '.join(params)}):"]
    for k, (_, fn, args) in enumerate(variants):
        env[f"_fn{k}"] = fn
        conds = []
        for i in checked:
            spec = args[i]
            if spec is None:
                continue
            a = params[i]
            env[f"_dt{k}_{i}"] = np.dtype(spec["dtype"])
            conds.append(f"type({a}) is _nd and {a}.ndim == {spec['ndim']} and {a}.dtype == _dt{k}_{i} and "
                         + _CHECK[spec["layout"]].format(a=a))
        lines.append(f"    if {' and '.join(conds) or 'True'}:")
        lines.append(f"        return _fn{k}({', '.join(params)})")
    lines.append("    raise _TypeError(f'no compiled {_name} for these argument types')")
    _define(name, env, lines)
    return env[name]


def _define(name: str, env: dict[str, Any], lines: list[str]) -> None:
    exec(compile("\n".join(lines), f"<pycoll kernel {name}>", "exec"), env)  # noqa: S102 - generated from our table
