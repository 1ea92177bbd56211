"""The thin pyverbs layer of the RDMA transport: devices and ports, GID choice, RC queue pairs, MRs, completions.

pyverbs is imported on first use, never at module import: from the interpreter's own path, else the
distribution's package (Debian/Ubuntu ``python3-pyverbs``) loaded alone from PYCOLL_IB_PYVERBS_PATH, so a
virtual environment can use it without seeing the rest of the system's packages. Anything that goes wrong
before a queue pair exists is a ``NoRdma`` with the reason, and the transport falls back to TCP.
"""

from __future__ import annotations

import ctypes
import importlib.util
import ipaddress
import logging
import os
import random
import sys
from typing import Any, Optional

from ..config import int_param, str_param
from .rdma_memory import Region
from .rdma_proto import Completion, Endpoint, Nic, NoRdma, PortInfo, Provider, fabric_of, pick_gid

log = logging.getLogger("pycoll")

PYVERBS_PATH = str_param(
    "PYCOLL_IB_PYVERBS_PATH",
    "/usr/lib/python3/dist-packages",
    "Where the distribution's pyverbs (python3-pyverbs) lives; used when the interpreter cannot import pyverbs itself "
    "(a virtual environment). Only the pyverbs package is loaded from there.",
)
GID_INDEX = int_param("PYCOLL_IB_GID_INDEX", -1, "GID index of RoCE ports; -1: RoCE v2 with an IPv4 address if there is one, else the lowest.")
IB_TIMEOUT = int_param("PYCOLL_IB_TIMEOUT", 14, "Queue-pair ACK timeout exponent (4.096 us * 2^n): how soon a lost peer's writes fail, times the retries.")
IB_RETRY_CNT = int_param("PYCOLL_IB_RETRY_CNT", 7, "Transport retries before a write to an unresponsive peer fails (0-7).")

SYSFS_IB = "/sys/class/infiniband"
_ACCESS_RECV = 1 | 2  # IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE


def load_pyverbs() -> Any:
    """The pyverbs package (its device, enums, ... submodules import after this); raises NoRdma if unavailable."""
    mod = sys.modules.get("pyverbs")
    if mod is not None:
        return mod
    try:
        import pyverbs  # noqa: F401

        return sys.modules["pyverbs"]
    except ImportError:
        pass
    where = os.path.join(PYVERBS_PATH.get(), "pyverbs")
    init = os.path.join(where, "__init__.py")
    if not os.path.isdir(where):
        raise NoRdma("pyverbs is not installed (Debian/Ubuntu: apt-get install python3-pyverbs; see the README)")
    spec = importlib.util.spec_from_file_location("pyverbs", init if os.path.isfile(init) else None, submodule_search_locations=[where])
    if spec is None:
        raise NoRdma(f"pyverbs at {where} cannot be loaded")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["pyverbs"] = mod
    try:
        if spec.loader is not None and os.path.isfile(init):
            spec.loader.exec_module(mod)
        import pyverbs.device  # noqa: F401  (the compiled part: fails here if built for another Python)
    except Exception as exc:  # ImportError, or an undefined symbol from a libibverbs of another version
        for name in [n for n in sys.modules if n == "pyverbs" or n.startswith("pyverbs.")]:
            del sys.modules[name]
        raise NoRdma(f"pyverbs at {where} does not import into Python {sys.version.split()[0]}: {type(exc).__name__}: {exc}") from None
    return mod


def _sysfs(*parts: object) -> str:
    try:
        with open(os.path.join(SYSFS_IB, *map(str, parts))) as f:
            return f.read().strip()
    except OSError:
        return ""


def _gid_text(gid: Any) -> str:
    """A GID as sysfs writes it: eight groups of four hex digits."""
    raw = str(gid).strip().lower()
    try:
        return ipaddress.IPv6Address(raw).exploded
    except ValueError:
        return raw


def sysfs_devices() -> list[str]:
    """The RDMA devices the kernel lists (libibverbs enumerates the same directory's kin)."""
    try:
        return sorted(os.listdir(SYSFS_IB))
    except OSError:
        return []


class VerbsProvider(Provider):
    """Real devices through pyverbs. With ``sysfs_first``, a host whose kernel lists no RDMA device is told so
    without importing pyverbs at all (every rank of every job asks)."""

    name = "verbs"

    def __init__(self, sysfs_first: bool = True) -> None:
        self.sysfs_first = sysfs_first

    def ports(self) -> list[PortInfo]:
        if self.sysfs_first and not sysfs_devices():
            raise NoRdma(f"no RDMA device ({SYSFS_IB} is empty or missing)")
        load_pyverbs()
        import pyverbs.device as d
        import pyverbs.enums as e

        try:
            devices = d.get_device_list()
        except Exception as exc:  # with no device pyverbs raises rather than returning []
            raise NoRdma(f"no RDMA device (get_device_list: {exc})") from None
        if not devices:
            raise NoRdma("no RDMA device (get_device_list is empty)")
        out: list[PortInfo] = []
        for dev in devices:
            name = dev.name.decode() if isinstance(dev.name, bytes) else str(dev.name)
            try:
                ctx = d.Context(name=name)
            except Exception as exc:
                log.info("RDMA device %s cannot be opened: %s", name, exc)
                continue
            try:
                for port in range(1, ctx.query_device().phys_port_cnt + 1):
                    pa = ctx.query_port(port)
                    eth = pa.link_layer == e.IBV_LINK_LAYER_ETHERNET
                    entries = []
                    for i in range(pa.gid_tbl_len if eth else 1):
                        text = _sysfs(name, "ports", port, "gids", i) or (_gid_text(ctx.query_gid(port, i)) if not eth else "")
                        kind = _sysfs(name, "ports", port, "gid_attrs", "types", i) if eth else "IB"
                        entries.append((i, text, kind))
                    index = pick_gid(entries, GID_INDEX.get() if eth else -1)
                    gid = next((g for i, g, _ in entries if i == index), "")
                    layer = "Ethernet" if eth else "InfiniBand"
                    out.append(PortInfo(name, port, pa.state == e.IBV_PORT_ACTIVE and index >= 0, layer, pa.lid, gid, index, fabric_of(layer, gid)))
            except Exception as exc:
                log.info("RDMA device %s: ports cannot be queried: %s", name, exc)
            finally:
                ctx.close()
        return out

    def open(self, port: PortInfo, job_id: str) -> Nic:
        return VerbsNic(port)


class VerbsNic(Nic):
    """A device context and protection domain on one port."""

    def __init__(self, port: PortInfo) -> None:
        import pyverbs.device as d
        import pyverbs.pd as pd

        self.port = port
        self.ctx = d.Context(name=port.device)
        try:
            self.pd = pd.PD(self.ctx)
            self.mtu = self.ctx.query_port(port.port).active_mtu
        except Exception:
            self.ctx.close()
            raise
        self._scratch = self.alloc(64)  # the one SGE every receive needs (writes with immediate never fill it)
        self._endpoints: list[VerbsEndpoint] = []
        self.closed = False

    def alloc(self, length: int) -> Region:
        from pyverbs.mr import MR

        mr = MR(self.pd, length, _ACCESS_RECV)
        view = memoryview((ctypes.c_char * length).from_address(mr.buf)).cast("B")
        return Region(mr.buf, length, mr.lkey, mr.rkey, view, mr)

    def register(self, addr: int, length: int) -> Region:
        from pyverbs.mr import MR

        mr = MR(self.pd, length, 0, address=addr)  # local read: the source of writes
        return Region(addr, length, mr.lkey, mr.rkey, None, mr)

    def register_dmabuf(self, fd: int, offset: int, length: int) -> Region:
        """Register GPU memory exported as a dma-buf ``fd`` (``DmaBufMR``; its I/O virtual address is ``offset``, as
        pyverbs registers it). Raises NotImplementedError where this pyverbs lacks it: the caller then stages
        through host memory."""
        try:
            from pyverbs.mr import DmaBufMR
        except ImportError:
            raise NotImplementedError("this pyverbs has no DmaBufMR") from None
        try:
            mr = DmaBufMR(self.pd, length, _ACCESS_RECV, dmabuf=fd, offset=offset)
        except TypeError as exc:  # a signature other than rdma-core 44's
            raise NotImplementedError(f"DmaBufMR signature not supported: {exc}") from None
        return Region(offset, length, mr.lkey, mr.rkey, None, mr)

    def deregister(self, region: Region) -> None:
        if region.view is not None:
            region.view.release()
        region.handle.close()

    def endpoint(self, send_depth: int, recv_depth: int) -> Endpoint:
        ep = VerbsEndpoint(self, send_depth, recv_depth)
        self._endpoints.append(ep)
        return ep

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for ep in self._endpoints:
            ep.close()
        self.deregister(self._scratch)
        self.pd.close()
        self.ctx.close()


_WC_STATUS = {
    1: "local length error", 2: "local QP operation error", 4: "local protection error", 5: "work request flushed",
    9: "remote invalid request", 10: "remote access error", 11: "remote operation error",
    12: "transport retry counter exceeded", 13: "RNR retry counter exceeded",
}


def rts_attributes(port: PortInfo, mtu: int, psn: int, remote: dict) -> Any:
    """The QPAttr that takes an RC queue pair on ``port`` to RTR and RTS towards ``remote`` (its ``address()``)."""
    from pyverbs.addr import GID, AHAttr, GlobalRoute
    from pyverbs.qp import QPAttr

    attr = QPAttr(port_num=port.port)
    attr.qp_access_flags = _ACCESS_RECV
    attr.path_mtu = min(mtu, int(remote["mtu"]))
    attr.dest_qp_num = int(remote["qpn"])
    attr.rq_psn = int(remote["psn"])
    attr.sq_psn = psn
    attr.max_dest_rd_atomic = attr.max_rd_atomic = 1
    attr.min_rnr_timer = 12
    attr.timeout = IB_TIMEOUT.get()
    attr.retry_cnt = IB_RETRY_CNT.get()
    attr.rnr_retry = 7  # credits keep receives posted; 7 retries an RNR forever rather than failing
    if port.link_layer == "Ethernet":  # RoCE: routed by GID
        gr = GlobalRoute(dgid=GID(remote["gid"]), sgid_index=port.gid_index, hop_limit=64)
        attr.ah_attr = AHAttr(port_num=port.port, is_global=1, gr=gr)
    else:  # InfiniBand, one subnet: routed by LID
        attr.ah_attr = AHAttr(port_num=port.port, dlid=int(remote["lid"]))
    return attr


def write_request(wr_id: int, src: Region, offset: int, length: int, raddr: int, rkey: int, imm: Optional[int]) -> Any:
    """A signaled RDMA WRITE (WITH IMMEDIATE when ``imm`` is given) of ``length`` bytes at ``src.addr + offset``."""
    import pyverbs.enums as e
    from pyverbs.wr import SGE, SendWR

    op = e.IBV_WR_RDMA_WRITE if imm is None else e.IBV_WR_RDMA_WRITE_WITH_IMM
    wr = SendWR(wr_id=wr_id, opcode=op, num_sge=1, sg=[SGE(src.addr + offset, length, src.lkey)],
                imm_data=imm or 0, send_flags=e.IBV_SEND_SIGNALED)
    wr.set_wr_rdma(rkey, raddr)
    return wr


def completion(wc: Any) -> Completion:
    """A pyverbs WC as a Completion: arrived writes with immediate are ``recv``, failures carry their status."""
    import pyverbs.enums as e

    ok = wc.status == e.IBV_WC_SUCCESS
    recv = wc.opcode == e.IBV_WC_RECV_RDMA_WITH_IMM
    status = "" if ok else _WC_STATUS.get(int(wc.status), f"completion status {wc.status}")
    return Completion(wc.wr_id, ok, recv, wc.imm_data if recv else 0, wc.byte_len, status)


class VerbsEndpoint(Endpoint):
    """One RC queue pair and its completion queue."""

    def __init__(self, nic: VerbsNic, send_depth: int, recv_depth: int) -> None:
        import pyverbs.enums as e
        from pyverbs.cq import CQ
        from pyverbs.qp import QP, QPAttr, QPCap, QPInitAttr
        from pyverbs.wr import SGE, RecvWR

        self.nic = nic
        self.e = e
        self.cq = CQ(nic.ctx, send_depth + recv_depth + 8, None, None, 0)
        cap = QPCap(max_send_wr=send_depth, max_recv_wr=recv_depth, max_send_sge=1, max_recv_sge=1)
        init = QPInitAttr(qp_type=e.IBV_QPT_RC, scq=self.cq, rcq=self.cq, cap=cap)
        attr = QPAttr(port_num=nic.port.port)
        attr.qp_access_flags = _ACCESS_RECV
        try:
            self.qp = QP(nic.pd, init, attr)  # RESET -> INIT
        except Exception:
            self.cq.close()
            raise
        self.psn = random.getrandbits(24)
        s = nic._scratch
        self._recv_wr = RecvWR(wr_id=0, num_sge=1, sg=[SGE(s.addr, s.length, s.lkey)])
        self.closed = False

    def address(self) -> dict:
        p = self.nic.port
        return {"qpn": self.qp.qp_num, "psn": self.psn, "lid": p.lid, "gid": p.gid, "mtu": int(self.nic.mtu), "link": p.link_layer}

    def connect(self, remote: dict) -> None:
        attr = rts_attributes(self.nic.port, int(self.nic.mtu), self.psn, remote)
        self.qp.to_rtr(attr)
        self.qp.to_rts(attr)

    def post_write(self, wr_id: int, src: Region, offset: int, length: int, raddr: int, rkey: int, imm: Optional[int]) -> None:
        self.qp.post_send(write_request(wr_id, src, offset, length, raddr, rkey, imm))

    def post_recv(self, count: int) -> None:
        for _ in range(count):
            self.qp.post_recv(self._recv_wr)

    def poll(self, max_entries: int) -> list[Completion]:
        n, wcs = self.cq.poll(max_entries)
        return [completion(wc) for wc in wcs[: max(n, 0)]]

    def error(self) -> Optional[str]:
        if self.closed:
            return "queue pair closed"
        e = self.e
        attr, _ = self.qp.query(e.IBV_QP_STATE)
        return "queue pair in error state" if attr.qp_state == e.IBV_QPS_ERR else None

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.qp.close()
        self.cq.close()
