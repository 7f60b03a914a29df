#!/usr/bin/env bash
# The first thing a lent GPU runs: one command, at most ~5 minutes, most valuable figures first,
# every figure in one JSON ($OUT/bench.json). Not yet run on a GPU.
#
#   OUT=some/dir bash scripts/gpu_check.sh      # the device tool provides $OUT
#
# Steps, in order of value (each a separate process with its own time limit, so a failure or a
# hang still leaves the earlier figures; bench.py merges its figures into the JSON as it goes):
#   1. flex    flex attention vs SDPA on the document mask, forward AND backward (never run
#              anywhere before: CPU flex has no backward), bf16 and fp32, and their times
#   2. steps   compiled (fullgraph) bf16 training steps of SMELT, MoE, PLT and dense configs:
#              compile seconds, graph count, host syncs per step, loss vs eager, MoE kernel
#   3. mfu     tokens/s and MFU of the small preset's matched Baseline / SMELT pair, compiled
#   4. decode  batch-1 decode: unlooped vs sequential 2-loop vs PLT 2-loop
#   5. pytest  the CUDA-only tests (flex vs SDPA, eager flex memory, one graph and no syncs)
# The limits add up to GPU_CHECK_SECONDS (default 290); a step starts only with >= 20 s left.
# Each step's exit status and seconds go to the JSON's "gpu_check" entry; the exit status is 1
# when any step failed, 2 (with a message) on a machine where torch sees no GPU.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/gpu_check}
mkdir -p "$OUT"
if ! python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_check: no CUDA device visible to torch (this check needs a GPU; install a CUDA torch wheel, see the README)" >&2
    exit 2
fi
JSON="$OUT/bench.json"   # bench.py --out-dir "$OUT" merges its figures into the same file
BUDGET=${GPU_CHECK_SECONDS:-290}
T0=$(date +%s)
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
step() {     # step NAME LIMIT COMMAND...: run with min(LIMIT, time left), keep its output, record it
    local name=$1 limit=$2; shift 2
    local left=$(( BUDGET - ($(date +%s) - T0) ))
    if [ "$left" -lt 20 ]; then
        echo "== $name: skipped (${left}s of the budget left)"
        record "$name" 125 0
        failed="$failed $name"
        return
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    echo "== $name (limit ${limit}s)"
    local t=$(date +%s)
    timeout --kill-after=5 "$limit" "$@" > "$OUT/$name.txt" 2>&1
    local rc=$?
    tail -n 15 "$OUT/$name.txt"
    echo "== $name: exit $rc after $(( $(date +%s) - t ))s"
    record "$name" "$rc" "$(( $(date +%s) - t ))"
    [ "$rc" -eq 0 ] || failed="$failed $name"
}
{ nvidia-smi; python -c "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name())"; } \
    > "$OUT/machine.txt" 2>&1
head -n 20 "$OUT/machine.txt"
step flex 50 python bench.py flex --out-dir "$OUT"
step steps 100 python bench.py steps --out-dir "$OUT"
step mfu 100 python bench.py train --out-dir "$OUT"
step decode 40 python bench.py decode --out-dir "$OUT"
step pytest 100 python -m pytest -q -x -rs -k cuda tests/test_model.py tests/test_moe.py
echo "gpu_check: figures in $JSON ($(( $(date +%s) - T0 ))s in all)"
if [ -n "$failed" ]; then
    echo "gpu_check: failed or skipped:$failed" >&2
    exit 1
fi
