#!/usr/bin/env bash
# Sets up (if needed), builds, and runs every test with ctest. Multi-process tests use one intra-op thread
# per process and ports picked at run time; each test has a timeout. As many tests at once as the machine has
# cores (CTEST_PARALLEL_LEVEL overrides): a job waiting on its peers leaves a core to another test's (on 2 cores,
# three at once gained nothing over two). At most 8: a test's job runs up to 8 ranks of several hundred MB each.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=${SMP_BUILD:-$repo/build}
"$repo/scripts/setup.sh"
# Counted before OMP_NUM_THREADS is set: GNU nproc reports OMP_NUM_THREADS when it is set, which ran every test alone.
cores=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)
export OMP_NUM_THREADS=1
ctest --test-dir "$build" --output-on-failure --timeout 900 --parallel "${CTEST_PARALLEL_LEVEL:-$((cores < 8 ? cores : 8))}" "$@"
