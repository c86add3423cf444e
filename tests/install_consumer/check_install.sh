#!/usr/bin/env bash
# Installs smp from BUILD into a fresh prefix (cmake --install), builds the consumer program outside the tree against
# it with find_package(smp), and runs it on 2 pipeline stages and in one process with the installed smprun: the
# losses must agree.   check_install.sh BUILD
set -euo pipefail
build=$1
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cmake --install "$build" --prefix "$work/prefix" --component development > "$work/install.log"
test -f "$work/prefix/lib/cmake/smp/smpConfig.cmake"
generator=(); command -v ninja > /dev/null && generator=(-G Ninja)
# Through ccache where there is one, its paths taken relative to this run's fresh folder: the consumer includes
# LibTorch's headers, 20 s to compile on 2 cores, and compiles alike in every run.
launcher=()
command -v ccache > /dev/null && launcher=("-DCMAKE_CXX_COMPILER_LAUNCHER=cmake;-E;env;CCACHE_BASEDIR=$work;ccache")
# LibTorch is not named: smpConfig finds it through the python smp was built with, as for a user without an active
# virtual environment whose PATH's python3 lacks torch (the first found was taken, and failed).
env -u VIRTUAL_ENV cmake -S "$here" -B "$work/consumer" "${generator[@]}" "${launcher[@]}" -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$work/prefix" > "$work/configure.log" || { cat "$work/configure.log"; exit 1; }
cmake --build "$work/consumer" > "$work/build.log" || { cat "$work/build.log"; exit 1; }
cat > "$work/two.json" <<'JSON'
{"partitions": 2, "microbatches": 4, "pipeline": "interleaved", "seed": 3, "device": "cpu"}
JSON
cat > "$work/one.json" <<'JSON'
{"partitions": 1, "microbatches": 4, "seed": 3, "device": "cpu"}
JSON
export OMP_NUM_THREADS=1
"$work/prefix/bin/smprun" -n 2 --timeout 120 --no-prefix -- "$work/consumer/consumer" "$work/two.json" > "$work/two.txt"
"$work/prefix/bin/smprun" -n 1 --timeout 120 --no-prefix -- "$work/consumer/consumer" "$work/one.json" > "$work/one.txt"
cat "$work/two.txt"
python3 - "$work/two.txt" "$work/one.txt" <<'PY'
import sys
def losses(path):
    return [float(line.split()[-1]) for line in open(path) if line.startswith("step ")]
two, one = losses(sys.argv[1]), losses(sys.argv[2])
assert len(two) == 4 and len(one) == 4, (two, one)
assert all(abs(a - b) <= 1e-5 * max(1.0, abs(b)) for a, b in zip(two, one)), (two, one)
assert two[-1] < two[0], two
print("installed smp: 2 stages equal one process over", len(two), "steps")
PY
