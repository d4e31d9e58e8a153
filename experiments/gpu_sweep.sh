#!/usr/bin/env bash
# Issue 12's accelerator figures in one device call (at most BUDGET = 560 s: step 3 gets what is left). Here, first:
#   python experiments/gpu_sweep.py prepare runs/gpu-data --data-dir ../shared/data/tfds   # ~42 MiB
# then on the device, from the repository root, carrying runs/gpu-data:
#   bash experiments/gpu_sweep.sh
# Steps, most important first, each under its own time limit (LIMIT scales them; seconds of step 1):
#   0. the fp32 matmul rate, and the convolution forms with per-member weights (benchmarks.py convforms:
#      XLA's, grouped once vmapped, against the matmul over patches and Winograd's F(4x4, 5x5) for conv2;
#      choose --conv-form's GPU default: model.auto_conv_form);
#   1. pFedKDH, MNIST α = 0.1, paper preset, 5 seeds as one vmapped program, 50 rounds, packed lanes
#      (target: ≤ 20 s of training);
#   2. pFedKDH on all six MNIST / Fashion-MNIST cells (α 0.05, 0.1, 0.5) × 5 seeds as one stacked sweep
#      (target: ≤ 90 s wall clock with compilation; cut at 2 × LIMIT, its metrics.jsonl then say how far
#      it got), and its useful FLOPs as a fraction of the matmul rate;
#   T. the same CNN and partition in the PyTorch reference on the same GPU (experiments/cpu_vs_torch.py
#      --device cuda): FedPer and FedAvg, one seed and five (PyTorch's one after another, ours one
#      program), all 20 clients a round; the ratio of round times (issue 26, item 2);
#   P. a profile of 3 rounds of step 1's program (all 20 clients a round): the device's busy fraction, the
#      gaps between kernels, the kernels that take the time (gpu_sweep.py profile; PROFILE_THREADS=XLAEigen
#      counts the op threads in a CPU dry run);
#   3. the widest table the time left allows: every method but FedFed on the same cells × 5 seeds.
# Everything goes to $OUT (default runs/gpu-sweep): log.txt, and results.tar.gz with the sweep tables, the
# run summaries, vs-torch.md and the profile. The device call, from here:
#   run(command="bash experiments/gpu_sweep.sh", carry=["runs/gpu-data"], timeout_s=600)
# A dry run on a CPU: DATASETS=digits ALPHAS=0.5,1.0 ROUNDS=1 PRESET=default LANES= METHODS=fedper LIMIT=300 \
#   TORCH_DEVICE=cpu PROFILE_THREADS=XLAEigen BUDGET=900 bash experiments/gpu_sweep.sh
set -uo pipefail
# what comes back from the device (the tool returns at most 8 files, 2 folders down): $OUT/log.txt and
# $OUT/results.tar.gz (every result file, re-packed after each step); the results are written outside it
dest="${OUT:-runs/gpu-sweep}"
out="${SWEEP_WORK:-$( [ -n "${OUT:-}" ] && echo /tmp/gpu-sweep || echo "$dest/work" )}"
py="${PYTHON:-python3}"
limit="${LIMIT:-100}"
rounds="${ROUNDS:-50}"
preset="${PRESET:-paper}"
datasets="${DATASETS:-mnist,fashion_mnist}"
alphas="${ALPHAS:-0.05,0.1,0.5}"
lanes="${LANES-10}"   # LANES= (empty): no packing (a CPU dry run's sequential layout has none)
gpu_data="${GPU_DATA:-runs/gpu-data}"
budget="${BUDGET:-560}"   # seconds for the whole script: the device tool stops a call after 600
start_ns=$(date +%s%N)
left() { echo $(( budget - ($(date +%s%N) - start_ns) / 1000000000 )); }   # seconds left of the budget
cap() { local l=$(( $(left) - 25 )); [ "$1" -lt "$l" ] && l=$1; [ "$l" -lt 10 ] && l=10; echo "$l"; }   # $1, within the budget
log="$dest/log.txt"
mkdir -p "$out" "$dest"
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"   # the package from this checkout (not installed there)
save() { tar -czf "$dest/results.tar.gz" --exclude="*.xplane.pb" --exclude="*trace.json.gz" --exclude=checkpoints -C "$out" . 2>/dev/null; }
data=()
if [ -d "$gpu_data/tfds" ]; then
  export PFEDKDH_CACHE_DIR="$gpu_data/cache"
  data=(--data-dir "$gpu_data/tfds")
fi
step() {  # step NAME SECONDS COMMAND...: COMMAND under a time limit; its output and wall time logged
  local name=$1 secs=$2 t0 rc
  shift 2
  t0=$(date +%s%N)
  echo "== $name: $*" | tee -a "$log"
  timeout "$secs" "$@" 2>&1 | tee -a "$log" | tail -20
  rc=${PIPESTATUS[0]}
  echo "== $name: exit $rc after $(( ($(date +%s%N) - t0) / 1000000 )) ms" | tee -a "$log"
  save
  return "$rc"
}
"$py" -c "import jax, flax, optax; print('jax', jax.__version__, 'flax', flax.__version__, 'optax', optax.__version__, jax.devices())" 2>&1 | tee "$log" || exit 1
rate=$("$py" -c "
import sys; sys.path.insert(0, 'experiments')
from benchmarks import matmul_rate; print(matmul_rate())" 2>/dev/null | tail -1)
echo "matmul rate: $rate FLOP/s" | tee -a "$log"
step "0: convolution forms" $(( limit / 2 )) "$py" experiments/benchmarks.py --only convforms --write "$out/bench-convforms.md"

pack=()
[ -n "$lanes" ] && pack=(--lanes "$lanes")
common=(--preset "$preset" --rounds "$rounds" --reps-mode vmap --checkpoint-every 0 --no-progress "${data[@]}")
first=${datasets%%,*}
step "1: pfedkdh $first α=0.1 × 5 seeds stacked" "$limit" "$py" -m pfedkdh_jax run --dataset "$first" --alpha 0.1 \
  --reps 5 "${pack[@]}" --ea-every "$rounds" "${common[@]}" --out "$out/reps5"
"$py" -c "
import json; s = json.load(open('$out/reps5/summary.json'))
print('step 1: s/round', s.get('seconds_per_round'), 'compile s', s.get('compile_seconds'),
      'training s (rounds × s/round)', s.get('seconds_per_round', 0) * $rounds,
      'Fair', s.get('personalized_macro_accuracy'), 'EA', s.get('personalized_macro_accuracy_ea'))" 2>&1 | tee -a "$log"

t0=$(date +%s%N)
step "2: pfedkdh sweep, $datasets × α $alphas × 5 seeds, stacked" "$(cap $(( limit * 2 )))" "$py" -m pfedkdh_jax sweep \
  --datasets "$datasets" --alphas "$alphas" --methods pfedkdh --seeds 5 --stack "${pack[@]}" \
  --ea-every "$rounds" "${common[@]}" --out "$out/sweep-pfedkdh"
wall=$("$py" -c "print(($(date +%s%N) - $t0) / 1e9)")
echo "step 2: wall clock $wall s (with start-up and compilation)" | tee -a "$log"
[ -n "$rate" ] && "$py" experiments/gpu_sweep.py fraction "$out/sweep-pfedkdh" --seconds "$wall" --rate "$rate" 2>&1 | tee -a "$log"

# PyTorch on the same GPU; JAX gets half the GPU's memory (it would take 75 % at start-up) beside it
XLA_PYTHON_CLIENT_MEM_FRACTION=0.5 step "T: against PyTorch (${TORCH_DEVICE:-cuda})" "$(cap $(( limit * 3 / 2 )))" \
  "$py" experiments/cpu_vs_torch.py --datasets "$first" "${data[@]}" --methods fedper,fedavg --seeds 1,5 \
  --rounds 2 --device "${TORCH_DEVICE:-cuda}" "${pack[@]}" --write "$out/vs-torch.md"

step "P: profile" "$(cap $(( limit * 3 / 4 )))" "$py" experiments/gpu_sweep.py profile "$out/profile" "${data[@]}" \
  --dataset "$first" --alpha "${PROFILE_ALPHA:-0.1}" --seeds 5 ${lanes:+--lanes "$lanes"} \
  ${PROFILE_THREADS:+--threads-like "$PROFILE_THREADS"}

methods="${METHODS:-pfedkdh,fedavg,fedprox,ditto,pfedme,fedper,fedrep,fedbabu,fedproto,fedala,pfedsim}"
# the widest table gets what is left of the budget (less 20 s to print the tables), at most limit × 3
secs3=$(( $(left) - 20 ))
[ "$secs3" -gt $(( limit * 3 )) ] && secs3=$(( limit * 3 ))
if [ "$secs3" -lt 30 ]; then
  echo "== 3: skipped, ${secs3} s left of the ${budget} s budget" | tee -a "$log"
else
step "3: widest table ($methods)" "$secs3" "$py" -m pfedkdh_jax sweep --datasets "$datasets" \
  --alphas "$alphas" --methods "$methods" --seeds 5 --stack --ea-every "$rounds" "${common[@]}" \
  --eval-every 10 --out "$out/sweep-all"
fi
[ -f "$out/vs-torch.md" ] && cat "$out/vs-torch.md" | tee -a "$log"
for d in "$out"/sweep-*/; do [ -f "$d/table.md" ] && { echo "== $d"; cat "$d/table.md" "$d/costs.md"; } | tee -a "$log"; done
find "$out" -name checkpoints -type d -prune -exec rm -rf {} +
save
echo "results: $dest/results.tar.gz ($(du -h "$dest/results.tar.gz" | cut -f1))" | tee -a "$log"
