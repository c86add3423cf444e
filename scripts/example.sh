#!/usr/bin/env bash
# Sets up (if needed), builds, and runs the hybrid example: 2 data-parallel replicas x 4 pipeline stages of a
# small GPT on Debian's fortunes corpus, as 8 local processes on the CPU. Extra arguments go to the example
# (e.g. --steps 50). A first argument --python runs the same job written in Python (examples/python/hybrid_2x4.py,
# through the smp package) instead of C++.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=${SMP_BUILD:-$repo/build}
"$repo/scripts/setup.sh"
# 8 processes share this machine's cores: one intra-op thread each unless the caller says otherwise.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
if [ "${1:-}" = --python ]; then
  shift
  venv=${SMP_VENV:-$HOME/.cache/smp/venv}
  export PYTHONPATH="$build/python${PYTHONPATH:+:$PYTHONPATH}"
  exec "$build/bin/smprun" -n 8 -- "$venv/bin/python" "$repo/examples/python/hybrid_2x4.py" \
    --config "$repo/examples/hybrid_2x4.json" "$@"
fi
exec "$build/bin/smprun" -n 8 -- "$build/bin/hybrid_2x4" --config "$repo/examples/hybrid_2x4.json" "$@"
