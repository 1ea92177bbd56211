#!/usr/bin/env bash
# Host-buffer speed (perf/results/host-vs-mpich-gloo): pycoll against MPICH (mpi4py) and Gloo (torch.distributed) on host buffers, same run,
# then the target checker and the plots. Peers take turns (--rounds 3 rotates their order) so that the
# machine's drifts fall on all of them alike. Takes about 15 minutes on the 2-core VM.
set -euo pipefail
cd "$(dirname "$0")/.."
out=perf/results/host-vs-mpich-gloo
mkdir -p "$out"
common=(--peers pycoll,mpi,gloo -d float --inplace out --rounds ${ROUNDS:-2} --no-progress)
sweep() {  # NAME ARGS...: one JSON and one console table per sweep
  local name=$1; shift
  python -m pycoll perf "${common[@]}" "$@" --json "$out/$name.json" > "$out/$name.txt"
}
sweep allreduce_small --np 2 -C allreduce -b 8 -e 64K -f 8 -n 200 -w 20
# 1-4 MiB calls take well under a millisecond: many iterations, so a median is not a handful of samples
sweep allreduce_mid --np 2,4 -C allreduce -b 1M -e 4M -f 4 -n 40 -w 10
sweep allreduce_large --np 2,4 -C allreduce -b 16M -e 256M -f 4 -n 6 -w 2
sweep others_mid --np 2 -C reduce_scatter,allgather,broadcast -b 1M -e 4M -f 4 -n 40 -w 10 --rounds 3
sweep others_large --np 2 -C reduce_scatter,allgather,broadcast -b 16M -e 256M -f 4 -n 12 -w 4 --rounds 3
files=("$out"/allreduce_small.json "$out"/allreduce_mid.json "$out"/allreduce_large.json "$out"/others_mid.json "$out"/others_large.json)
python perf/host_targets.py "${files[@]}" | tee "$out/targets.txt" || true
python -m pycoll plot "${files[@]}" --out "$out/plots"
