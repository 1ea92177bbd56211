"""Virtual hosts on one machine: network namespaces joined by a bridge in a switch namespace, links shaped by tc."""

from __future__ import annotations

import atexit
import ctypes
import functools
import ipaddress
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import threading
from typing import Any, Callable, Optional, Sequence, TypeVar

from .config import parse_rate

T = TypeVar("T")

CLONE_NEWNET = 0x40000000
NETNS_DIR = "/run/netns"
# Every host's interface has this name (names are per namespace), so tools such as gloo can be told one name.
HOST_IFNAME = "veth0"
NAME_PREFIX = "pycoll"
# tbf settings: the bucket holds BURST_S of traffic at the link rate, at least MIN_BURST bytes (a full-size frame
# always fits) and at most MAX_BURST (two segmentation-offload packets), and a packet may wait at most LATENCY_MS in
# the queue before it is dropped. A NIC sends no faster than its line rate: 1 ms at 10 Gbit/s (1.25 MB) let a 1 MiB
# Allgather between two hosts cross in 413 µs, 0.94x the link's time, and refilled while a composed call's host
# steps left the link idle; with 128 KiB it took 504 µs.
BURST_S = 0.001
MIN_BURST = 32 << 10
MAX_BURST = 128 << 10
LATENCY_MS = 50

_NAME_RE = re.compile(rf"^{NAME_PREFIX}-(\d+)-\d+-(?:h\d+|sw)$")
_counter = itertools.count()


class NetnsError(RuntimeError):
    """A namespace, link or qdisc could not be created."""


def tbf_settings(bits: int) -> tuple[int, int]:
    """(burst bytes, latency ms) used with tbf at this rate."""
    return min(max(int(bits / 8 * BURST_S), MIN_BURST), MAX_BURST), LATENCY_MS


def ip_binary() -> Optional[str]:
    return shutil.which("ip") or next((p for p in ("/usr/sbin/ip", "/sbin/ip") if os.access(p, os.X_OK)), None)


def tc_binary() -> Optional[str]:
    return shutil.which("tc") or next((p for p in ("/usr/sbin/tc", "/sbin/tc") if os.access(p, os.X_OK)), None)


def sent_bytes(ifname: str = HOST_IFNAME) -> Optional[int]:
    """Bytes sent on ``ifname`` in this process's network namespace (frames with their headers, from
    /proc/self/net/dev); None where the namespace has no such interface."""
    try:
        with open("/proc/self/net/dev") as fh:
            for line in fh:
                name, sep, fields = line.partition(":")
                if sep and name.strip() == ifname:
                    return int(fields.split()[8])  # receive has 8 counters, then transmit bytes
    except OSError:
        return None
    return None


def namespace_id() -> int:
    """An identifier of this process's network namespace (its inode): ranks that share it share a virtual host."""
    return os.stat("/proc/self/ns/net").st_ino


def _run(argv: Sequence[str], stdin: Optional[str] = None, timeout: float = 60.0) -> str:
    try:
        res = subprocess.run(list(argv), input=stdin, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise NetnsError(f"{' '.join(argv[:4])} ...: {exc}") from None
    if res.returncode != 0:
        msg = (res.stderr or res.stdout).strip().splitlines()
        raise NetnsError(f"`{' '.join(argv)}` failed: {' | '.join(msg[-3:]) or f'exit {res.returncode}'}")
    return res.stdout


def prerequisite_missing(need_tc: bool) -> Optional[str]:
    """What rules virtual hosts out before anything is tried: no root, no `ip`, no `tc` where links are shaped."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if ip_binary() is None:
        return "the `ip` command (iproute2) is not installed"
    if need_tc and tc_binary() is None:
        return "the `tc` command (iproute2) is not installed"
    return None


@functools.lru_cache(maxsize=2)
def unavailable(need_tc: bool = False) -> Optional[str]:
    """Why virtual hosts cannot be made here (None when they can), found by making a probe namespace with a bridge
    and a veth pair (and a tbf qdisc); tests skip with this reason."""
    missing = prerequisite_missing(need_tc)
    if missing:
        return missing
    ip = ip_binary() or "ip"
    probe = f"{NAME_PREFIX}-{os.getpid()}-{next(_counter)}-sw"
    try:
        _run([ip, "netns", "add", probe])
    except NetnsError as exc:
        return f"cannot create a network namespace: {exc}"
    try:
        _run([ip, "-n", probe, "-batch", "-"], "link add br0 type bridge\nlink add v0 type veth peer name v1\n")
        if need_tc:
            _run([tc_binary() or "tc", "-n", probe, "qdisc", "add", "dev", "v0", "root", "tbf", "rate", "1gbit",
                  "burst", "64kb", "latency", "50ms"])
    except NetnsError as exc:
        return f"cannot create bridge/veth links{' or tbf qdiscs' if need_tc else ''} in a namespace: {exc}"
    finally:
        _delete([probe])
    return None


def list_namespaces() -> list[str]:
    """Names of the named network namespaces (`ip netns list`)."""
    try:
        return sorted(os.listdir(NETNS_DIR))
    except OSError:
        return []


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _delete(names: Sequence[str]) -> None:
    """Delete namespaces by name; missing ones are fine."""
    ip = ip_binary()
    if not names or ip is None:
        return
    subprocess.run([ip, "-force", "-batch", "-"], input="".join(f"netns del {n}\n" for n in names),
                   capture_output=True, text=True, timeout=60)


def cleanup_stale() -> list[str]:
    """Delete namespaces this module made in processes that have since died (e.g. after kill -9)."""
    stale = [n for n in list_namespaces() if (m := _NAME_RE.match(n)) and not _alive(int(m.group(1)))]
    _delete(stale)
    return stale


_libc: Any = None


def _setns(fd: int) -> None:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)  # the process's own symbols hold libc's: no `ldconfig -p`
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


def call_in_netns(name: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Call fn in a new thread that has joined namespace `name`; sockets it creates stay in that namespace.

    The namespace of a thread is its own (setns affects only the caller), so the rest of the process is untouched.
    """
    box: dict[str, Any] = {}

    def body() -> None:
        try:
            fd = os.open(os.path.join(NETNS_DIR, name), os.O_RDONLY | os.O_CLOEXEC)
            try:
                _setns(fd)
            finally:
                os.close(fd)
            box["value"] = fn(*args, **kwargs)
        except BaseException as exc:  # handed to the caller
            box["error"] = exc

    t = threading.Thread(target=body, name=f"netns-{name}", daemon=True)
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


def _used_networks() -> list[ipaddress.IPv4Network]:
    """Every IPv4 prefix routed or assigned in this (the root) namespace, default routes left out."""
    ip = ip_binary() or "ip"
    nets = []
    for argv in ([ip, "-j", "-4", "route", "show", "table", "all"], [ip, "-j", "-4", "addr", "show"]):
        try:
            entries = json.loads(_run(argv) or "[]")
        except (NetnsError, ValueError):
            continue
        for e in entries:
            prefixes = [e.get("dst")] + [f"{a.get('local')}/{a.get('prefixlen')}" for a in e.get("addr_info", [])]
            for p in prefixes:
                if not p or p == "default":
                    continue
                try:
                    nets.append(ipaddress.IPv4Network(p, strict=False))
                except ValueError:
                    pass
    return nets


def pick_subnet(seed: Optional[int] = None) -> ipaddress.IPv4Network:
    """A 10.x.y.0/24 that nothing in the root namespace routes to (x in 100..227, y from the seed)."""
    used = _used_networks()
    start = (os.getpid() if seed is None else seed) % (128 * 256)
    for k in range(128 * 256):
        v = (start + k * 257) % (128 * 256)
        net = ipaddress.IPv4Network(f"10.{100 + v // 256}.{v % 256}.0/24")
        if not any(net.overlaps(u) for u in used):
            return net
    raise NetnsError("no free 10.x.y.0/24 subnet for the virtual hosts")


class VirtualHosts:
    """n_hosts network namespaces, each with lo and one veth (HOST_IFNAME) in a private /24, all plugged
    into a bridge that lives in its own switch namespace; the root namespace gets no links or routes.

    ``rate`` (a tc rate such as "1gbit") shapes every link in both directions with tbf: egress of the host's
    veth (host to switch) and egress of its switch port (switch to host); see tbf_settings for burst and latency.

        with VirtualHosts(2, rate="1gbit") as vh:
            subprocess.run(vh.exec_prefix(1) + ["ping", "-c1", vh.addresses[0]])

    Namespaces are deleted on exit, at interpreter exit, and on SIGTERM/SIGHUP (turned into SystemExit while
    the handler is the default one). Those left by a killed process are removed by the next instance.
    """

    def __init__(self, n_hosts: int, rate: Optional[str] = None, subnet: Optional[str] = None) -> None:
        if n_hosts < 1:
            raise ValueError(f"need at least one host, got {n_hosts}")
        if n_hosts > 250:
            raise ValueError(f"at most 250 hosts fit one /24, got {n_hosts}")
        self.n_hosts = n_hosts
        self.rate_bits = parse_rate(rate) if rate else None
        self.rate = rate
        self._subnet = ipaddress.IPv4Network(subnet) if subnet else None
        prefix = f"{NAME_PREFIX}-{os.getpid()}-{next(_counter)}"
        self.names = [f"{prefix}-h{i}" for i in range(n_hosts)]
        self.switch = f"{prefix}-sw"
        self.ifname = HOST_IFNAME
        self.addresses: list[str] = []
        self.subnet: Optional[ipaddress.IPv4Network] = None
        self._made: list[str] = []
        self._old_handlers: dict[int, Any] = {}

    # ------------------------------------------------------------------ set-up

    def __enter__(self) -> "VirtualHosts":
        self.create()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def create(self) -> "VirtualHosts":
        # No probe namespace first (three more `ip` runs per job): a failure below names its command and cause.
        reason = prerequisite_missing(need_tc=self.rate_bits is not None)
        if reason:
            raise NetnsError(f"cannot make virtual hosts: {reason}")
        cleanup_stale()
        ip = ip_binary() or "ip"
        self.subnet = self._subnet or pick_subnet()
        hosts = list(self.subnet.hosts())
        self.addresses = [str(hosts[i]) for i in range(self.n_hosts)]
        atexit.register(self.close)
        self._catch_signals()
        try:
            every = [self.switch] + self.names
            self._made = every  # a partial failure still deletes whatever exists
            _run([ip, "-batch", "-"], "".join(f"netns add {n}\n" for n in every))
            sw = ["link add br0 type bridge", "link set br0 up", "link set lo up"]
            for i, name in enumerate(self.names):
                sw += [f"link add {HOST_IFNAME} netns {name} type veth peer name p{i}",
                       f"link set p{i} master br0", f"link set p{i} up"]
            _run([ip, "-n", self.switch, "-batch", "-"], "\n".join(sw) + "\n")
            for name, addr in zip(self.names, self.addresses):
                cmds = ["link set lo up", f"addr add {addr}/{self.subnet.prefixlen} dev {HOST_IFNAME}",
                        f"link set {HOST_IFNAME} up"]
                _run([ip, "-n", name, "-batch", "-"], "\n".join(cmds) + "\n")
            if self.rate_bits is not None:
                self._shape()
        except NetnsError as exc:
            self.close()
            raise NetnsError(f"cannot make virtual hosts: {exc}") from None
        except BaseException:
            self.close()
            raise
        return self

    def _shape(self) -> None:
        tc = tc_binary() or "tc"
        burst, latency = tbf_settings(self.rate_bits or 0)
        tbf = f"root tbf rate {self.rate_bits}bit burst {burst} latency {latency}ms"
        for name in self.names:
            _run([tc, "-n", name, "qdisc", "add", "dev", HOST_IFNAME, *tbf.split()])
        _run([tc, "-n", self.switch, "-batch", "-"],
             "".join(f"qdisc add dev p{i} {tbf}\n" for i in range(self.n_hosts)))

    def _catch_signals(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGTERM, signal.SIGHUP):
            if signal.getsignal(sig) == signal.SIG_DFL:
                self._old_handlers[sig] = signal.signal(sig, _exit_on_signal)

    # ------------------------------------------------------------------ use

    def exec_prefix(self, i: int) -> list[str]:
        """argv prefix that runs a command inside host i: ``ip netns exec NAME``."""
        return [ip_binary() or "ip", "netns", "exec", self.names[i]]

    def run(self, i: int, argv: Sequence[str], **kwargs: Any) -> subprocess.CompletedProcess:
        """subprocess.run of argv inside host i."""
        return subprocess.run(self.exec_prefix(i) + list(argv), **kwargs)

    def call(self, i: int, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """fn(*args) in a thread inside host i (e.g. to open a listening socket there)."""
        return call_in_netns(self.names[i], fn, *args, **kwargs)

    def write_launcher(self, path: str) -> str:
        """Write an executable at ``path`` that runs ``PATH [-x] ADDRESS COMMAND...`` inside the host with that
        address: the call an ssh-style launcher makes (MPICH's hydra with ``-launcher ssh -launcher-exec PATH``).
        The command words are joined and run by ``sh -c``, as ssh runs them. Returns ``path``."""
        cases = "".join(f"    {addr}) ns={name} ;;\n" for addr, name in zip(self.addresses, self.names))
        text = (
            "#!/bin/sh\n"
            f"# runs a command on one of {self.describe()}\n"
            '[ "$1" = -x ] && shift\n'
            'addr=$1\n'
            'shift\n'
            'case "$addr" in\n'
            f"{cases}"
            '    *) echo "unknown virtual host $addr" >&2; exit 255 ;;\n'
            "esac\n"
            f'exec {ip_binary() or "ip"} netns exec "$ns" sh -c "$*"\n'
        )
        with open(path, "w") as fh:
            fh.write(text)
        os.chmod(path, 0o755)
        return path

    def qdiscs(self, i: int, switch_side: bool = False) -> str:
        """`tc qdisc show` of host i's interface, or of its port on the switch."""
        ns, dev = (self.switch, f"p{i}") if switch_side else (self.names[i], HOST_IFNAME)
        return _run([tc_binary() or "tc", "-n", ns, "qdisc", "show", "dev", dev])

    def describe(self) -> str:
        rate = f", links {self.rate}" if self.rate else ""
        return f"{self.n_hosts} virtual hosts {', '.join(self.addresses)} on {self.subnet}{rate}"

    # ------------------------------------------------------------------ clean-up

    def close(self) -> None:
        """Delete every namespace this instance made (their links and qdiscs go with them). Safe to repeat."""
        atexit.unregister(self.close)
        made, self._made = self._made, []
        if made:
            _delete(made[1:] + made[:1])  # hosts, then the switch
        for sig, handler in self._old_handlers.items():
            if signal.getsignal(sig) is _exit_on_signal:
                signal.signal(sig, handler)
        self._old_handlers.clear()


def _exit_on_signal(signum: int, _frame: Any) -> None:
    raise SystemExit(128 + signum)
