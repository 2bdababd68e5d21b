#!/bin/bash
# The GPU checks in one run, for a machine with a GPU and jax[cuda] installed (none
# of fleet's tests needs one). Prints the versions, installs this checkout without
# its dependencies, runs the GPU benchmarks, then the default tier on the machine's
# CPUs (its usual 8 fake devices). Each step writes its output to $OUT (default
# ./gpu-out) and has its own time limit, so one that hangs costs only its own.
#
#     bash benchmarks/gpu.sh                 # PY=python3 OUT=gpu-out WORKERS=8
set -o pipefail
export PYTHONUNBUFFERED=1
PY=${PY:-python3}
OUT=${OUT:-gpu-out}
cd "$(dirname "$0")/.."
mkdir -p "$OUT"
{
  date; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  $PY -c 'import sys, jax, jaxlib, flax, optax, orbax.checkpoint as oc, numpy
print(sys.version.split()[0], "jax", jax.__version__, "jaxlib", jaxlib.__version__, "flax",
      flax.__version__, "optax", optax.__version__, "orbax", oc.__version__, "numpy",
      numpy.__version__, jax.devices())'
  nproc
} 2>&1 | tee "$OUT/env.txt"
# (no network there: the dependencies are the machine's own; fleetrun for the tests' jobs)
$PY -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/install.txt" 2>&1 \
  || echo "pip install failed: see $OUT/install.txt" | tee -a "$OUT/env.txt"
export PYTHONPATH=$PWD
for cmd in "benchmarks/stage3.py --platform gpu --devices 1 --drift 16" \
           "benchmarks/stage3.py --platform gpu --devices 1 --drift 16 --precision highest" \
           "benchmarks/step_overhead.py --platform gpu" \
           "benchmarks/strategy.py --device-count 1" \
           "benchmarks/strategy.py --device-count 1 --models mlp --batch-scale 32" \
           "benchmarks/stage3.py --platform gpu --devices 1"; do
  echo "=== $cmd" | tee -a "$OUT/bench.txt"
  start=$(date +%s)
  timeout "${BENCH_LIMIT:-150}" $PY $cmd 2>&1 | grep -v "^  \.\.\. " | tee -a "$OUT/bench.txt"
  echo "=== exit $? in $(( $(date +%s) - start )) s" | tee -a "$OUT/bench.txt"
done
start=$(date +%s)
JAX_PLATFORMS=cpu timeout "${TIER_LIMIT:-300}" $PY -m pytest -q -p no:cacheprovider \
  -n "${WORKERS:-8}" --timeout 200 > "$OUT/tier.txt" 2>&1
echo "=== default tier: exit $? in $(( $(date +%s) - start )) s" | tee -a "$OUT/tier.txt"
tail -3 "$OUT/tier.txt"
