#!/usr/bin/env bash
# Sets up (if needed), builds, and runs every test with ctest. Multi-process tests use one intra-op thread
# per process and ports picked at run time; each test has a timeout.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=${SMP_BUILD:-$repo/build}
"$repo/scripts/setup.sh"
export OMP_NUM_THREADS=1
ctest --test-dir "$build" --output-on-failure --timeout 900 "$@"
