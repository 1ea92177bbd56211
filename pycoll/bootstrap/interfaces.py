"""Which local IPv4 address a rank listens on and is reached at: interfaces chosen by name as NCCL_SOCKET_IFNAME
chooses them, and the addresses of named interfaces (Linux ioctl)."""

from __future__ import annotations

import socket
import struct
import sys
from typing import Iterable, Optional

from pycoll.config import str_param
from pycoll.errors import InvalidArgumentError

SOCKET_IFNAME = str_param(
    "PYCOLL_SOCKET_IFNAME",
    "",
    "Network interface whose IPv4 address the TCP transport (and, under mpiexec, rank 0's store) listens on, "
    "as NCCL_SOCKET_IFNAME: `eth0`, `eth,ib` (name prefixes), `=eth0` (exact), `^docker,lo` (all but these).",
)

_SIOCGIFADDR = 0x8915  # Linux: the IPv4 address of an interface


def _ipv4_of(name: str) -> Optional[str]:
    """The IPv4 address of interface ``name``, or None if it has none."""
    import fcntl  # POSIX only; callers check the platform

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            req = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
        except OSError:
            return None
    return socket.inet_ntoa(req[20:24])


def interface_address(spec: Optional[str] = None) -> tuple[str, str]:
    """(interface, IPv4 address) chosen by ``spec`` (default $PYCOLL_SOCKET_IFNAME), NCCL_SOCKET_IFNAME syntax:
    a comma list of name prefixes, ``=`` for exact names, a leading ``^`` to exclude those instead."""
    raw = SOCKET_IFNAME.get() if spec is None else spec
    text = raw.strip()
    exclude = text.startswith("^")
    text = text[1:] if exclude else text
    exact = text.startswith("=")
    text = text[1:] if exact else text
    patterns = [p.strip() for p in text.split(",") if p.strip()]
    if not patterns:
        raise InvalidArgumentError(f"PYCOLL_SOCKET_IFNAME={raw!r} names no interface", op="init")
    if not sys.platform.startswith("linux"):
        raise InvalidArgumentError(
            f"PYCOLL_SOCKET_IFNAME={raw!r} is supported on Linux only; set PYCOLL_SOCKET_ADDR instead", op="init"
        )
    names = [name for _, name in socket.if_nameindex()]
    with_addr = [(name, addr) for name in names for addr in [_ipv4_of(name)] if addr is not None]

    def matches(name: str, pattern: str) -> bool:
        return name == pattern if exact else name.startswith(pattern)

    if exclude:
        chosen = [(n, a) for n, a in with_addr if not any(matches(n, p) for p in patterns)]
        chosen.sort(key=lambda na: _is_loopback(na[1]))  # other interfaces before loopback
    else:  # in the order the patterns are listed
        chosen = [(n, a) for p in patterns for n, a in with_addr if matches(n, p)]
    if not chosen:
        have = ", ".join(f"{n} {a}" for n, a in with_addr) or "none"
        raise InvalidArgumentError(
            f"PYCOLL_SOCKET_IFNAME={raw!r} matches no interface with an IPv4 address (interfaces here: {have})",
            op="init",
        )
    return chosen[0]


def ipv4_addresses(names: Iterable[str]) -> dict[str, str]:
    """Interface name -> IPv4 address, for those of ``names`` that have one (Linux only: elsewhere, none)."""
    if not sys.platform.startswith("linux"):
        return {}
    return {name: addr for name in names for addr in [_ipv4_of(name)] if addr is not None}


def _is_loopback(addr: str) -> bool:
    import ipaddress

    try:
        return ipaddress.ip_address(addr.split("%")[0]).is_loopback
    except ValueError:
        return False
