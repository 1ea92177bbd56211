#!/usr/bin/env bash
# DDP step time (perf/results/ddp-step) of the README's example model with the pycoll backend against gloo,
# on 2 local ranks, both trained in the same processes from the same seed (examples/ddp_mlp.py --compare).
set -euo pipefail
cd "$(dirname "$0")/.."
out=perf/results/ddp-step
mkdir -p "$out"
steps=${STEPS:-200}
for run in 1 2 3; do
  OMP_NUM_THREADS=1 python -m pycoll run -n 2 -- python examples/ddp_mlp.py --steps "$steps" --compare gloo \
    --json "$out/ddp_step_run$run.json" > /dev/null
done
python - "$out" <<'PY'
import json, sys, pathlib, statistics
out = pathlib.Path(sys.argv[1])
runs = [json.loads(p.read_text()) for p in sorted(out.glob("ddp_step_run*.json"))]
lines = ["| run | steps | pycoll median step (ms) | gloo median step (ms) | gloo / pycoll | params allclose |", "|---|---:|---:|---:|---:|---|"]
for i, r in enumerate(runs, 1):
    p, g = r["pycoll"]["median_step_ms"], r["gloo"]["median_step_ms"]
    lines.append(f"| {i} | {r['steps']} | {p:.2f} | {g:.2f} | {g / p:.2f} | {r['params_allclose']} |")
p = statistics.median(r["pycoll"]["median_step_ms"] for r in runs)
g = statistics.median(r["gloo"]["median_step_ms"] for r in runs)
lines.append(f"| median | | {p:.2f} | {g:.2f} | {g / p:.2f} | |")
(out / "ddp_step.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
PY
