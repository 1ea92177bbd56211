#!/usr/bin/env bash
# The simulator's one-host reference (perf/results/simulator-check): pycoll alone, the arena algorithms and the ring forced, each in
# its own job (--rounds rotates the jobs' order; not --interleave, which alternates algorithms on the same buffers
# and so keeps the inline paths from their steady state), 2 to 4 ranks, 1 to 256 MiB. Then
# `python perf/simulate_check.py --out perf/results/simulator-check` compares the model's predictions with it.
# About 30 minutes on the 2-core VM with ROUNDS=5. Run it alone: any other load on the 2 cores slows the spinning pipes 1.5-2x.
set -euo pipefail
cd "$(dirname "$0")/.."
out=perf/results/simulator-check
mkdir -p "$out"
common=(--peers pycoll -d float --inplace out --rounds ${ROUNDS:-3} --no-progress)
sweep() {  # NAME ARGS...: one JSON and one console table per sweep (PARTS=REGEX: only the sweeps it matches)
  local name=$1; shift
  [[ $name =~ ${PARTS:-.} ]] || return 0
  python -m pycoll perf "${common[@]}" "$@" --json "$out/$name.json" > "$out/$name.txt"
}
ar=(-C allreduce --algos allreduce:staged,allreduce:cma,allreduce:ring)
others=(-C reduce_scatter,allgather,broadcast
        --algos reduce_scatter:staged,reduce_scatter:cma,allgather:staged,allgather:cma,broadcast:staged,broadcast:cma)
# 1-4 MiB calls take well under a millisecond: enough iterations that the inline paths reach their steady state.
# 256 KiB first, not judged: a job's first size carries its warm-up (1 MiB first measured 0.6-0.9x the model).
sweep host_allreduce_mid --np 2,3,4 "${ar[@]}" -b 256K -e 4M -f 4 -n 40 -w 10
sweep host_allreduce_large --np 2 "${ar[@]}" -b 16M -e 256M -f 4 -n 8 -w 2
sweep host_allreduce_large_over --np 3,4 "${ar[@]}" -b 16M -e 64M -f 4 -n 8 -w 2  # not judged: see simulate_check.py
sweep host_others_mid --np 2,4 "${others[@]}" -b 256K -e 4M -f 4 -n 40 -w 10
sweep host_others_large --np 2 "${others[@]}" -b 16M -e 256M -f 4 -n 8 -w 2
# the ring allgather, auto's pick at 256 MiB before issue 8's third sweep
sweep host_allgather_ring --np 2 -C allgather --algos allgather:ring -b 16M -e 256M -f 4 -n 8 -w 2
sweep host_others_large_over --np 4 "${others[@]}" -b 16M -e 64M -f 4 -n 8 -w 2
