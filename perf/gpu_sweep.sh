#!/usr/bin/env bash
# Issue 9 on a lent GPU: the GPU test suite, then `pycoll perf --device cuda` sweeps (pycoll on 2, 4 and 8 ranks
# sharing one GPU, NCCL where it can run), with the device-to-device copy as the limit line. Results (JSON, console
# tables, PNGs, the commands) go to perf/results/gpu-<date>/.
#
# Usage: bash perf/gpu_sweep.sh [PART...]   PART: env tests nccl np2 np4 np8 gloo plot all (default all)
#
# The device tool (/work/.library/device/README.md) stops a command after 600 s and lends 30 minutes in all, so
# run it there in three calls, in this order, each with the same date so that the parts share one folder:
#   GPU_SWEEP_DATE=2026-11-24 bash perf/gpu_sweep.sh tests          # pytest -m gpu (a few minutes)
#   GPU_SWEEP_DATE=2026-11-24 bash perf/gpu_sweep.sh nccl np2 np4   # NCCL and pycoll at 1 rank (NCCL's skips at
#                                                                   # 2, 4, 8), then pycoll on 2 and 4 ranks
#   GPU_SWEEP_DATE=2026-11-24 bash perf/gpu_sweep.sh np8            # pycoll, 8 ranks on one GPU
# (pycoll sweeps: allreduce, 1 KiB .. 1 GiB, out of place and in place.) After every part the folder is packed into
# $OUT/gpu-<parts>.tar.gz (when $OUT is set, as it is there), which comes back to this machine even if a later
# part is cut off; unpack each in the repository root (tar xzf FILE), then draw the charts here:
#   GPU_SWEEP_DATE=2026-11-24 bash perf/gpu_sweep.sh plot
# and commit perf/results/gpu-<date>/.
#
# What the machine has: its image's python3 holds torch with CUDA, CuPy (cupy-cuda13x), numba, ml_dtypes,
# matplotlib, pytest and pytest-timeout, so nothing is installed there and pycoll runs from this checkout
# (PYTHONPATH), not from `pip install .` (whose pinned versions would need the network). Nothing outside the
# machine can be reached. A package that is missing there must travel as a wheel: here, in the repository root,
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl NAME==VERSION
# then name `.whl` in the tool's `carry` (64 MiB at most with the tree: torch's CUDA wheels do not fit, CuPy's
# barely). This script installs whatever is in .whl/ into /tmp/site first. On a machine with a package index it
# pip-installs what is missing instead: the `cuda` extra's cupy-cuda12x, and a CUDA build of torch.
#
# Knobs: PYCOLL_IPC_BYTES (default: GPU_SWEEP_MAXBYTES), GPU_SWEEP_DATE (folder name), GPU_SWEEP_RESULTS (the folder itself), GPU_SWEEP_MAXBYTES (1G),
# GPU_SWEEP_ITERS (20), GPU_SWEEP_WARMUP (5), GPU_SWEEP_JOB_TIMEOUT (seconds per job, 420: a job cut short keeps
# the points it measured), PYTHON (python3). GPU_SWEEP_SIM=1 is a dry run without a GPU: numba's simulator, no
# installs (e.g. GPU_SWEEP_SIM=1 GPU_SWEEP_MAXBYTES=4K GPU_SWEEP_RESULTS=/tmp/g bash perf/gpu_sweep.sh nccl np2).

set -u -o pipefail
PARTS=("${@:-all}")
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT" || exit 2
PY=${PYTHON:-python3}
if [ -z "${PYTHON:-}" ] && [ "${PARTS[*]}" = plot ] && [ -x .venv/bin/python ]; then PY=.venv/bin/python; fi
DATE=${GPU_SWEEP_DATE:-$(date -u +%Y-%m-%d)}
RES=${GPU_SWEEP_RESULTS:-perf/results/gpu-$DATE}
MAXB=${GPU_SWEEP_MAXBYTES:-1G}
ITERS=${GPU_SWEEP_ITERS:-20}
WARM=${GPU_SWEEP_WARMUP:-5}
JOB_TIMEOUT=${GPU_SWEEP_JOB_TIMEOUT:-420}
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 PYCOLL_TIMEOUT=${PYCOLL_TIMEOUT:-300}
# The CUDA IPC allreduce takes calls up to the sweep's largest size (the default, 8M, stages larger ones), so that
# issue 9's figure, IPC allreduce busbw against the copy line at 64 MiB and more, is measured.
export PYCOLL_IPC_BYTES=${PYCOLL_IPC_BYTES:-$MAXB}
if [ "${GPU_SWEEP_SIM:-0}" = 1 ]; then
    export NUMBA_ENABLE_CUDASIM=1
else
    unset NUMBA_ENABLE_CUDASIM  # the real device, never the simulator
fi
mkdir -p "$RES"
STATUS=0

log() { echo "[gpu_sweep $(date -u +%H:%M:%S)] $*" >&2; }

# Run a command; keep it in $RES/<name>.cmd and its console output in $RES/<name>.txt. A failure is recorded, not
# fatal. (One file per step: the parts run on separate machines, and their folders are merged when unpacked.)
step() {
    local name=$1
    shift
    echo "$*" >"$RES/$name.cmd"
    log "$name: $*"
    "$@" 2>&1 | tee "$RES/$name.txt"
    local rc=${PIPESTATUS[0]}
    [ "$rc" -eq 0 ] || { log "$name: exit $rc"; STATUS=1; }
    return 0
}

install_missing() {
    if compgen -G ".whl/*.whl" >/dev/null; then
        log "installing the carried wheels: $(ls .whl | tr '\n' ' ')"
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
            && export PYTHONPATH="$PYTHONPATH:/tmp/site"
    fi
    local want=() mod
    for mod in numpy:numpy ml_dtypes:ml_dtypes==0.6.0 numba:numba==0.68.1 cupy:cupy-cuda12x==14.2.0 \
               matplotlib:matplotlib==3.11.2 pytest:pytest==9.2.0 pytest_timeout:pytest-timeout==2.4.0; do
        "$PY" -c "import ${mod%%:*}" 2>/dev/null || want+=("${mod#*:}")
    done
    if [ ${#want[@]} -gt 0 ]; then
        log "missing: ${want[*]}; trying pip (fails at once where no index can be reached)"
        timeout 300 "$PY" -m pip install -q --retries 0 --timeout 10 "${want[@]}" || log "pip could not install ${want[*]}"
    fi
    if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
        log "torch has no CUDA here; trying a CUDA build (else the nccl peer uses cupy.cuda.nccl or is skipped)"
        timeout 400 "$PY" -m pip install -q --retries 0 --timeout 10 torch \
            --index-url https://download.pytorch.org/whl/cu126 || log "no CUDA torch: gloo/nccl through torch skipped"
    fi
}

env_report() {
    [ -s "$RES/env.txt" ] && return 0
    {
        echo "# $(date -u +%Y-%m-%dT%H:%M:%SZ) $(uname -srm), $(nproc) CPUs, $(free -g | awk '/Mem:/{print $2}') GiB"
        nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 || echo "no nvidia-smi"
        "$PY" - <<'EOF'
import importlib, sys
print("python", sys.version.split()[0])
for name in ("numpy", "numba", "ml_dtypes", "cupy", "torch", "matplotlib", "pytest"):
    try:
        print(name, importlib.import_module(name).__version__)
    except Exception as exc:
        print(name, "missing:", type(exc).__name__, exc)
try:
    import torch
    print("torch cuda", torch.version.cuda, "devices", torch.cuda.device_count(),
          "nccl", torch.cuda.nccl.version() if torch.cuda.is_available() else None)
except Exception as exc:
    print("torch cuda: ", exc)
try:
    from cupy.cuda import nccl
    print("cupy nccl", nccl.get_version())
except Exception as exc:
    print("cupy nccl: ", type(exc).__name__, exc)
from pycoll.perf import devices, peers
print("numba.cuda:", devices.numba_cuda_missing() or "ok", "| nccl route:", peers.nccl_route())
EOF
    } >"$RES/env.txt" 2>&1
    cat "$RES/env.txt" >&2
}

perf() {  # perf NAME ARGS...: one `pycoll perf --device cuda` sweep into $RES/NAME.json
    local name=$1
    shift
    step "$name" "$PY" -m pycoll perf --device cuda -b 1K -e "$MAXB" -f 2 -n "$ITERS" -w "$WARM" \
        --timeout "$JOB_TIMEOUT" --no-progress --json "$RES/$name.json" "$@"
}

summary() {  # commands.txt (every step, in run order) and summary.md (one line per sweep job) from the merged folder
    local n
    for n in tests nccl_np1 nccl_skips pycoll_np2 pycoll_np4 pycoll_np8 gloo_np2 plot plot_inplace; do
        [ -f "$RES/$n.cmd" ] && cat "$RES/$n.cmd"
    done >"$RES/commands.txt"
    "$PY" - "$RES" >"$RES/summary.md" <<'EOF'
import json, pathlib, sys
res = pathlib.Path(sys.argv[1])
print("| file | peer | ranks | largest | busbw out / in (GB/s) | wrong | limit copy (GB/s) |")
print("|---|---|---|---|---|---|---|")
for f in sorted(res.glob("*.json")):
    data = json.loads(f.read_text())
    limit = data.get("limits", {}).get("copy_GBps", "-")
    jobs = {}
    for r in data["records"]:
        jobs.setdefault((r["peer"], r["nranks"]), []).append(r)
    for (peer, n), recs in sorted(jobs.items()):
        top = max(r["bytes"] for r in recs)
        bw = {r["inplace"]: r["busbw_GBps"] for r in recs if r["bytes"] == top}
        print(f"| {f.name} | {peer} | {n} | {top >> 10} KiB | {bw.get(False, '-')} / {bw.get(True, '-')} | "
              f"{sum(r['wrong'] for r in recs)} | {limit} |")
    for s in data["meta"].get("jobs_skipped", []):
        print(f"| {f.name} | {s['peer']} | {s['nranks']} | skipped: {s['reason']} | | | |")
    for peer, why in data["meta"].get("peers_skipped", {}).items():
        print(f"| {f.name} | {peer} | | unavailable: {why} | | | |")
EOF
    cat "$RES/summary.md" >&2
}

part() {
    case $1 in
        env) env_report ;;
        tests)
            step tests timeout 570 "$PY" -m pytest -m gpu -q -W ignore -p no:cacheprovider -rs tests ;;
        nccl)  # NCCL takes one GPU per rank: 1 rank here; at 2, 4 and 8 the JSON records why it was skipped
            perf nccl_np1 --np 1 --peers pycoll,nccl -C allreduce
            perf nccl_skips --np 2,4,8 --peers nccl -C allreduce ;;
        np2 | np4 | np8)
            perf "pycoll_$1" --np "${1#np}" --peers pycoll -C allreduce ;;
        gloo)  # torch's gloo on CUDA tensors (it stages through the host too): not in the device-tool sequence
            perf gloo_np2 --np 2 --peers pycoll,gloo -C allreduce -e 256M ;;
        plot)
            local files=("$RES"/*.json)
            step plot "$PY" -m pycoll plot "${files[@]}" --out "$RES/plots"
            step plot_inplace "$PY" -m pycoll plot "${files[@]}" --out "$RES/plots-inplace" --inplace in
            summary ;;
        all) for q in env tests nccl np2 np4 np8 gloo plot; do part "$q"; pack; done ;;
        *) echo "unknown part $1: env tests nccl np2 np4 np8 gloo plot all" >&2; exit 2 ;;
    esac
}

pack() {  # the device tool brings $OUT back; one file holds the whole folder
    if [ -n "${OUT:-}" ] && [ -d "${OUT}" ]; then
        local name
        name=gpu-$(IFS=-; echo "${PARTS[*]}").tar.gz
        tar czf "$OUT/$name" "$RES" && log "packed $RES into \$OUT/$name"
    fi
}

if [ "${PARTS[*]}" != plot ]; then
    [ "${GPU_SWEEP_SIM:-0}" = 1 ] || install_missing
    env_report
fi
for p in "${PARTS[@]}"; do
    part "$p"
    pack
done
exit $STATUS
