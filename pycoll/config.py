"""Registry of every PYCOLL_* environment knob, declared next to the code that reads it."""

from __future__ import annotations

import contextlib
import os
import re
from dataclasses import dataclass
from typing import Callable, Generic, Iterator, Mapping, Optional, TypeVar

T = TypeVar("T")

_REGISTRY: dict[str, "Param"] = {}
# os.environ's own bytes dict on POSIX: a lookup in it costs a tenth of os.environ.get on the hot path.
_ENV_BYTES = getattr(os.environ, "_data", None) if os.name == "posix" else None


@dataclass(frozen=True)
class Param(Generic[T]):
    """One environment knob: its name, default, parser and a one-line doc."""

    name: str
    default: T
    parse: Callable[[str], T]
    doc: str

    @property
    def env_key(self) -> bytes:
        """The knob's key in ``os.environ``'s own bytes dict (``_ENV_BYTES``), for callers that watch the raw value."""
        return self._key  # type: ignore[attr-defined]

    def __post_init__(self) -> None:
        object.__setattr__(self, "_key", os.fsencode(self.name))
        object.__setattr__(self, "_memo", [None, self.default])  # the last raw value seen and its parse

    def get(self) -> T:
        """The knob's value now (read on every call, so a changed environment takes effect at once)."""
        raw: object = _ENV_BYTES.get(self._key) if _ENV_BYTES is not None else os.environ.get(self.name)  # type: ignore[attr-defined]
        if not raw:
            return self.default
        memo = self._memo  # type: ignore[attr-defined]
        if raw == memo[0]:
            return memo[1]
        text = os.fsdecode(raw) if isinstance(raw, bytes) else str(raw)
        try:
            value = self.parse(text)
        except ValueError as exc:
            raise ValueError(f"{self.name}={text!r} is not valid: {exc}") from None
        memo[0], memo[1] = raw, value
        return value

    def is_set(self) -> bool:
        return bool(_ENV_BYTES.get(self._key) if _ENV_BYTES is not None else os.environ.get(self.name))  # type: ignore


@contextlib.contextmanager
def environ(values: Mapping[str, Optional[str]]) -> Iterator[None]:
    """``os.environ`` with ``values`` set (None: unset) for the body of a ``with``, then as it was before: knobs are
    read at every call, so a block runs under them (PYCOLL_ALGO, PYCOLL_REPRODUCIBLE, a rank's thread share)."""
    if not values:
        yield
        return
    saved = {k: os.environ.get(k) for k in values}
    _set_environ(values)
    try:
        yield
    finally:
        _set_environ(saved)


def _set_environ(values: Mapping[str, Optional[str]]) -> None:
    for k, v in values.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def parse_bool(raw: str) -> bool:
    """A boolean knob's value: 1/true/yes/on or 0/false/no/off, any case; ValueError otherwise."""
    low = raw.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise ValueError("expected 0/1, true/false, yes/no or on/off")


def parse_size(raw: str) -> int:
    """Parse a byte count such as ``65536``, ``64K``, ``1M`` or ``2G``."""
    text = raw.strip().upper().removesuffix("B").removesuffix("I")
    scale = 1
    for suffix, factor in (("K", 1 << 10), ("M", 1 << 20), ("G", 1 << 30)):
        if text.endswith(suffix):
            text, scale = text[:-1], factor
            break
    value = int(float(text) * scale)
    if value < 0:
        raise ValueError("must not be negative")
    return value


_RATE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-z]*)\s*$", re.I)
# tc's rate units (man tc): *bit are bits/s, *bps are bytes/s; "i" forms are powers of 1024.
_RATE_UNITS = {"": 1, "bit": 1, "bps": 8}
for _p, _si in (("k", 1e3), ("m", 1e6), ("g", 1e9), ("t", 1e12)):
    _iec = 1024 ** (" kmgt".index(_p))
    _RATE_UNITS.update({f"{_p}bit": _si, f"{_p}ibit": _iec, f"{_p}bps": 8 * _si, f"{_p}ibps": 8 * _iec})


def parse_rate(text: str) -> int:
    """A tc rate ("1gbit", "100mbit", "125mbps" = bytes/s) in bits per second."""
    m = _RATE_RE.match(str(text))
    unit = m.group(2).lower() if m else ""
    if m is None or unit not in _RATE_UNITS:
        raise ValueError(f"bad link rate {text!r}: use a number with a tc unit such as 100mbit, 1gbit or 10gbit")
    bits = int(float(m.group(1)) * _RATE_UNITS[unit])
    if bits < 8000:
        raise ValueError(f"link rate {text!r} is below 8kbit")
    return bits


def param(name: str, default: T, parse: Callable[[str], T], doc: str) -> Param[T]:
    """Declare a knob; its name must start with PYCOLL_ and be declared once."""
    if not name.startswith("PYCOLL_"):
        raise ValueError(f"knob {name} must start with PYCOLL_")
    if name in _REGISTRY:
        raise ValueError(f"knob {name} declared twice")
    p = Param(name, default, parse, doc)
    _REGISTRY[name] = p
    return p


def bool_param(name: str, default: bool, doc: str) -> Param[bool]:
    return param(name, default, parse_bool, doc)


def size_param(name: str, default: int, doc: str) -> Param[int]:
    return param(name, default, parse_size, doc)


def float_param(name: str, default: float, doc: str) -> Param[float]:
    return param(name, default, float, doc)


def int_param(name: str, default: int, doc: str) -> Param[int]:
    return param(name, default, int, doc)


def str_param(name: str, default: str, doc: str) -> Param[str]:
    return param(name, default, str, doc)


def declared_params() -> list[Param]:
    """Every knob declared so far, by name: those of the modules imported (each module declares its own)."""
    return sorted(_REGISTRY.values(), key=lambda p: p.name)


# every layer that maps shared memory (arenas, rings, the CUDA simulator's IPC, the fake NIC) makes its files here
SHM_DIR = str_param("PYCOLL_SHM_DIR", "/dev/shm", "Directory (a tmpfs) that holds the shared-memory segments while they are set up.")

TIMEOUT = float_param(
    "PYCOLL_TIMEOUT", 300.0,
    "Seconds any wait may go without progress (a step of its call completing) before it raises pycoll.TimeoutError "
    "(per communicator: `comm.timeout`)."
)
DEBUG = str_param("PYCOLL_DEBUG", "WARN", "Log level of the `pycoll` logger: WARN, INFO or DEBUG.")
