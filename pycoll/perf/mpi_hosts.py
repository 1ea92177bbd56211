"""MPICH across virtual hosts: `python -m pycoll.perf.mpi_hosts -n N --hosts H -- CMD` runs CMD under mpiexec on
network namespaces, its traffic between hosts on their links, so `pycoll perf --hosts` can run MPI beside pycoll."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from typing import Optional

from pycoll import netns
from pycoll.launcher import plan_hosts

# MPICH's UCX netmod between hosts, over TCP on the virtual link only: by default UCX reaches the other namespace
# through shared memory (one machine), and nothing would cross the link. Ranks of one host use MPICH's own
# shared memory, as on a real node (hydra tells each rank which ranks share its host).
LINK_ENV = {"MPIR_CVAR_CH4_NETMOD": "ucx", "UCX_TLS": "tcp,self", "UCX_NET_DEVICES": netns.HOST_IFNAME}


def hydra_argv(mpiexec: str, vh: netns.VirtualHosts, counts: list[int], launcher: str, cmd: list[str]) -> list[str]:
    """mpiexec started in host 0, placing ``counts[h]`` consecutive ranks on host h through ``launcher``."""
    hosts = ",".join(f"{addr}:{k}" for addr, k in zip(vh.addresses, counts))
    return [*vh.exec_prefix(0), mpiexec, "-hosts", hosts, "-n", str(sum(counts)), "-launcher", "ssh",
            "-launcher-exec", launcher, "-iface", netns.HOST_IFNAME, *cmd]


def run(n: int, hosts: int, cmd: list[str], link_rate: Optional[str] = None, mpiexec: Optional[str] = None,
        timeout: Optional[float] = None) -> int:
    """Run ``cmd`` as ``n`` MPI ranks over ``hosts`` virtual hosts (contiguous blocks, as `pycoll run --hosts`);
    the exit code of mpiexec. The namespaces are removed afterwards."""
    from pycoll.perf.peers import find_mpiexec

    exe = mpiexec or find_mpiexec()
    if exe is None:
        raise FileNotFoundError("no mpiexec next to python or on PATH")
    counts = plan_hosts(n, hosts)
    env = dict(os.environ, **LINK_ENV)
    with tempfile.TemporaryDirectory(prefix="pycoll-mpi-hosts-") as tmp, \
            netns.VirtualHosts(hosts, rate=link_rate) as vh:
        launcher = vh.write_launcher(os.path.join(tmp, "on-host"))
        proc = subprocess.Popen(hydra_argv(exe, vh, counts, launcher, cmd), env=env)
        try:
            return proc.wait(timeout=timeout)
        except BaseException:
            proc.kill()
            proc.wait()
            raise


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pycoll.perf.mpi_hosts", description=__doc__.splitlines()[0])
    p.add_argument("-n", type=int, required=True, help="ranks")
    p.add_argument("--hosts", type=int, required=True, help="virtual hosts (network namespaces; needs root)")
    p.add_argument("--link-rate", default=None, help="shape each link to RATE each way (tc tbf), e.g. 1gbit")
    p.add_argument("--timeout", type=float, default=None, help="seconds before the job is killed")
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="-- CMD ARGS...")
    ns = p.parse_args(argv)
    cmd = ns.cmd[1:] if ns.cmd[:1] == ["--"] else ns.cmd
    if not cmd:
        p.error("no command given")
    reason = netns.unavailable(need_tc=bool(ns.link_rate))
    if reason:
        print(f"mpi_hosts: cannot make virtual hosts: {reason}", file=sys.stderr)
        return 1
    return run(ns.n, ns.hosts, cmd, ns.link_rate, timeout=ns.timeout)


if __name__ == "__main__":
    sys.exit(main())
