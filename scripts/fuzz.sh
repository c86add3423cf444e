#!/usr/bin/env bash
# Builds the libFuzzer harnesses in fuzz/ (clang, ASan + UBSan) and runs each for SECONDS (default 20) on a copy
# of its seed corpus, so the corpus in the repo never changes under CI. Exits non-zero when any fuzzer fails;
# the failing input is kept under $build/artifacts/. Installs nothing but clang and its fuzzer runtime.
#   SMP_BUILD_FUZZ  build directory (default <repo>/build-fuzz)
#   SMP_JOBS        build parallelism (default nproc)
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=${SMP_BUILD_FUZZ:-$repo/build-fuzz}
seconds=${1:-20}
fuzzers=(fuzz_config:config fuzz_checkpoint_manifest:manifest)  # binary:corpus and dictionary name

say() { printf '[fuzz] %s\n' "$*" >&2; }

have_fuzzer_runtime() {
  command -v clang++ >/dev/null || return 1
  [ -f "$(clang++ -print-runtime-dir)/libclang_rt.fuzzer-$(uname -m).a" ]
}
if ! have_fuzzer_runtime; then
  say "installing clang and its fuzzer runtime"
  sudo_cmd=(); [ "$(id -u)" -ne 0 ] && sudo_cmd=(sudo)
  "${sudo_cmd[@]}" apt-get update -q
  DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -q --no-install-recommends clang libclang-rt-14-dev
  have_fuzzer_runtime || { say "clang++ still has no libFuzzer runtime"; exit 1; }
fi

generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
if [ ! -f "$build/CMakeCache.txt" ]; then
  say "configuring $build"
  cmake -S "$repo/fuzz" -B "$build" "${generator[@]}" -DCMAKE_CXX_COMPILER=clang++ >&2
fi
# GNU nproc reports OMP_NUM_THREADS where a caller set it (to 1 for multi-process jobs): count the cores instead.
jobs=${SMP_JOBS:-$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)}
say "building ($jobs jobs)"
cmake --build "$build" --parallel "$jobs" >&2

work=$(mktemp -d "${TMPDIR:-/tmp}/smp-fuzz.XXXXXX")
trap 'rm -rf "$work"' EXIT

failed=0
for entry in "${fuzzers[@]}"; do
  name=${entry%%:*} data=${entry#*:}
  corpus=$work/$name
  cp -R "$repo/fuzz/corpus/$data" "$corpus"
  seeds=$(find "$corpus" -type f | wc -l)
  artifacts=$build/artifacts/$name
  mkdir -p "$artifacts"
  options=(-max_total_time="$seconds" -timeout=5 -rss_limit_mb=2048 -print_final_stats=1
           -artifact_prefix="$artifacts/")
  dict=$repo/fuzz/dictionary/$data.dict
  [ -f "$dict" ] && options+=(-dict="$dict")
  log=$build/$name.log
  status=0
  "$build/$name" "${options[@]}" "$corpus" >"$log" 2>&1 || status=$?
  runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
  rate=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log" | tail -1)
  inputs=$(find "$corpus" -type f | wc -l)
  if [ "$status" -eq 0 ]; then
    printf '%s: ok, %s executions in %s s (%s/s), corpus %s -> %s inputs\n' \
      "$name" "${runs:-?}" "$seconds" "${rate:-?}" "$seeds" "$inputs"
  else
    failed=1
    printf '%s: FAILED (exit %s) after %s executions; input saved in %s, log %s\n' \
      "$name" "$status" "${runs:-?}" "$artifacts" "$log"
    tail -n 60 "$log" >&2
  fi
done
exit "$failed"
