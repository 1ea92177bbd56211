#!/usr/bin/env bash
# The long soak (perf/results/reliability): 10^5 small and 10^3 large (16 MiB) collectives on 2 ranks, over shared memory and TCP;
# RSS, open descriptors and /dev/shm entries sampled along the way (tests/faults/test_soak.py runs a short form).
set -euo pipefail
cd "$(dirname "$0")/.."
out=perf/results/reliability
mkdir -p "$out/soak-shm" "$out/soak-tcp"
python -m pycoll run -n 2 -- python tests/faults/soak_rank.py --small 100000 --large 1000 --out "$out/soak-shm"
PYCOLL_SHM_DISABLE=1 python -m pycoll run -n 2 -- python tests/faults/soak_rank.py --small 100000 --large 1000 --out "$out/soak-tcp"
python - "$out" <<'PY'
import json, sys
sys.path.insert(0, "tests/faults")
from soak_rank import growth
out = sys.argv[1]
for t in ("shm", "tcp"):
    for r in range(2):
        d = json.load(open(f"{out}/soak-{t}/soak{r}.json"))
        print(t, "rank", r, d["small"], "small", d["large"], "large", "in", d["samples"][-1]["t"], "s:", growth(d["samples"]))
PY
