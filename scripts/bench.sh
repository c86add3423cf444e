#!/usr/bin/env bash
# Benchmarks (CPU): pipeline efficiency, schedules measured vs simulated, activation checkpointing memory,
# simulator at scale, checkpoint throughput. Sets up and builds first, like the other scripts.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=${SMP_BUILD:-$repo/build}
"$repo/scripts/setup.sh"
exec python3 "$repo/bench/run_benchmarks.py" "$build/bin"
