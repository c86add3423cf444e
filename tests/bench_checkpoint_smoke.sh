#!/bin/bash
# The checkpoint benchmark at a small size, 2 ranks: a benchmark that rots (it drew its batch apart on each rank,
# and held two Checkpointers at once) is found by the tests, not by the next long scripts/bench.sh run.
# Usage: bench_checkpoint_smoke.sh BIN_DIR
set -euo pipefail
bin=$1
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
cat > "$dir/config.json" <<JSON
{"smp": {"partitions": 2, "microbatches": 2, "global_batch_size": 4, "seed": 1, "checkpoint_dir": "$dir/checkpoints",
         "comm_timeout_s": 60},
 "model": {"vocab_size": 64, "context": 16, "d_model": 32, "heads": 2, "layers": 2}}
JSON
output=$(OMP_NUM_THREADS=1 timeout 120 "$bin/smprun" -n 2 --no-prefix --timeout 100 -- \
  "$bin/bench_checkpoint" --config "$dir/config.json" 2>&1) || { echo "$output"; exit 1; }
echo "$output" | grep -q '"save_mb_per_s"' || { echo "no result line:"; echo "$output"; exit 1; }
echo "$output" | grep '"save_mb_per_s"'
