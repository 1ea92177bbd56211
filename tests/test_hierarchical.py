"""Hierarchical algorithms on virtual hosts (network namespaces): 2 hosts x 2 ranks and 3 hosts x 1-2 ranks."""

from __future__ import annotations

import pytest

import harness
from pycoll.netns import unavailable

pytestmark = [pytest.mark.ranks, pytest.mark.skipif(unavailable() is not None, reason=f"{unavailable()}")]

ALL_THREE = "allreduce:hierarchical,reduce_scatter:hierarchical,allgather:hierarchical"
CHECKS = ["reduce.allreduce", "reduce.reduce_scatter", "reduce.reduce_scatter_block", "movement.allgather*",
          "topology.placement", "topology.chosen_algorithms"]


@pytest.mark.timeout(300)
def test_two_hosts_two_ranks_each(tmp_path) -> None:
    """The large allreduces and reduce-scatters (4-8 MiB) run as 4-8 pipelined segments (PYCOLL_HIER_SEGMENT=1M)."""
    res = harness.run_cases_on_hosts(CHECKS + ["large.allreduce", "large.reduce_family"], hosts=2, n=4,
                                     env={"PYCOLL_ALGO": ALL_THREE, "PYCOLL_HIER_SEGMENT": "1M"},
                                     out_dir=str(tmp_path), job_timeout=240)
    res.assert_ok()
    assert res.records("topology.placement", "host_of")[0] == [0, 0, 1, 1]
    assert res.records("topology.placement", "transports")[0] == ["self", "shm", "tcp", "tcp"]
    for coll in ("allreduce", "reduce_scatter", "allgather"):
        assert set(res.records("topology.chosen_algorithms", coll).values()) == {"hierarchical"}, coll


@pytest.mark.timeout(300)
def test_large_calls_composed_on_two_hosts_of_two(tmp_path) -> None:
    """With PYCOLL_SMP_BYTES=1G every call that can be composed is, here at 1-16 MB (ops x dtypes of Allreduce,
    Bcast, Allgather, Reduce, Reduce_scatter_block, Alltoall): each matches NumPy."""
    res = harness.run_cases_on_hosts(["large.allreduce", "large.movement", "large.reduce_family",
                                      "topology.chosen_algorithms"], hosts=2, n=4, env={"PYCOLL_SMP_BYTES": "1G"},
                                     out_dir=str(tmp_path), job_timeout=240)
    res.assert_ok()
    for coll in ("allreduce", "reduce_scatter", "allgather"):
        assert set(res.records("topology.chosen_algorithms", coll).values()) == {"composed"}, coll


@pytest.mark.timeout(300)
def test_three_uneven_hosts(tmp_path) -> None:
    res = harness.run_cases_on_hosts(CHECKS, hosts=3, n=5, ranks_per_host=[2, 1, 2], env={"PYCOLL_ALGO": ALL_THREE},
                                     out_dir=str(tmp_path), job_timeout=240)
    res.assert_ok()
    assert res.records("topology.placement", "host_of")[4] == [0, 0, 1, 2, 2]
    assert set(res.records("topology.chosen_algorithms", "allreduce").values()) == {"hierarchical"}
    # hosts of different sizes: the grid algorithms refuse, and the cost model picks a flat one on every rank alike
    for coll in ("reduce_scatter", "allgather"):
        chosen = set(res.records("topology.chosen_algorithms", coll).values())
        assert len(chosen) == 1 and "hierarchical" not in chosen, (coll, chosen)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("per_host", [[2, 2], [2, 1, 2], [3, 1], [3, 2]], ids=["2x2", "2-1-2", "3-1", "3-2"])
def test_small_calls_composed_from_hosts_and_leaders(per_host, tmp_path) -> None:
    """Without a forced algorithm, every op x dtype x count Allreduce, Bcast, Reduce, Allgather, Reduce_scatter_block
    and Alltoall (small ones composed: calls on each host's communicator and one among the leaders) matches NumPy,
    on even and uneven hosts, and so do Allgatherv and Reduce_scatter with uneven counts (not composed: a composition
    by hosts failed on them); PYCOLL_SMP_BYTES=0 keeps the flat path."""
    n = sum(per_host)
    cases = ["reduce.allreduce", "movement.barrier", "movement.bcast", "reduce.reduce", "reduce.reduce_every_root",
             "movement.allgather", "movement.allgatherv", "reduce.reduce_scatter_block", "reduce.reduce_scatter",
             "movement.alltoall", "topology.host_composition", "topology.composed_repeats",
             "errors.mismatch_barrier_vs_bcast"]
    res = harness.run_cases_on_hosts(cases, hosts=len(per_host), n=n, ranks_per_host=per_host, out_dir=str(tmp_path),
                                     job_timeout=240)
    res.assert_ok()
    made = res.records("topology.host_composition", "made")
    assert set(made.values()) == {True}, made
    first = [sum(per_host[:h]) for h in range(len(per_host))]
    for rank, size in res.records("topology.host_composition", "host_size").items():
        host = max(h for h in range(len(per_host)) if first[h] <= int(rank))
        assert size == per_host[host], (rank, size)
    leaders = {int(r): k for r, k in res.records("topology.host_composition", "leaders").items()}
    assert {r for r, k in leaders.items() if k} == set(first) and {leaders[r] for r in first} == {len(per_host)}
    assert set(res.records("topology.host_composition", "child_freed").values()) == {True}
    # a plan's closure composes its repeated calls, and steps aside while PYCOLL_SMP_BYTES or PYCOLL_ALGO says otherwise
    repeated = res.records("topology.host_composition", "repeated composed")
    assert all(runs == [True, True, True, False, False, True, True] for runs in repeated.values()), repeated
    assert set(res.records("topology.host_composition", "plan closure").values()) == {True}
    closures = res.records("topology.composed_repeats", "closures")
    assert all(set(c.values()) == {True} for c in closures.values()), closures
    even = len(set(per_host)) == 1
    assert set(res.records("topology.composed_repeats", "even").values()) == {even}
    if even:  # a small Reduce_scatter_block is composed there, and its plan runs from a closure
        assert set(res.records("topology.composed_repeats", "reduce_scatter_block closure").values()) == {True}
    for call in ("bcast", "reduce"):
        assert set(res.records("topology.host_composition", f"{call} by").values()) == {"composed"}, call
    # Allgather only where every host holds as many ranks, numbered host by host
    for call in ("allgather", "alltoall"):
        by = set(res.records("topology.host_composition", f"{call} by").values())
        assert (by == {"composed"}) == (len(set(per_host)) == 1), (call, by)
    off = harness.run_cases_on_hosts(["topology.host_composition"], hosts=len(per_host), n=n, ranks_per_host=per_host,
                                     env={"PYCOLL_SMP_BYTES": "0"}, out_dir=str(tmp_path / "off"), job_timeout=120)
    off.assert_ok()
    assert set(off.records("topology.host_composition", "made").values()) == {False}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("hosts", [2, 3])
def test_large_reduce_scatter_block_and_allgather_composed_on_hosts_of_two(hosts, tmp_path) -> None:
    """Reduce_scatter_block and Allgather past PYCOLL_SMP_BYTES on hosts of two ranks, where the cost model
    composes them (the Reduce_scatter_block by rails, its host steps past the slot in pieces; the Allgather host
    first): ops x dtypes x odd block counts, in and out of place, repeated through the plan's closure; each
    matches NumPy. The host step's slots kernel leaves each rank's own block out of its slot (read from the send buffer). A Reduce past it, to a leader or another
    rank, matches NumPy too and runs composed at some of its sizes."""
    res = harness.run_cases_on_hosts(["topology.large_composed"], hosts=hosts, n=2 * hosts, out_dir=str(tmp_path),
                                     job_timeout=240)
    res.assert_ok()
    for key in ("chosen", "allgather chosen"):
        assert set(map(tuple, res.records("topology.large_composed", key).values())) == {("composed",)}, key
    assert set(res.records("topology.large_composed", "by rails").values()) == {27}
    assert set(res.records("topology.large_composed", "by rails after the allgathers").values()) == {27}
    assert set(res.records("topology.large_composed", "in pieces").values()) == {6}  # block 150001: 2 a host's run
    closures = res.records("topology.large_composed", "closure")
    assert all(set(c.values()) == {True} for c in closures.values()), closures
    # a Reduce past PYCOLL_SMP_BYTES runs composed at some of these sizes and roots, flat at others
    for chosen in res.records("topology.large_composed", "reduce chosen").values():
        assert "composed" in chosen, chosen


@pytest.mark.parametrize("ranks_per_host", [(2, 2), (3, 1)])
def test_composed_calls_between_hosts_over_a_slow_link_run_in_segments(tmp_path, ranks_per_host) -> None:
    """With a link the cost model knows to be slow (1 Gbit/s given; the namespaces unshaped, so the test is quick),
    Allreduce, Bcast and Reduce above PYCOLL_SMP_BYTES between two hosts of two ranks (or of three and one) are
    composed in segments: each matches NumPy for ops x dtypes x odd counts, in and out of place, from each root,
    through the plan's closure. A Bcast whose root does not lead its host is composed whole, and a Reduce to such a
    root takes the flat chain; every other call runs in segments."""
    res = harness.run_cases_on_hosts(["topology.segmented_composed"], n=4, ranks_per_host=list(ranks_per_host),
                                     out_dir=str(tmp_path), env={"PYCOLL_LINK_RATE": "1gbit"}, job_timeout=240)
    res.assert_ok()
    assert set(map(tuple, res.records("topology.segmented_composed", "Allreduce chosen").values())) == {("composed",)}
    # from another rank: the whole composition, or the chain where the model prices that lower
    for chosen in res.records("topology.segmented_composed", "Bcast chosen").values():
        assert "composed" in chosen and set(chosen) <= {"composed", "chain"}, chosen
    assert set(map(tuple, res.records("topology.segmented_composed", "Reduce chosen").values())) == {("chain", "composed")}
    # per rank: 5 op and dtype pairs x 3 repeats x (2 Allreduce + 2 Reduce roots x (1 + 1 at the root or again)),
    # and 5 x 2 Bcast roots x 3
    segmented = set(res.records("topology.segmented_composed", "in segments").values())
    assert segmented == {5 * 3 * (2 + 2 * 2) + 5 * 2 * 3}, segmented
    closures = res.records("topology.segmented_composed", "closure")
    assert all(set(c.values()) == {True} for c in closures.values()), closures
