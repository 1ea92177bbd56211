"""Rank program (2 ranks): every group's own timeout, on blocking calls, on Work.wait() and on a barrier, raises at
that time, naming that time and the rank waited for. Rank 1 stays away from each call; rank 0 times it.

Writes ``{out}/rank{r}.json`` with the checks made and any failure.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import time
import traceback

import torch
import torch.distributed as dist

import pycoll.torch  # noqa: F401

SLACK_S = 1.5  # the progress thread's wake-up and the report, on a loaded 2-core machine


def run(r: int, fail: list[str], seconds: list[float]) -> int:
    checks = 0

    def expect(cond: bool, what: str) -> None:
        nonlocal checks
        checks += 1
        if not cond:
            fail.append(what)

    def times_out(what: str, timeout: float, call) -> None:
        t0 = time.monotonic()
        try:
            call()
            expect(False, f"{what}: no error after {time.monotonic() - t0:.1f} s")
            return
        except Exception as exc:  # noqa: BLE001 - what it raises is the check
            took = time.monotonic() - t0
            seconds.append(took)
            text = str(exc)
            expect(timeout - 0.05 <= took <= timeout + SLACK_S, f"{what}: raised after {took:.2f} s, not {timeout:g} s")
            expect(f"Timed out after {timeout:g} s" in text, f"{what}: the message does not say {timeout:g} s: {text}")
            expect("rank 1" in text or "ranks 1" in text, f"{what}: the message does not name rank 1: {text}")

    groups = {s: dist.new_group([0, 1], timeout=datetime.timedelta(seconds=s)) for s in (1, 2, 3)}
    away = 1 + 3 + 2 + SLACK_S + 1  # rank 1's absence covers every call below
    if r == 0:
        times_out("a blocking all_reduce on a group with a 2 s timeout", 2,
                  lambda: dist.all_reduce(torch.ones(4), group=groups[2]))
        times_out("Work.wait() of an async all_reduce on a 1 s group", 1,
                  lambda: dist.all_reduce(torch.ones(4), group=groups[1], async_op=True).wait())
        times_out("a barrier on a 3 s group", 3, lambda: dist.barrier(group=groups[3]))
    else:
        time.sleep(away)
    dist.barrier()  # the default group (its own 60 s) still works
    t = torch.ones(3) * (r + 1)
    dist.all_reduce(t)
    expect(bool((t == 3).all()), f"the default group after the timeouts: {t.tolist()}")
    return checks


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dist.init_process_group("pycoll", timeout=datetime.timedelta(seconds=60))
    r = dist.get_rank()
    fail: list[str] = []
    seconds: list[float] = []
    result: dict = {"rank": r}
    try:
        result["checks"] = run(r, fail, seconds)
    except Exception:
        result["error"] = traceback.format_exc()
    result.update(failures=fail, seconds=seconds)
    with open(os.path.join(args.out, f"rank{r}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
