"""The socket options of the TCP transport's connections: no delay, congestion control, buffer sizes, keepalive."""

from __future__ import annotations

import logging
import socket
from typing import Optional

from ..config import size_param, str_param

log = logging.getLogger("pycoll")

SOCKET_BUFFER = size_param("PYCOLL_SOCKET_BUFFER", 4 << 20, "SO_SNDBUF/SO_RCVBUF of each TCP connection (the kernel may cap it).")
CONGESTION = str_param(
    "PYCOLL_TCP_CONGESTION", "system",
    "Congestion control of each TCP connection: system, the host's (net.ipv4.tcp_congestion_control); auto, cubic "
    "(else reno) where the host's is BBR, else the host's; or names, comma-separated, the first the kernel lets the "
    "socket use. On this VM's BBR, 16 MiB Alltoalls at 2 ranks a host stalled for want of ACKs (auto: 0.6x the "
    "time); cubic was slower for 1 MiB Alltoalls and 32 KiB exchanges at 1 Gbit/s (docs/performance.md).")
_BBR_INSTEAD = ("cubic", "reno")  # what auto puts in BBR's place
_congestion_ok: dict[str, bool] = {}  # algorithm -> whether this process may use it (learnt on the first socket)


# A host that vanishes without closing its sockets (power loss, a cut link) is noticed by the kernel:
# keepalive probes after 3 s idle, 3 more 1 s apart; unacknowledged data for 6 s ends the connection.
_KEEPALIVE = (("TCP_KEEPIDLE", 3), ("TCP_KEEPINTVL", 1), ("TCP_KEEPCNT", 3), ("TCP_USER_TIMEOUT", 6000))


def _algorithm(sock: socket.socket, option: int) -> str:
    return sock.getsockopt(socket.IPPROTO_TCP, option, 16).split(b"\0", 1)[0].decode(errors="replace")


def set_congestion(sock: socket.socket) -> Optional[str]:
    """Give ``sock`` the congestion control PYCOLL_TCP_CONGESTION asks for, the first of its names that the kernel
    allows (an unprivileged process may pick only those in net.ipv4.tcp_allowed_congestion_control); the one set,
    or None where the socket keeps the host's."""
    option = getattr(socket, "TCP_CONGESTION", None)
    setting = CONGESTION.get().strip()
    if option is None or setting == "system":
        return None
    if setting == "auto":
        if not _algorithm(sock, option).startswith("bbr"):
            return None
        names: tuple[str, ...] = _BBR_INSTEAD
    else:
        names = tuple(n.strip() for n in setting.split(","))
    for name in names:
        if not name or _congestion_ok.get(name) is False:
            continue
        try:
            sock.setsockopt(socket.IPPROTO_TCP, option, name.encode())
        except OSError as exc:  # not built into this kernel (ENOENT) or not allowed to this process (EPERM)
            log.debug("TCP congestion control %r unavailable here: %s", name, exc.strerror)
            _congestion_ok[name] = False
            continue
        _congestion_ok[name] = True
        return name
    return None


def tune(sock: socket.socket) -> None:
    """A connection's options, on both ends once it is up: no delay, its congestion control, buffers, keepalive."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    set_congestion(sock)
    size = SOCKET_BUFFER.get()
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, opt, size)
        except OSError:
            pass
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for name, value in _KEEPALIVE:
            if hasattr(socket, name):
                sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
    except OSError:  # liveness then rests on the connection state alone
        pass
