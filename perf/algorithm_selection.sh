#!/usr/bin/env bash
# Algorithm selection's figures (perf/results/algorithm-selection): tune the cost model, then sweep every allreduce algorithm against the automatic choice
# on 1 host x 4 ranks and on 2 virtual hosts x 2 ranks (links shaped to 1 Gbit/s); needs root for namespaces.
# Forced algorithms alternate with the automatic run iteration by iteration (--interleave); sizes below 1 MiB,
# cheap and noisy, get more iterations. RETUNE=1 refits the model first.
set -euo pipefail
cd "$(dirname "$0")/.."
out=perf/results/algorithm-selection
mkdir -p "$out"
export PYCOLL_TUNE_FILE="$PWD/$out/tuning.json"
if [ "${RETUNE:-0}" = 1 ]; then
  python -m pycoll tune -n 4 --fresh -o "$PYCOLL_TUNE_FILE" --sizes 8,256,4K,64K,128K,256K,512K,1M,2M,4M,8M,16M,64M \
    --iters 20
  mv "$PYCOLL_TUNE_FILE.points.json" "$out/tuning_1host.points.json"
  python -m pycoll tune -n 4 --hosts 2 --link-rate 1gbit -o "$PYCOLL_TUNE_FILE" \
    --sizes 8,4K,32K,64K,128K,256K,512K,1M,4M,16M --iters 10
  mv "$PYCOLL_TUNE_FILE.points.json" "$out/tuning_2hosts.points.json"
fi
common=(--np 4 --peers pycoll -C allreduce --inplace out --algos all --interleave --rounds 3 --no-progress)
sweep() {  # NAME ARGS...: one JSON and one console table per sweep
  local name=$1; shift
  python -m pycoll perf "${common[@]}" "$@" --json "$out/$name.json" > "$out/$name.txt"
}
sweep allreduce_1host_4ranks_small -b 8 -e 512K -n 60 -w 5
sweep allreduce_1host_4ranks_large -b 1M -e 64M -n 20 -w 5
sweep allreduce_2hosts_2x2_1gbit_small --hosts 2 --link-rate 1gbit -b 8 -e 512K -n 40 -w 3
sweep allreduce_2hosts_2x2_1gbit_large --hosts 2 --link-rate 1gbit -b 1M -e 64M -n 10 -w 2
python perf/algo_selection.py "$out"/allreduce_1host_4ranks_{small,large}.json \
  "$out"/allreduce_2hosts_2x2_1gbit_{small,large}.json | tee "$out/selection.txt"
