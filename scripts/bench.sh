#!/usr/bin/env bash
# Benchmarks (CPU): pipeline of 2 stages, one process and one thread each, m = 8, against one process with one
# thread training the same model on the same global batch. Prints the throughput ratio and the efficiency
# against the ideal m/(m+p-1)*p. Sets up and builds first, like the other scripts.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=${SMP_BUILD:-$repo/build}
"$repo/scripts/setup.sh"
export OMP_NUM_THREADS=1
bin=$build/bin
steps=${SMP_BENCH_STEPS:-10}
single=$("$bin/smprun" -n 1 --no-prefix -- "$bin/bench_pipeline" --config "$repo/bench/single_process.json" --steps "$steps" 2>/dev/null | grep '^{')
piped=$("$bin/smprun" -n 2 --no-prefix -- "$bin/bench_pipeline" --config "$repo/bench/pipeline_2stage.json" --steps "$steps" 2>/dev/null | grep '^{')
echo "single process:    $single"
echo "2-stage pipeline:  $piped"
python3 - "$single" "$piped" <<'PY'
import json, sys
single, piped = json.loads(sys.argv[1]), json.loads(sys.argv[2])
p, m = piped["partitions"], piped["microbatches"]
ratio = piped["samples_per_s"] / single["samples_per_s"]
ideal = m / (m + p - 1) * p
print(f"throughput ratio {ratio:.3f} (ideal m/(m+p-1)*p = {ideal:.3f}), efficiency {ratio / ideal:.1%}")
PY
