"""How sysfs, NVML and NCCL's topology XML write the values a topology holds: CPU lists, PCI bus ids, link speeds,
and the NVLink rate of each GPU generation. Parsers and formatters only; discovery and the XML reader both use them."""

from __future__ import annotations

import re
from typing import Any, Optional, Sequence

_BDF = re.compile(r"^([0-9a-fA-F]{4,8}):([0-9a-fA-F]{2}):([0-9a-fA-F]{2})\.([0-7])$")
_GTS = re.compile(r"([0-9]+(?:\.[0-9]+)?)\s*GT/s")

# One NVLink's data rate per direction, GB/s, by CUDA compute capability (the NVLink generation the GPU
# carries): P100 NVLink1 20, V100 NVLink2 25, A100 NVLink3 25, GA10x NVLink3 x4 (14.0625), H100 NVLink4 25,
# B200 NVLink5 50. Spec sheet figures; NCCL's tuning uses measured ones (e.g. 20.6 for SM90).
_NVLINK_GBPS = ((100, 50.0), (90, 25.0), (87, 25.0), (86, 14.0625), (80, 25.0), (70, 25.0), (60, 20.0))
DEFAULT_NVLINK_GBPS = 25.0


def nvlink_GBps(sm: int) -> float:
    """Per-link NVLink bandwidth (GB/s per direction) of a GPU of compute capability ``sm`` (e.g. 90)."""
    for floor, gbps in _NVLINK_GBPS:
        if sm >= floor:
            return gbps
    return DEFAULT_NVLINK_GBPS


def normalize_bus_id(text: Any) -> str:
    """``0000:1b:00.0`` from NVML's ``00000000:1B:00.0``, a bare ``1b:00.0``, bytes, or any case; "" if invalid."""
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    text = str(text).strip().rstrip("\x00").lower()
    if text.count(":") == 1:
        text = "0000:" + text
    m = _BDF.match(text)
    if not m:
        return ""
    domain, bus, dev, fn = m.groups()
    return f"{int(domain, 16):04x}:{bus}:{dev}.{fn}"


def parse_cpulist(text: str) -> list[int]:
    """CPU numbers of a Linux cpulist such as ``0-3,8,10-11``."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        part = part.strip()
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.extend(range(int(lo), int(hi or lo) + 1))
    return cpus


def format_cpulist(cpus: Sequence[int]) -> str:
    """The Linux cpulist of a set of CPU numbers: ``[0, 1, 2, 5]`` -> ``0-2,5``."""
    out, run = [], []
    for c in sorted(set(cpus)):
        if run and c == run[-1] + 1:
            run.append(c)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [c]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)


def parse_link_speed(text: Optional[str]) -> float:
    """GT/s from a sysfs or NCCL link speed such as ``16.0 GT/s PCIe``; 0 when unknown."""
    m = _GTS.search(text or "")
    return float(m.group(1)) if m else 0.0
