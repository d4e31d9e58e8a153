#!/usr/bin/env bash
# The GPU (or TPU) figures of BENCHMARKS.md in one call of under 8 minutes. Everything goes to $OUT (or
# runs/gpu-bench): log.txt, the benchmark tables bench-*.md, and the run directories packed in runs.tar.gz.
# From the repository root, with the project importable (installed, or PYTHONPATH=.):
#   TFDS_DATA_DIR=/path/to/tfds bash experiments/gpu_bench.sh
# Steps, most important first; each has its own time limit, so one that runs long costs only itself:
#   1. pFedKDH, MNIST α = 0.1, paper preset, all 50 rounds, one repetition (accuracy and s/round);
#   2. the same with 5 Monte Carlo repetitions in one vmapped program (mean ± std, s/round);
#   3. benchmarks.py sections floor, reps and pooling, then forms (synthetic clients);
#   4. only if METHODS is set (e.g. METHODS="fedbabu pfedme fedala"): 6 rounds of each named method on
#      the same data, 60 s each (one process per method; start-up and compilation take 25-30 s).
# A machine without tensorflow-datasets reads MNIST from a copied decoded-array cache: copy the data dir
# and the cache dir (~/.cache/pfedkdh_jax) there and set PFEDKDH_CACHE_DIR too.
# Without TFDS_DATA_DIR, steps 1-2 use the offline digits demo set. ROUNDS=N shortens steps 1-2 and
# LIMIT=S scales every time limit (seconds of the first step), for a dry run on a CPU.
set -uo pipefail
out="${OUT:-runs/gpu-bench}"
py="${PYTHON:-python3}"
rounds="${ROUNDS:-50}"
limit="${LIMIT:-150}"
log="$out/log.txt"
mkdir -p "$out/runs"
export PYTHONUNBUFFERED=1
"$py" -c "import jax, flax, optax; print('jax', jax.__version__, 'flax', flax.__version__, 'optax',
optax.__version__, jax.devices())" 2>&1 | tee "$log" || exit 1

if [ -n "${TFDS_DATA_DIR:-}" ]; then
  data=(--dataset mnist --preset paper --rounds "$rounds" --ea-every 5)
else
  data=(--dataset digits --rounds "$rounds")
fi
step() {  # step NAME SECONDS COMMAND...: runs COMMAND under a time limit, logs its output and exit status
  local name=$1 secs=$2 t0 rc
  shift 2
  t0=$(date +%s)
  echo "== $name: $*" | tee -a "$log"
  timeout "$secs" "$@" 2>&1 | tee -a "$log" | tail -25
  rc=$?
  echo "== $name: exit $rc after $(( $(date +%s) - t0 )) s" | tee -a "$log"
  return $rc
}
run=("$py" -m pfedkdh_jax run --checkpoint-every 0 --no-progress "${data[@]}")
step "reps 1" "$limit" "${run[@]}" --reps 1 --out "$out/runs/reps1"
rc=$?
# a failure other than the time limit means the set-up is broken: stop, so the call costs little
if [ "$rc" -ne 0 ] && [ "$rc" -ne 124 ]; then tar -czf "$out/runs.tar.gz" -C "$out" runs; exit "$rc"; fi
step "reps 5" $(( limit * 9 / 10 )) "${run[@]}" --reps 5 --reps-mode vmap --out "$out/runs/reps5"
floor_run=()
[ -f "$out/runs/reps1/summary.json" ] && floor_run=(--run-dir "$out/runs/reps1")
step "floor,reps,pooling" $(( limit * 6 / 10 )) "$py" experiments/benchmarks.py --only floor,reps,pooling \
  "${floor_run[@]}" --write "$out/bench-floor.md"
step "forms" $(( limit * 6 / 10 )) "$py" experiments/benchmarks.py --only forms --write "$out/bench-forms.md"
for m in ${METHODS:-}; do
  step "method $m" $(( limit * 4 / 10 )) "${run[@]}" --method "$m" --rounds 6 --eval-every 100 --ea-every 100 \
    --out "$out/runs/method-$m"
done
tar -czf "$out/runs.tar.gz" -C "$out" runs && rm -rf "$out/runs"
