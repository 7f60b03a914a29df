#!/usr/bin/env bash
# The GPU checks in one prepared run, sized for a 15-minute device session whose commands may
# run 10 minutes (the step limits add up to 9; not yet run on a GPU): the model, MoE and loop
# tests (the CUDA-vs-CPU test, which skips elsewhere, among them), every benchmark (MoE vs
# dense and torch._grouped_mm in bf16, PLT decode, training tokens/s and MFU of the small
# preset's matched pair, compiled), and the smoke reproduction end to end on the GPU (flex
# attention, bf16 autocast, torch.compile).
#
#   OUT=some/dir bash scripts/gpu_check.sh      # the device tool provides $OUT
#
# Each step has its own time limit and a failure does not stop the next (the exit status is 1
# when any step failed); everything it prints goes to $OUT/*.txt and the figures to
# $OUT/bench.json. Copy the figures into the README's Benchmarks table with the GPU's name.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/gpu_check}
mkdir -p "$OUT"
if ! python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_check: no CUDA device visible to torch (install a CUDA torch wheel; see the README)" >&2
    exit 2
fi
step() {   # step NAME SECONDS COMMAND...: run with a time limit, keep its output, report the status
    local name=$1 limit=$2; shift 2
    echo "== $name (limit ${limit}s)"
    timeout "$limit" "$@" > "$OUT/$name.txt" 2>&1
    local rc=$?
    tail -n 25 "$OUT/$name.txt"
    echo "== $name: exit $rc"
    [ "$rc" -eq 0 ] || failed="$failed $name"
}
failed=""
{ nvidia-smi; python -c "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name())"; } \
    > "$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"
step pytest_gpu 120 python -m pytest -q -x tests/test_model.py tests/test_moe.py tests/test_loop.py
step bench 300 python bench.py --json "$OUT/bench.json"
step reproduce_smoke 120 python reproduce.py --preset smoke --out "$OUT/smoke"
if [ -n "$failed" ]; then
    echo "gpu_check: failed:$failed" >&2
    exit 1
fi
