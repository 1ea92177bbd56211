"""Rank side of `pycoll perf`: times collectives with one backend and prints `@@PERF` JSON lines on rank 0."""

from __future__ import annotations

import json
import math
import random
import sys
import time
import traceback
from typing import Any, Callable, Optional

from pycoll.config import environ
from pycoll.perf import metrics
from pycoll.perf.backends import Backend, Unsupported, make_backend
from pycoll.perf.reference import check_result


MARKER = "@@PERF "
Emit = Callable[[dict[str, Any]], None]


def algorithm_used(peer: str, coll: str, comm: Any = None) -> Optional[str]:
    """The algorithm pycoll's selection picked for the last `coll` call, if pycoll exposes it (else None).

    Asks ``comm`` (the benchmark's communicator) first: its record holds its own calls only, where the
    process-wide one also takes the choices of the communicators its algorithms call and of the barriers between
    timed calls. Otherwise reads pycoll.algorithms' ``last_choice``: an object with ``collective`` and ``algorithm``
    (or ``name``) attributes, a mapping collective -> choice, or a callable taking the collective; missing or
    odd: None.
    """
    if peer != "pycoll":
        return None
    ran = _comm_record(comm).get(coll)
    if ran is not None:
        return ran[0]
    mods = [sys.modules.get("pycoll.algorithms.registry"), sys.modules.get("pycoll.algorithms")]
    choice = next((getattr(m, "last_choice") for m in mods if m is not None and hasattr(m, "last_choice")), None)
    try:
        if isinstance(choice, dict):
            choice = choice.get(coll)
        elif callable(choice) and not hasattr(choice, "algorithm"):
            choice = choice(coll)
        if choice is None:
            return None
        if isinstance(choice, str):
            return choice or None
        got = getattr(choice, "collective", coll)
        name = getattr(choice, "algorithm", None) or getattr(choice, "name", None)
        if got != coll or not name:
            return None
        return str(getattr(name, "name", name))  # an Algorithm object or its name
    except Exception:  # a hook that changed shape must not break a benchmark
        return None


def _comm_record(comm: Any) -> dict:
    """A pycoll communicator's collective -> (algorithm, bytes) of its last calls (empty for others)."""
    ran = getattr(getattr(comm, "_x", None), "ran", None)
    return ran if isinstance(ran, dict) else {}


def predicted_us(b: Backend, coll: str, name: Optional[str], root: int = 0) -> Optional[float]:
    """What pycoll's cost model predicted for its last ``coll`` call, with the algorithm it chose (``name``, from
    ``algorithm_used``), the call's size as selection saw it, the communicator's layout and the call's ``root`` (a
    composed Bcast from a host's leader is priced as two steps) (µs); None for other peers or where it cannot say."""
    if b.name != "pycoll" or name is None:
        return None
    registry = sys.modules.get("pycoll.algorithms.registry")
    ran = _comm_record(b.comm).get(coll)
    try:
        from pycoll.algorithms import cost

        nbytes = ran[1] if ran is not None else registry.last_choice.nbytes  # type: ignore[union-attr]
        if name == "composed":  # the host and leaders' steps (pycoll.composed)
            from pycoll import composed

            t = composed.predict(cost.current(), coll, nbytes, b.comm._layout, root=root)  # type: ignore[attr-defined]
            return round(t * 1e6, 3) if math.isfinite(t) else None  # inf: a composition the model does not price
        algo = registry.ALGORITHMS[coll][name]  # type: ignore[union-attr]
        return round(algo.predict(cost.current(), nbytes, b.comm._layout) * 1e6, 3)  # type: ignore[attr-defined]
    except Exception:  # noqa: BLE001 - no choice recorded, a collective without a model: no prediction
        return None


def timed_iterations(spec: dict[str, Any], call_s: float) -> int:
    """How many timed iterations a point gets: -n (``iters``), or more where calls of ``call_s`` seconds (the
    warm-up's median, every variant's together) would fill less than --min-time, up to --max-iters (the OSU
    benchmarks likewise run small messages many more times than large ones, so that their medians hold still)."""
    n, least, most = spec["iters"], spec.get("min_time", 0.0), spec.get("max_iters", 0)
    if least <= 0 or call_s <= 0 or most <= n:
        return n
    return max(n, min(most, math.ceil(least / call_s)))


def measure(b: Backend, spec: dict[str, Any], coll: str, size: int, inplace: bool,
            variants: Optional[list[dict[str, Any]]] = None) -> list[dict[str, Any]]:
    """Rows of one point: warm-up, timed loop (barrier before each iteration), optional check.

    With several ``variants`` (the job itself, then forced algorithms of --interleave), their iterations
    alternate, each iteration in an order of its own (shuffled alike on every rank), so drifts of a shared machine
    hit all alike and no run always follows the same one (on a shaped link, a run after one that drained the token
    bucket waits for it to fill).
    """
    n, dtype, op, root = b.size, spec["np_dtype"], spec["op"], spec["root"]
    nbytes, count = metrics.round_size(coll, size, spec["itemsize"], n)
    fresh = b.buffers == "fresh"  # new arrays before every timed call: allocation and first touch are not timed
    per_call = metrics.calls_per_iteration(coll)  # a round trip is two one-way times, a window 64 messages
    timed_here = coll not in metrics.P2P or b.rank == 0  # p2p: rank 0's clock; the others report 0
    runs = variants or [{}]
    envs = [v.get("env", {}) for v in runs]  # each run's environment: a forced algorithm's PYCOLL_ALGO
    b.variants(len(runs))
    prepared = []
    warm: list[float] = []  # each variant's median warm-up call (s)
    for j, env in enumerate(envs):
        with environ(env), b.on(j):
            run, _ = b.prepare(coll, inplace, count, dtype, op, root)
            took = []
            for _ in range(spec["warmup"]):
                t0 = time.perf_counter()
                run()
                b.sync()
                took.append(time.perf_counter() - t0)
        prepared.append(run)
        warm.append(sorted(took)[len(took) // 2] if took else 0.0)
    b.sync()
    iters = b.most(timed_iterations(spec, sum(warm)))  # the same count on every rank
    times: list[list[float]] = [[] for _ in runs]
    used: list[Optional[str]] = [None] * len(runs)
    predicted: list[Optional[float]] = [None] * len(runs)
    for i in range(iters):
        order = list(range(len(runs)))
        random.Random(i).shuffle(order)  # the same order on every rank
        for j in order:
            env = envs[j]
            if fresh:
                with environ(env), b.on(j):
                    prepared[j] = b.prepare(coll, inplace, count, dtype, op, root)[0]
                b.sync()
            b.barrier()  # in the job's own environment: its plans hold from one variant's call to the next
            with environ(env):
                t0 = time.perf_counter()
                prepared[j]()
                b.sync()
                elapsed = (time.perf_counter() - t0) * 1e6
            times[j].append(elapsed / per_call if timed_here else 0.0)
            with environ(env), b.on(j):
                used[j] = algorithm_used(b.name, coll, getattr(b, "comm", None))
                if i == iters - 1:  # the last call of each variant: the model's work stays out of the timed loop
                    predicted[j] = predicted_us(b, coll, used[j], root)
    wrong = [0] * len(runs)
    if spec["check"]:
        for j, env in enumerate(envs):
            with environ(env), b.on(j):
                run, result = b.prepare(coll, inplace, count, dtype, op, root)  # fresh inputs
                run()
                b.sync()
            wrong[j] = check_result(result(), coll, b.rank, n, count, op, root, dtype)
    hosts = (spec.get("hosts") or 1) > 1
    link = [_link_bytes(b, prepared[j], min(iters, LINK_CALLS), envs[j]) if hosts else None for j in range(len(runs))]
    gathered = b.gather((times, wrong, used, link, predicted))
    if b.rank != 0:
        return []
    rows = []
    for j, v in enumerate(runs):
        t = metrics.slowest_rank_time([g[0][j] for g in gathered])
        picks = {g[2][j] for g in gathered}
        rows.append({
            "peer": v.get("label") or spec.get("label") or b.name, "algo": v.get("algo", spec.get("algo")),
            "algo_used": picks.pop() if len(picks) == 1 else "/".join(sorted(map(str, picks))),
            "hosts": spec.get("hosts") or 1, "link_rate": spec.get("link_rate"), "device": b.memory,
            "collective": coll, "nranks": n, "bytes": nbytes, "count": count,
            "dtype": spec["dtype"], "op": op if coll in metrics.REDUCING else "none",
            "root": root if coll in metrics.ROOTED else -1, "inplace": inplace, "buffers": b.buffers,
            "time_us": round(t, 3), "algbw_GBps": round(metrics.algbw(nbytes, t), 4),
            "busbw_GBps": round(metrics.busbw(coll, n, nbytes, t), 4),
            "wrong": int(sum(g[1][j] for g in gathered)), "iters": iters, "warmup": spec["warmup"],
        })
        if hosts:
            rows[-1].update(_link_row([g[3][j] for g in gathered], coll, nbytes, root, per_call))
        if predicted[j] is not None:  # rank 0's model, which every rank uses
            rows[-1]["predicted_us"] = predicted[j]
    return rows


LINK_CALLS = 10  # calls counted for the bytes on the links, after the timed ones
LINK_SETTLE_S = 0.02


def _link_bytes(b: Backend, run: Callable[[], Any], calls: int, env: dict[str, str]) -> tuple[int, int, int, int]:
    """(this rank's network namespace, bytes its host sent on its link in a window around ``calls`` calls, in the
    same window without them, ``calls``). Each window ends with two barriers and a pause for bytes still leaving.
    Ranks of one virtual host read the same counter, at slightly different times (``_link_row`` combines them).
    The calls run in their run's environment (``env``: a forced algorithm's), the barriers in the job's."""
    from pycoll import netns

    def settle() -> int:
        b.sync()
        b.barrier()
        time.sleep(LINK_SETTLE_S)  # a rank's last bytes to another host may trail the barrier's own messages
        b.barrier()
        return netns.sent_bytes() or 0

    a = settle()
    c = settle()
    with environ(env):
        for _ in range(calls):
            run()
    d = settle()
    return netns.namespace_id(), d - c, c - a, calls


def _link_row(per_rank: list[tuple[int, int, int, int]], coll: str, nbytes: int, root: int, per_call: int
              ) -> dict[str, Any]:
    """The record's link figures: bytes that left all hosts per call, and the fewest the call needs
    (metrics.min_link_bytes). A host's ranks read its one counter at different moments, so a host counts the
    widest window around the calls that any of its ranks saw, less the quietest window without them."""
    hosts: dict[int, int] = {}
    widest: dict[int, int] = {}
    quietest: dict[int, int] = {}
    calls = 1
    for ns, with_calls, without, calls in per_rank:
        hosts.setdefault(ns, len(hosts))
        widest[ns] = max(widest.get(ns, with_calls), with_calls)
        quietest[ns] = min(quietest.get(ns, without), without)
    sent = sum(max(widest[ns] - quietest[ns], 0) for ns in hosts) / calls / per_call
    host_of = [hosts[ns] for ns, *_ in per_rank]
    counts = [host_of.count(h) for h in range(len(hosts))]
    least = metrics.min_link_bytes(coll, nbytes, counts, host_of[root] if root < len(host_of) else 0,
                                   (host_of[0], host_of[min(1, len(host_of) - 1)]))
    return {"link_bytes": round(sent), "link_min_bytes": None if least is None else round(least)}


def _variants(spec: dict[str, Any], coll: str) -> list[dict[str, Any]]:
    """The runs of one point: the job itself, then (interleaved, same processes) each forced algorithm for ``coll``."""
    forced = [v for v in spec.get("variants", []) if coll in v["collectives"]]
    return [{}] + [{"label": v["label"], "algo": v["algo"], "env": v["env"]} for v in forced]


DUPLICATE_GPU = "Duplicate GPU detected"


def skip_reason(exc: BaseException) -> Optional[str]:
    """Why a peer cannot run this job at all (a skip, not a failure), or None for a real error.

    NCCL refuses two ranks of one communicator on the same GPU; torch and CuPy raise its message."""
    text = f"{exc}"
    if DUPLICATE_GPU in text:
        line = next((ln.strip() for ln in text.splitlines() if DUPLICATE_GPU in ln), DUPLICATE_GPU)
        return f"NCCL takes one GPU per rank ({line})"
    return None


def run_peer(spec: dict[str, Any], emit: Emit) -> int:
    """Run every (collective, size, mode) of spec with spec['peer']; rank 0 emits records, errors or skips."""
    b = make_backend(spec["peer"], spec.get("device", "host"), spec.get("nccl_via"))
    if b.takes_buffer_modes:
        b.buffers = spec.get("buffers", "spec")
    try:
        for coll in spec["collectives"]:
            try:
                seen: set[int] = set()
                sizes = [0] if coll in metrics.SIZELESS else spec["sizes"]
                modes = [False] if coll in metrics.NO_INPLACE else spec["modes"]
                for size in sizes:
                    nbytes, count = metrics.round_size(coll, size, spec["itemsize"], b.size)
                    if coll not in metrics.SIZELESS and (count == 0 or nbytes in seen):
                        continue  # too small for this many ranks, or a repeat after rounding
                    seen.add(nbytes)
                    for inplace in modes:
                        for rec in measure(b, spec, coll, size, inplace, _variants(spec, coll)):
                            emit(rec)
            except Exception as exc:  # e.g. an op or dtype the backend lacks; raised alike on every rank
                if b.rank == 0:
                    rec = {"peer": spec.get("label") or b.name, "collective": coll, "nranks": b.size}
                    skip = f"{coll}: {exc}" if isinstance(exc, Unsupported) else skip_reason(exc)
                    if skip:
                        emit(dict(rec, skipped=skip))
                        continue
                    emit(dict(rec, error=f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"))
                    traceback.print_exc(file=sys.stderr)
    finally:
        b.close()
    return 0


def _print_record(rec: dict[str, Any]) -> None:
    print(MARKER + json.dumps(rec), flush=True)


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2 or argv[0] != "--spec":
        print("usage: python -m pycoll.perf.worker --spec JSON", file=sys.stderr)
        return 2
    return run_peer(json.loads(argv[1]), _print_record)


if __name__ == "__main__":
    sys.exit(main())
