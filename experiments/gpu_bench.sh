#!/usr/bin/env bash
# The benchmark tables on a GPU (or TPU) machine, in well under 8 minutes; figures go to $OUT (or
# runs/gpu-bench). Usage, from the repository root, with the project installed:
#   bash experiments/gpu_bench.sh                 # synthetic clients + the digits demo set
#   TFDS_DATA_DIR=/path/to/tfds bash experiments/gpu_bench.sh   # + 5 rounds of MNIST, paper preset
set -euo pipefail
out="${OUT:-runs/gpu-bench}"
mkdir -p "$out"
python -c "import jax; print(jax.devices())" | tee "$out/devices.txt"
# layouts (GPU default: vmap + scan), pooling form, compute floor, repetitions in one program, peak
# device memory per layout
timeout 330 python experiments/benchmarks.py --only forms,pooling,floor,reps,memory --write "$out/BENCHMARKS.gpu.md" \
  2>&1 | tee "$out/benchmarks.log"
if [ -n "${TFDS_DATA_DIR:-}" ]; then
  for reps in 1 5; do
    timeout 150 pfedkdh run --dataset mnist --preset paper --rounds 5 --reps "$reps" --reps-mode vmap \
      --checkpoint-every 0 --no-progress --out "$out/mnist-reps$reps" 2>&1 | tail -8 | tee -a "$out/mnist.log"
  done
else
  timeout 120 pfedkdh run --rounds 10 --reps 5 --reps-mode vmap --checkpoint-every 0 --no-progress \
    --out "$out/digits-reps5" 2>&1 | tail -8 | tee -a "$out/digits.log"
fi
