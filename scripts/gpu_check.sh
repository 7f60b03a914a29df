#!/usr/bin/env bash
# The first thing a lent GPU runs: one command, at most GPU_CHECK_SECONDS (default 560: a 10-minute device
# command with margin), most valuable figures first, every figure in one JSON ($OUT/bench.json) as soon as
# it is measured. Not yet run on a GPU.
#
#   OUT=some/dir bash scripts/gpu_check.sh      # the device tool provides $OUT
#
# Two cold processes (each compiles from cold; why the limits: docs/gpu.md):
#   1. bench   one `python -m lab.bench flex steps train decode --budget-s S`: each benchmark under a limit
#              computed from what is left (bench.LIMITS), partial figures merged into the JSON as they come:
#      flex    flex attention vs SDPA on the document mask, forward AND backward, bf16 and fp32, and
#              their times; the first (compiling) call timed apart
#      steps   compiled (fullgraph) bf16 training steps of SMELT, MoE, PLT and dense configs: compile
#              seconds apart from step time, training graphs, host syncs per step, loss vs eager, MoE kernel
#      train   tokens/s and MFU of the small preset's matched Baseline / SMELT pair, compiled
#      decode  batch-1 decode: unlooped vs sequential 2-loop vs PLT 2-loop
#   2. pytest  the CUDA-only tests (flex vs SDPA, eager flex memory, one graph and no syncs, scoring
#              compiles nothing), with what is left (at least PYTEST_SECONDS, default 120, is kept for it)
# Each step's exit status and seconds go to the JSON's "gpu_check" entry; the exit status is 1 when any
# step failed, 2 (with a message) on a machine where torch sees no GPU.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/gpu_check}
mkdir -p "$OUT"
T0=$(date +%s)
BUDGET=${GPU_CHECK_SECONDS:-560}
PYTEST_S=${PYTEST_SECONDS:-120}
JSON="$OUT/bench.json"   # bench.py --out-dir "$OUT" merges its figures into the same file
if ! python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_check: no CUDA device visible to torch (this check needs a GPU; install a CUDA torch wheel, see the README)" >&2
    exit 2
fi
failed=""
record() {   # record NAME RC SECONDS: the step's outcome under "gpu_check" in the JSON
    python - "$JSON" "$1" "$2" "$3" <<'PY'
import json, os, sys
path, name, rc, secs = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
d = json.load(open(path)) if os.path.exists(path) else {}
d.setdefault("gpu_check", {})[name] = {"rc": rc, "seconds": secs,
                                       "status": {0: "ok", 124: "timed out", 137: "killed"}.get(rc, "failed")}
json.dump(d, open(path + ".tmp", "w"), indent=2)
os.replace(path + ".tmp", path)
PY
}
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
step() {     # step NAME LIMIT COMMAND...: run under LIMIT seconds, keep its output, record it
    local name=$1 limit=$2; shift 2
    if [ "$limit" -lt 20 ]; then
        echo "== $name: skipped (${limit}s left for it)"
        record "$name" 125 0
        failed="$failed $name"
        return
    fi
    echo "== $name (limit ${limit}s)"
    local t=$(date +%s)
    timeout --kill-after=5 "$limit" "$@" > "$OUT/$name.txt" 2>&1
    local rc=$?
    tail -n 25 "$OUT/$name.txt"
    echo "== $name: exit $rc after $(( $(date +%s) - t ))s"
    record "$name" "$rc" "$(( $(date +%s) - t ))"
    [ "$rc" -eq 0 ] || failed="$failed $name"
}
{ nvidia-smi; python -c "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name())"; } \
    > "$OUT/machine.txt" 2>&1
head -n 20 "$OUT/machine.txt"
# bench's own limits end 15 s before the outer timeout, so it records its timeouts itself
BENCH_S=$(( $(left) - PYTEST_S - 5 ))
step bench "$BENCH_S" python -m lab.bench flex steps train decode --out-dir "$OUT" --budget-s $(( BENCH_S - 15 ))
step pytest $(( $(left) - 5 )) python -m pytest -q -x -rs -k cuda tests/test_model.py tests/test_moe.py \
    tests/test_attention_consumers.py
echo "gpu_check: figures in $JSON ($(( $(date +%s) - T0 ))s in all)"
if [ -n "$failed" ]; then
    echo "gpu_check: failed or skipped:$failed" >&2
    exit 1
fi
