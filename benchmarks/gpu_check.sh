#!/usr/bin/env bash
# The GPU check (issues 17 and 27): one prepared script, at most 8 minutes, for a lent accelerator.
#   0. issue 27: the defaults run on a GPU (`moelab train tiny` with compute_dtype auto = bf16 and
#      attention auto = cuDNN's fused kernel, 3 steps); the ladder rung's step as Marin runs it (bf16,
#      fused attention, capacity dispatch, remat each_layer) with its MFU; host offload placed by the
#      GPU compiler (train.offload=all: the compiled HLO's host-memory parameters and XLA's host bytes);
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
echo "== the defaults on a GPU: moelab train tiny, 3 steps ($(left) s left)"
timeout 90 "$PY" -m moelab train tiny --steps 3 --out "$OUT/run_tiny" --quiet > "$OUT/defaults.txt" 2>&1
echo "defaults exit $?" | tee -a "$OUT/defaults.txt"
grep -h '"compute_dtype"\|"attention' "$OUT/run_tiny/config.json" >> "$OUT/defaults.txt" 2>/dev/null
echo "== the d768 rung's step, bf16, fused attention, capacity dispatch, remat each_layer ($(left) s left)"
timeout 150 "$PY" -m moelab bench train-step --preset marin-ladder-d768 --batch 4 --dtype bfloat16 \
  --set model.attention_impl=cudnn --steps 10 --warmup 2 --json > "$OUT/rung_fused.json" 2> "$OUT/rung_fused.err"
echo "exit $?"; tail -c 600 "$OUT/rung_fused.json"; echo
echo "== host offload as the GPU compiler places it ($(left) s left)"
timeout 90 "$PY" - > "$OUT/offload.txt" 2>&1 <<'PYEOF'
import jax, numpy as np
from moelab.config import load_config, resolve_dtype
from moelab.train import optim
from moelab.plan.memory_check import host_buffers
from moelab.train.step import init_train_state, make_train_step, offload_state
for off in ("none", "all"):
    cfg = resolve_dtype(load_config("tiny", ["model.remat=each_layer", f"train.offload={off}"]))
    h = optim.hyper(cfg); opt = optim.make_optimizer(cfg, h)
    state = offload_state(init_train_state(cfg, opt), cfg)
    b = np.zeros((cfg.train.batch_size, cfg.model.seq_len + 1), np.int32)
    c = make_train_step(cfg, opt, h).lower(state, b, np.int32(0)).compile()
    args, outs = host_buffers(c.as_text())
    text = c.as_text()
    print(off, "host params", sum(args), "host results", sum(outs), "opt leaves", len(jax.tree.leaves(state["opt_state"])),
          "host copies in program", text.count("S(5)"), c.memory_analysis())
PYEOF
echo "offload exit $?"; cat "$OUT/offload.txt"
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
