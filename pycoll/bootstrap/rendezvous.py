"""The rendezvous: this process's rank and size from its launcher, and one store that connects all ranks.

Detection order (the first that matches wins):

a. ``pycoll run`` sets ``PYCOLL_RANK``, ``PYCOLL_SIZE``, ``PYCOLL_LOCAL_RANK``, ``PYCOLL_LOCAL_SIZE``
   and ``PYCOLL_STORE_ADDR=host:port`` (the launcher's TCP store).
b. torchrun / env:// : ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` (optionally
   ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``). With torch installed the store is torch's TCPStore, created
   as torch's env:// rendezvous does (so it is the torchrun agent's store when
   ``TORCHELASTIC_USE_AGENT_STORE=True``); without torch rank 0 hosts a pycoll TCPStoreServer.
c. srun: ``SLURM_PROCID`` and ``SLURM_NTASKS`` (``SLURM_LOCALID``, ``SLURM_NODEID``,
   ``SLURM_STEP_TASKS_PER_NODE``/``SLURM_TASKS_PER_NODE`` for the local rank and size). Rank 0 hosts
   the store on ``PYCOLL_MASTER_ADDR``:``PYCOLL_MASTER_PORT`` (or ``MASTER_ADDR``:``MASTER_PORT``).
d. mpiexec (MPICH/Hydra ``PMI_RANK``, Open MPI ``OMPI_COMM_WORLD_RANK``, PMIx ``PMIX_RANK``), with
   mpi4py: rank 0 hosts the store on ``PYCOLL_STORE_HOST`` and broadcasts its address over MPI.
e. otherwise a singleton: rank 0 of 1, no store.

The job token (docs/security.md): every connection to a pycoll store or TCP listener proves it knows it.
It is ``PYCOLL_JOB_TOKEN`` when set. Otherwise ``pycoll run`` generates it and passes it to the ranks;
under mpiexec rank 0 generates it and broadcasts it over MPI; on a torch store rank 0 generates it and
publishes it there (torch's store is then the boundary); srun and env:// without torch need it exported.
"""

from __future__ import annotations

import atexit
import os
import re
import socket
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional

from pycoll.config import int_param, str_param
from pycoll.errors import InvalidArgumentError, PeerFailureError, TimeoutError

from .interfaces import SOCKET_IFNAME, _is_loopback, interface_address
from .store import JOB_TOKEN, Store, ascii_host, new_token
from .store_client import TCPStore
from .store_server import TCPStoreServer
from .torch_store import TorchStore

STORE_HOST = str_param(
    "PYCOLL_STORE_HOST",
    "",
    "Under mpiexec: the address rank 0's store listens on (default: 127.0.0.1 when all ranks share a host, "
    "else the address of rank 0's hostname).",
)
MASTER_ADDR = str_param(
    "PYCOLL_MASTER_ADDR", "", "Under srun: the host of rank 0, where the start-up store listens (falls back to MASTER_ADDR)."
)
MASTER_PORT = int_param(
    "PYCOLL_MASTER_PORT", 0, "Under srun: the port of the start-up store on rank 0 (falls back to MASTER_PORT)."
)

# Seconds a rank that hosts the store keeps serving at exit, until the other ranks have disconnected:
# without it the last requests of a final barrier can find the server gone.
_LINGER_S = 5.0

_MPI_VARS = (("PMI_RANK", "PMI_SIZE"), ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"), ("PMIX_RANK", None))


@dataclass
class BootstrapInfo:
    """What the launcher told this process, and the store all ranks share."""

    rank: int
    size: int
    store: Optional[Store]  # None only for a singleton (size 1, no launcher)
    job_id: str  # unique per job, identical on all ranks
    launcher: str  # "pycoll", "torchrun", "env", "srun", "mpiexec" or "singleton"
    local_rank: Optional[int]
    local_size: Optional[int]
    store_host: str  # local address used to reach the store ('' for a singleton)
    server: Optional[TCPStoreServer] = field(default=None, repr=False, compare=False)  # hosted by rank 0
    token: str = field(default="", repr=False, compare=False)  # the job token ('' for a singleton)

    def __post_init__(self) -> None:
        if self.token:
            _JOB_TOKENS[self.job_id] = self.token
        # At exit, clients hang up first, so that a hosting rank's linger ends early.
        if self.store is not None or self.server is not None:
            atexit.register(self.close)

    def close(self, linger: float = _LINGER_S) -> None:
        """Drop the store connection; a hosting rank then serves until the others have disconnected
        (at most ``linger`` s) and stops its server. Runs by itself at exit; safe to call twice."""
        if self.store is not None:
            self.store.close()
        atexit.unregister(self.close)
        server, self.server = self.server, None
        if server is not None:
            server.wait_idle(linger)
            server.stop()


# job id -> job token, for the transports (they are handed the job id only).
_JOB_TOKENS: dict[str, str] = {}


def job_token(job_id: str) -> str:
    """The token of the job ``job_id`` bootstrapped in this process, else $PYCOLL_JOB_TOKEN, else ''."""
    return _JOB_TOKENS.get(job_id) or JOB_TOKEN.get()


def _required_token(launcher: str, how: str) -> str:
    token = JOB_TOKEN.get()
    if not token:
        raise InvalidArgumentError(
            f"under {launcher} pycoll needs a job token shared by all ranks and secret to others: {how}",
            op="bootstrap",
        )
    return token


_TOKEN_HINT = (
    "before starting the job, export PYCOLL_JOB_TOKEN=$(python -c 'import secrets; print(secrets.token_hex(32))') "
    "(see docs/security.md)"
)


def _token_through_store(store: Store, rank: int, timeout: float) -> str:
    """$PYCOLL_JOB_TOKEN, else rank 0 makes one and the others read it from ``store`` (a torch store: its
    own access control is then the boundary)."""
    if JOB_TOKEN.get():
        return JOB_TOKEN.get()
    return _from_rank0(store, rank, "job_token", new_token, timeout)


def _from_rank0(store: Store, rank: int, key: str, make: Callable[[], str], timeout: float) -> str:
    """Rank 0 makes the value (``make()``) and publishes it under ``key``; the other ranks read it."""
    if rank == 0:
        value = make()
        store.set(key, value.encode())
        return value
    try:
        return store.get(key, timeout).decode()
    except TimeoutError:
        raise TimeoutError(
            f"waited {timeout:.1f} s for key {key!r} (rank 0 had not published it)", op="bootstrap", peers=[0]
        ) from None


def _has(env: Mapping[str, str], *names: str) -> bool:
    return all(env.get(n, "") != "" for n in names)


def detect_launcher(environ: Optional[Mapping[str, str]] = None) -> str:
    """The launcher bootstrap() would use for this environment, without connecting to anything."""
    env = os.environ if environ is None else environ
    if _has(env, "PYCOLL_RANK"):
        return "pycoll"
    if _has(env, "RANK", "WORLD_SIZE"):
        return "torchrun" if _has(env, "TORCHELASTIC_RUN_ID") else "env"
    if _has(env, "SLURM_PROCID", "SLURM_NTASKS"):
        return "srun"
    if any(_has(env, r) for r, _ in _MPI_VARS):
        return "mpiexec"
    return "singleton"


def _int_env(name: str, env: Mapping[str, str] = os.environ) -> int:
    raw = env.get(name, "")
    try:
        return int(raw)
    except ValueError:
        raise InvalidArgumentError(f"{name}={raw!r} is not an integer", op="bootstrap") from None


def _opt_int_env(name: str) -> Optional[int]:
    return _int_env(name) if os.environ.get(name, "") != "" else None


def _check_rank(rank: int, size: int, source: str) -> None:
    if size < 1 or not 0 <= rank < size:
        raise InvalidArgumentError(f"{source} gives rank {rank} of size {size}", op="bootstrap")


def _split_addr(addr: str, var: str) -> tuple[str, int]:
    """Parse ``host:port`` or ``[v6addr]:port``."""
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise InvalidArgumentError(f"{var}={addr!r} is not host:port", op="bootstrap")
    return host.strip("[]"), int(port)


def _route_address(host: str, port: int) -> str:
    """The local IP the kernel would use to reach host (a UDP connect sends nothing)."""
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(ascii_host(host), port or 1, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(sockaddr)
            return str(s.getsockname()[0])
    except OSError:
        return ""


def _uuid_hex() -> str:
    """``uuid.uuid4().hex`` without importing uuid (which pulls in platform): random, version 4, RFC 4122 variant."""
    raw = bytearray(os.urandom(16))
    raw[6] = (raw[6] & 0x0F) | 0x40
    raw[8] = (raw[8] & 0x3F) | 0x80
    return raw.hex()


def _new_job_id(store: Store, rank: int, timeout: float) -> str:
    """Rank 0 makes the job id; the others read it from the store."""
    return _from_rank0(store, rank, "job_id", _uuid_hex, timeout)


def _connect_client(host: str, port: int, timeout: float, token: str) -> TCPStore:
    return TCPStore(host, port, connect_timeout=timeout, token=token)


def _host_and_connect(
    host: str, port: int, rank: int, timeout: float, token: str
) -> tuple[TCPStore, Optional[TCPStoreServer]]:
    """Rank 0 listens on host:port; every rank (rank 0 too) connects as a client."""
    server = None
    if rank == 0:
        server = TCPStoreServer(host, port, token=token)
        server.start()
    try:
        return _connect_client(host, port, timeout, token), server
    except BaseException:
        if server is not None:
            server.stop()
        raise


def _from_pycoll(timeout: float) -> BootstrapInfo:
    for name in ("PYCOLL_SIZE", "PYCOLL_STORE_ADDR"):
        if os.environ.get(name, "") == "":
            raise InvalidArgumentError(f"PYCOLL_RANK is set but {name} is not: start with `pycoll run`", op="bootstrap")
    rank, size = _int_env("PYCOLL_RANK"), _int_env("PYCOLL_SIZE")
    _check_rank(rank, size, "pycoll run")
    host, port = _split_addr(os.environ["PYCOLL_STORE_ADDR"], "PYCOLL_STORE_ADDR")
    token = _required_token("`pycoll run`", "PYCOLL_RANK is set but PYCOLL_JOB_TOKEN is not (start with `pycoll run`)")
    store = _connect_client(host, port, timeout, token)
    return BootstrapInfo(
        rank=rank,
        size=size,
        store=store,
        job_id=_new_job_id(store, rank, timeout),
        launcher="pycoll",
        local_rank=_opt_int_env("PYCOLL_LOCAL_RANK"),
        local_size=_opt_int_env("PYCOLL_LOCAL_SIZE"),
        store_host=store.local_address,
        token=token,
    )


def _torch_available() -> bool:
    import importlib.util

    try:
        if importlib.util.find_spec("torch") is None:
            return False
        import torch.distributed  # noqa: F401

        return bool(torch.distributed.is_available())
    except (ImportError, ValueError):
        return False


def _from_env(timeout: float) -> BootstrapInfo:
    missing = [n for n in ("MASTER_ADDR", "MASTER_PORT") if os.environ.get(n, "") == ""]
    if missing:
        raise InvalidArgumentError(
            f"RANK and WORLD_SIZE are set but {' and '.join(missing)} are not (env:// needs all four)", op="bootstrap"
        )
    rank, size = _int_env("RANK"), _int_env("WORLD_SIZE")
    _check_rank(rank, size, "RANK/WORLD_SIZE")
    host, port = os.environ["MASTER_ADDR"], _int_env("MASTER_PORT")
    launcher = "torchrun" if os.environ.get("TORCHELASTIC_RUN_ID") else "env"
    server = None
    if _torch_available():
        # Exactly like torch's env:// rendezvous: under the agent store every rank is a client.
        is_master = rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
        # A restarted torchrun worker group may meet the same agent store again: key by attempt.
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "")
        prefix = f"pycoll/attempt_{attempt}/" if attempt else "pycoll/"
        store: Store = TorchStore.connect(
            host, port, world_size=size, is_master=is_master, timeout=timeout, prefix=prefix
        )
        store_host = _route_address(host, port)
        token = _token_through_store(store, rank, timeout)
    else:
        token = _required_token("env:// without torch", _TOKEN_HINT)
        store, server = _host_and_connect(host, port, rank, timeout, token)
        store_host = store.local_address
    return BootstrapInfo(
        rank=rank,
        size=size,
        store=store,
        job_id=_new_job_id(store, rank, timeout),
        launcher=launcher,
        local_rank=_opt_int_env("LOCAL_RANK"),
        local_size=_opt_int_env("LOCAL_WORLD_SIZE"),
        store_host=store_host,
        server=server,
        token=token,
    )


def slurm_tasks_on_node(tasks_per_node: str, node_id: int) -> Optional[int]:
    """Tasks on node ``node_id`` from SLURM's compact form, e.g. ``"2(x3),1"`` -> [2, 2, 2, 1]."""
    counts: list[int] = []
    for part in tasks_per_node.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if m is None:
            return None
        counts.extend([int(m.group(1))] * int(m.group(2) or 1))
    return counts[node_id] if 0 <= node_id < len(counts) else None


def _slurm_local_size() -> Optional[int]:
    node_id = int(os.environ.get("SLURM_NODEID", "0") or 0)
    for name in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
        if os.environ.get(name):
            found = slurm_tasks_on_node(os.environ[name], node_id)
            if found is not None:
                return found
    per_node = os.environ.get("SLURM_NTASKS_PER_NODE", "")
    return int(per_node) if per_node.isdigit() else None


def _from_srun(timeout: float) -> BootstrapInfo:
    rank, size = _int_env("SLURM_PROCID"), _int_env("SLURM_NTASKS")
    _check_rank(rank, size, "SLURM_PROCID/SLURM_NTASKS")
    host = MASTER_ADDR.get() or os.environ.get("MASTER_ADDR", "")
    port = MASTER_PORT.get() or (_int_env("MASTER_PORT") if os.environ.get("MASTER_PORT") else 0)
    if not host or not port:
        raise InvalidArgumentError(
            "under srun pycoll needs the address of rank 0's start-up store: before srun, "
            'export PYCOLL_MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1) '
            "and PYCOLL_MASTER_PORT=<a free port, e.g. 29500> (or MASTER_ADDR and MASTER_PORT)",
            op="bootstrap",
        )
    token = _required_token("srun", _TOKEN_HINT)
    store, server = _host_and_connect(host, port, rank, timeout, token)
    return BootstrapInfo(
        rank=rank,
        size=size,
        store=store,
        job_id=_new_job_id(store, rank, timeout),
        launcher="srun",
        local_rank=_opt_int_env("SLURM_LOCALID"),
        local_size=_slurm_local_size(),
        store_host=store.local_address,
        server=server,
        token=token,
    )


def _mpi_store_host(hostnames: list[str]) -> str:
    """The address rank 0's store should listen on so that every rank can reach it."""
    if STORE_HOST.get():
        return STORE_HOST.get()
    if SOCKET_IFNAME.get():
        return interface_address()[1]
    me = hostnames[0]
    if all(h == me for h in hostnames):
        return "127.0.0.1"
    try:
        addrs = [str(info[4][0]) for info in socket.getaddrinfo(ascii_host(me), None, type=socket.SOCK_STREAM)]
    except OSError:
        addrs = []
    for addr in addrs:
        if not _is_loopback(addr):
            return addr
    # The hostname maps to loopback (e.g. Debian's 127.0.1.1): use the interface routed to a peer host.
    other = next(h for h in hostnames if h != me)
    routed = _route_address(other, 1)
    if routed and not _is_loopback(routed):
        return routed
    raise InvalidArgumentError(
        f"the job spans hosts but {me!r} resolves only to loopback; export PYCOLL_STORE_HOST=<an address of "
        "rank 0's host that the other hosts can reach>",
        op="bootstrap",
    )


def _from_mpiexec(timeout: float) -> BootstrapInfo:
    import importlib.util

    if importlib.util.find_spec("mpi4py") is None:
        raise InvalidArgumentError(
            "started by mpiexec but mpi4py is not installed: pip install 'pycoll[mpi]' (or mpi4py)", op="bootstrap"
        )
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    hostnames: list[str] = comm.allgather(socket.gethostname())
    server = None
    if rank == 0:
        try:
            # The token travels over MPI, which only the job's ranks take part in.
            server = TCPStoreServer(_mpi_store_host(hostnames), 0, token=JOB_TOKEN.get() or new_token())
            msg: tuple = ("ok",) + server.start() + (server.token,)
        except Exception as exc:  # tell the others before raising, so that nobody hangs in bcast
            msg = ("error", f"{type(exc).__name__}: {exc}")
            comm.bcast(msg, root=0)
            raise
    else:
        msg = None
    msg = comm.bcast(msg, root=0)
    if msg[0] != "ok":
        raise PeerFailureError(f"rank 0 could not start the store: {msg[1]}", op="bootstrap", peers=[0])
    token = msg[3]
    try:
        store = _connect_client(msg[1], msg[2], timeout, token)
    except BaseException:
        if server is not None:
            server.stop()
        raise
    mine = hostnames[rank]
    return BootstrapInfo(
        rank=rank,
        size=size,
        store=store,
        job_id=_new_job_id(store, rank, timeout),
        launcher="mpiexec",
        local_rank=sum(1 for h in hostnames[:rank] if h == mine),
        local_size=sum(1 for h in hostnames if h == mine),
        store_host=store.local_address,
        server=server,
        token=token,
    )


def from_torch_store(store: Any, rank: int, size: int, timeout: float) -> BootstrapInfo:
    """Bootstrap on a store that ``torch.distributed`` already made (the torch backend's start-up): no launcher
    detection, the ranks are torch's, and the local address is the one that reaches the store's host."""
    under = store
    while hasattr(under, "underlying_store"):  # PrefixStore
        under = under.underlying_store
    host, port = getattr(under, "host", None), getattr(under, "port", None)
    if not host:
        host, port = os.environ.get("MASTER_ADDR", ""), int(os.environ.get("MASTER_PORT") or 0)
    wrapped = TorchStore(store, prefix="pycoll/")
    token = _token_through_store(wrapped, rank, timeout)
    return BootstrapInfo(
        rank=rank,
        size=size,
        store=wrapped,
        job_id=_new_job_id(wrapped, rank, timeout),
        launcher=detect_launcher() if detect_launcher() != "singleton" else "torch",
        local_rank=_opt_int_env("LOCAL_RANK"),
        local_size=_opt_int_env("LOCAL_WORLD_SIZE"),
        store_host=_route_address(host, port or 1) if host else "",
        token=token,
    )


def bootstrap(timeout: float) -> BootstrapInfo:
    """Detect the launcher, connect to the job's store and agree on a job id; every wait uses ``timeout``."""
    launcher = detect_launcher()
    if launcher == "pycoll":
        return _from_pycoll(timeout)
    if launcher in ("torchrun", "env"):
        return _from_env(timeout)
    if launcher == "srun":
        return _from_srun(timeout)
    if launcher == "mpiexec":
        return _from_mpiexec(timeout)
    return BootstrapInfo(
        rank=0,
        size=1,
        store=None,
        job_id=_uuid_hex(),
        launcher="singleton",
        local_rank=0,
        local_size=1,
        store_host="",
    )


def publish_all(info: BootstrapInfo, key: str, value: bytes, timeout: float) -> list[bytes]:
    """Allgather through the store: set ``key/rank`` and return every rank's value in rank order.

    Use a distinct key per exchange (values stay in the store).
    """
    if info.store is None:
        return [bytes(value)]
    store = info.store
    keys = [f"{key}/{r}" for r in range(info.size)]
    store.set(keys[info.rank], bytes(value))
    deadline = time.monotonic() + timeout
    values: list[bytes] = []
    for r, k in enumerate(keys):
        try:
            values.append(store.get(k, max(deadline - time.monotonic(), 0.0)))
        except TimeoutError:
            missing = []
            for r2 in range(r, info.size):
                try:
                    present = store.check([keys[r2]])
                except Exception:
                    present = False
                if not present:
                    missing.append(r2)
            raise TimeoutError(
                f"waited {timeout:.1f} s for key {k!r} (ranks that had not published: "
                f"{', '.join(map(str, missing))})",
                op="bootstrap",
                rank=info.rank,
                peers=missing,
            ) from None
    return values
