#!/usr/bin/env bash
# The GPU check (issue 17, item 8): one prepared script, at most 8 minutes, for a lent accelerator.
#   1. the model and MoE tests on the GPU (ragged_dot is the default there);
#   2. the bf16 train step at reference shapes A and B and at a ladder-rung shape (d 768, 8 layers,
#      384 experts top-8, latent 384, seq 4096, batch 4), ragged_dot against the batched blocks;
#   3. MFU against the device's published bf16 peak (moelab/devices.py), which `moelab bench
#      train-step` reports when it knows the device.
# Figures go to $OUT (or benchmarks/results/gpu_check/) as one JSON per run, with the date and
# device. Run from the repository root: bash benchmarks/gpu_check.sh
set -u
OUT=${OUT:-benchmarks/results/gpu_check}
mkdir -p "$OUT"
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY=python
deadline=$(( $(date +%s) + 470 ))
left() { echo $(( deadline - $(date +%s) )); }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > "$OUT/device.txt" 2>/dev/null || true
date -u +%Y-%m-%dT%H:%M:%SZ > "$OUT/date.txt"
echo "== model tests on the accelerator ($(left) s left)"
timeout 150 "$PY" -m pytest -q -p no:cacheprovider tests/test_model.py tests/test_moe.py -m "not slow" \
  > "$OUT/tests.txt" 2>&1; echo "tests exit $?" | tee -a "$OUT/tests.txt"
A="--d-model 256 --layers 4 --heads 8 --experts 16 --top-k 4 --expert-dim 128 --seq 256 --batch 8"
B="--d-model 512 --layers 8 --heads 8 --experts 64 --top-k 8 --expert-dim 256 --seq 512 --batch 8"
RUNG="--preset marin-ladder-d768 --batch 4 --dispatch dropless"
for shape in A B RUNG; do
  for impl in ragged blocks; do
    t=$(left); [ "$t" -lt 30 ] && { echo "out of time before $shape/$impl"; break 2; }
    echo "== $shape, moe_impl=$impl, bf16 ($t s left)"
    timeout $(( t < 120 ? t : 120 )) "$PY" -m moelab bench train-step --set model.moe_impl=$impl \
      ${!shape} --dtype bfloat16 --steps 10 --warmup 2 --json > "$OUT/${shape}_${impl}.json" 2> "$OUT/${shape}_${impl}.err"
    echo "exit $?"; tail -c 400 "$OUT/${shape}_${impl}.json"; echo
  done
done
echo "== done; figures in $OUT"
