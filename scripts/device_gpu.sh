#!/usr/bin/env bash
# Runs ON THE GPU MACHINE, from the repository root: builds smp there and runs the GPU tests and benchmark.
# That machine has CUDA, CMake, ninja, g++ and python3 with torch, but no package registry: the Debian packages
# it lacks come as .debs in .deps/debs/ (scripts/device_prepare.sh fetches them on the development machine; the
# device `run` call must carry ".deps"), unpacked with `dpkg -x` under /tmp/smp-deps, never into /.
#   bash scripts/device_gpu.sh [TARGET...]   builds TARGETs (default: all), then tests and benchmarks
#   SMP_GPU_BUILD=DIR          build directory (default build-gpu; kept between calls while the machine is warm)
#   SMP_GPU_SKIP_TESTS=1       do not run `ctest -L gpu`
#   SMP_GPU_SKIP_BENCH=1       do not run bin/bench_gpu
#   SMP_GPU_CMAKE_ARGS="..."   extra configure arguments (word-split)
#   SMP_GPU_PYTHON=PATH        python with torch (default python3)
#   SMP_GPU_PYTHON_PACKAGE=OFF do not build the Python package (default ON: built when that python has headers;
#                              should its build fail, the rest is built and tested without it)
#   SMP_GPU_BENCH_TIMEOUT=S    seconds bench_gpu may run (default 540)
#   SMP_GPU_BENCH_ARGS="..."   bench_gpu's arguments ("nccl": only the NCCL transfers and all-reduces)
#   SMP_GPU_SKIP_LLAMA=1       do not run bench/bench_llama_gpu.py (a 1B bf16 Llama, 2 stages on the GPU against one
#                              process; needs transformers there); SMP_GPU_LLAMA_TIMEOUT=S (default 300)
#   SMP_GPU_SKIP_PEERS=1       do not run bench/bench_peers.py --device cuda (smp against torch.distributed.pipelining,
#                              2 ranks on the GPU; needs the Python package and an NCCL that shares the GPU)
#   SMP_GPU_PEERS_ARGS="..."   its arguments after --device cuda (default: --only "d256 x 8 layers" --rounds 2 --steps 30)
#   SMP_GPU_PEERS_TIMEOUT=S    seconds it may run (default 300)
#   SMP_GPU_CONFIGURE_ONLY=1   stop after configuring (checks that every dependency resolves)
#   SMP_GPU_PREBUILT=DIR       do not build here: run the GPU tests and benchmark from DIR, a build directory made on
#                              the development machine (x86-64, against the same CUDA build of torch; carry
#                              DIR/bin, DIR/tests/test_gpu and DIR/CMakeCache.txt). Saves the device machine's time:
#                              the call is the tests and the benchmark. The Python GPU test needs a build here.
#   SMP_GPU_TEST_TIMEOUT=S     seconds the prebuilt test_gpu may run (default 540)
# One device `run` call may last 600 s. On the H100 machine (16 cores) a fresh machine's whole run fits in one: the
# build about 70 s, the tests about 80 s, the benchmark about 70 s (2026-11-23). Where it would not, split it; the
# build directory survives between calls while the machine stays warm (30 s after a call): SMP_GPU_SKIP_TESTS=1
# SMP_GPU_SKIP_BENCH=1 (configure and build), then SMP_GPU_SKIP_BENCH=1 (tests), then SMP_GPU_SKIP_TESTS=1 (bench).
# With NCCL 2.30 (several ranks per GPU) the whole is about 10 minutes on an H200 (2026-11-27); two calls did it:
#   SMP_GPU_SKIP_LLAMA=1 SMP_GPU_SKIP_PEERS=1 SMP_GPU_BENCH_ARGS=nccl bash scripts/device_gpu.sh test_gpu bench_gpu smp_python
#   SMP_GPU_SKIP_TESTS=1 SMP_GPU_SKIP_BENCH=1 bash scripts/device_gpu.sh bench_pipeline smp_python
# (366 s, then 286 s; bench_peers.py runs bench_pipeline, which the first call's targets leave out).
#   SMP_GPU_DEPS_ROOT=DIR      where the .debs are unpacked (default /tmp/smp-deps)
#   SMP_GPU_NCCL=FILE|none     the NCCL the tests and benchmark load in place of the torch wheel's (LD_PRELOAD), so
#                              that several ranks share the one GPU (2.30 and later); default .deps/nccl/libnccl.so.2.xz
#                              when scripts/device_prepare.sh --nccl made it. Without one, the NCCL jobs of several
#                              processes check the refusal instead and the Python ones are skipped.
#   OUT                        when set, logs go there: build_gpu.txt, ctest_gpu.txt, bench_gpu.txt, bench_gpu_collectives.txt,
#                              bench_llama_gpu.txt, bench_peers_gpu.txt, plan_gpu.txt (the planner's predicted step
#                              beside the measured one on this GPU)
#                              (and build_gpu_python.txt when the Python package failed to build)
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"
build=${SMP_GPU_BUILD:-build-gpu}
root=${SMP_GPU_DEPS_ROOT:-/tmp/smp-deps}
deps=$root/usr
arch=x86_64-linux-gnu
python=${SMP_GPU_PYTHON:-python3}
out=${OUT:-}

say() { printf '[device] %s\n' "$*" >&2; }
die() { say "ERROR: $*"; exit 1; }
# Runs "$@" with its output also copied to $out/$name when $OUT is set; returns the command's status.
logged() {
  local name=$1; shift
  if [ -n "$out" ]; then "$@" 2>&1 | tee "$out/$name"; else "$@"; fi
}
[ -n "$out" ] && mkdir -p "$out"

# --- the machine --------------------------------------------------------------------------------------------
command -v nvidia-smi >/dev/null || die "nvidia-smi not found: this script is for the GPU machine"
say "GPU:"
timeout 60 nvidia-smi || die "nvidia-smi failed (or hung for 60 s): no usable GPU"
if ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then
  export PATH=/usr/local/cuda/bin:$PATH
fi
command -v nvcc >/dev/null || die "nvcc not found (nor /usr/local/cuda/bin/nvcc): the GPU code needs the CUDA toolkit"
for tool in cmake ninja ctest "$python"; do
  command -v "$tool" >/dev/null || die "$tool not found"
done
command -v dpkg-deb >/dev/null || command -v ar >/dev/null || die "neither dpkg-deb nor ar found: cannot unpack .debs"
cxx=$(command -v c++ || command -v g++) || die "no C++ compiler: neither c++ nor g++ is on PATH"
say "system: $(sed -n 's/^PRETTY_NAME=//p' /etc/os-release 2>/dev/null | tr -d '"'), $(ldd --version 2>&1 | head -n 1)"
say "compiler: $("$cxx" --version | head -n 1)"
say "$(cmake --version | head -n 1), ninja $(ninja --version), nvcc $(nvcc --version | grep -o 'release [0-9.]*')"

# --- the .debs ----------------------------------------------------------------------------------------------
shopt -s nullglob
debs=("$repo"/.deps/debs/*.deb)
shopt -u nullglob
((${#debs[@]})) ||
  die "no .deps/debs/*.deb: run scripts/device_prepare.sh on the development machine; the run call must carry .deps"
stamp=$(cat "${debs[@]}" | sha256sum | cut -d ' ' -f 1)
if [ "$(cat "$root/.smp-stamp" 2>/dev/null)" = "$stamp" ]; then
  say "dependencies already unpacked in $root"
else
  say "unpacking ${#debs[@]} .debs into $root"
  rm -rf "$root"
  mkdir -p "$root"
  for deb in "${debs[@]}"; do
    if command -v dpkg-deb >/dev/null; then
      dpkg-deb -x "$deb" "$root" || die "cannot unpack $deb"
    else  # a .deb is an ar archive holding data.tar.{xz,zst,gz}
      member=$(ar t "$deb" | grep '^data\.tar') || die "cannot read $deb (no dpkg-deb, and ar failed)"
      case $member in
        *.xz) compression=--xz ;; *.zst) compression=--zstd ;; *.gz) compression=--gzip ;; *) compression= ;;
      esac
      ar p "$deb" "$member" | tar -x $compression -C "$root" -f - || die "cannot unpack $deb"
    fi
  done
  # Absolute links (zlib1g-dev's libz.so -> /lib/x86_64-linux-gnu/libz.so.1.2.13) would point out of the prefix.
  while IFS= read -r -d '' link; do
    target=$(readlink "$link")
    if [[ $target == /* ]]; then ln -sfn "$root$target" "$link"; fi
  done < <(find "$root" -type l -print0)
  echo "$stamp" >"$root/.smp-stamp"
fi
for file in include/metis.h include/gloo/algorithm.h include/spdlog/spdlog.h include/fmt/format.h \
            include/nlohmann/json.hpp include/zlib.h lib/cmake/Catch2/Catch2Config.cmake \
            "lib/$arch/cmake/spdlog/spdlogConfig.cmake" "lib/$arch/cmake/fmt/fmt-config.cmake" \
            share/cmake/nlohmann_json/nlohmann_jsonConfig.cmake "lib/$arch/libmetis.so" "lib/$arch/libz.so" \
            share/games/fortunes/fortunes; do
  [ -e "$deps/$file" ] || die "$deps/$file missing after unpacking: rerun scripts/device_prepare.sh (its package list)"
done
export LD_LIBRARY_PATH=$deps/lib/$arch${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
# Debian 12's libraries need glibc >= 2.34 and libstdc++ with GLIBCXX_3.4.30; say so now rather than at run time.
for library in "$deps/lib/$arch"/*.so.*; do
  if [ ! -L "$library" ] && ldd "$library" 2>&1 | grep -q 'not found'; then
    ldd "$library" 2>&1 | grep 'not found' >&2
    die "$library cannot load on this machine (too old a glibc/libstdc++ for Debian 12's .debs?)"
  fi
done
export SMP_FORTUNES_DIR=$deps/share/games/fortunes

# Python packages from the wheels in .deps/wheels (scripts/device_prepare.sh --wheels: transformers and what it
# needs): unpacked (a wheel is a zip of its importable files) into $root/pylib, which goes first on PYTHONPATH. A
# distribution the python has at the wheel's very version is left to it; another version gives way to the wheel, so
# that the models run there as the development machine's tests ran them.
shopt -s nullglob
wheels=("$repo"/.deps/wheels/*.whl)
shopt -u nullglob
if ((${#wheels[@]})); then
  added=$("$python" - "$root/pylib" "${wheels[@]}" <<'PYTHON'
import importlib.metadata, os, sys, zipfile
target, added = sys.argv[1], []
os.makedirs(target, exist_ok=True)
for wheel in sys.argv[2:]:
    name, version = os.path.basename(wheel).split("-")[:2]
    try:
        if importlib.metadata.version(name.replace("_", "-")) == version:
            continue
    except importlib.metadata.PackageNotFoundError:
        pass
    zipfile.ZipFile(wheel).extractall(target)
    added.append(f"{name} {version}")
print(" ".join(added) or "none")
PYTHON
) || die "cannot unpack the wheels in .deps/wheels"
  export PYTHONPATH=$root/pylib${PYTHONPATH:+:$PYTHONPATH}
  say "python packages added from .deps/wheels: $added"
fi

# --- configure and build --------------------------------------------------------------------------------------
torch_info=$(timeout 300 "$python" -c 'import torch
print(torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count())
print(torch.utils.cmake_prefix_path)' | tail -n 2) ||
  die "$python cannot import torch (set SMP_GPU_PYTHON to a python that can)"
torch_prefix=$(tail -n 1 <<<"$torch_info")
# Two CUDA runtimes in one process (ours from nvcc's toolkit, libtorch's from the wheel) would fail in odd ways;
# Torch's CMake config accepts any toolkit from 12 on, so check the major versions here.
torch_cuda=$(head -n 1 <<<"$torch_info" | awk '{print $3}')
[ "$torch_cuda" != None ] || die "$python's torch is a CPU-only build: the GPU build needs torch's CUDA build"
nvcc_cuda=$(nvcc --version | grep -o 'release [0-9.]*' | awk '{print $2}' || true)
[ -n "$nvcc_cuda" ] || die "cannot read the CUDA version from \`nvcc --version\`"
[ "${torch_cuda%%.*}" = "${nvcc_cuda%%.*}" ] ||
  die "nvcc is CUDA $nvcc_cuda but torch was built for CUDA $torch_cuda: put a CUDA ${torch_cuda%%.*} toolkit first on PATH"
[ -d "$torch_prefix" ] || die "torch's cmake prefix \"$torch_prefix\" is not a directory"
say "torch $(head -n 1 <<<"$torch_info"), cmake prefix $torch_prefix"

# The prefix comes right after torch's in CMAKE_PREFIX_PATH, which find_package/find_path/find_library search
# before the system directories (so FindMETIS, FindGlooHeaders and FindZLIB need nothing more, and the prefix wins
# over /usr where both have a package). CMAKE_LIBRARY_ARCHITECTURE makes them look in <prefix>/lib/x86_64-linux-gnu
# (libmetis.so, libz.so, the spdlog and fmt config files) even with a compiler that reports no multiarch directory;
# the *_DIR variables pin each config package to the prefix outright.
prebuilt=${SMP_GPU_PREBUILT:-}
extra_args=()
[ -n "${SMP_GPU_CMAKE_ARGS:-}" ] && read -r -a extra_args <<<"$SMP_GPU_CMAKE_ARGS"
# CMake would take the first g++ on PATH: on the GPU machine that is /opt/gcc/bin/g++, which links libstdc++
# statically. The Python extension then carried its own copy beside the interpreter's libstdc++.so.6 and crashed in
# std::ostream (seen 2026-11-23; the C++ programs happened to run). Build with the `c++` checked above, whose
# libstdc++ must be the shared library that LibTorch and Python load.
stdcxx_dev=$("$cxx" -print-file-name=libstdc++.so)
[ -e "$stdcxx_dev" ] || die "$cxx has no shared libstdc++ (libstdc++.so): programs would carry a static copy"
extra_args=("-DCMAKE_CXX_COMPILER=$cxx" "${extra_args[@]}")  # first: SMP_GPU_CMAKE_ARGS may name another
# The Python package too when this python has its headers (CMake skips it with a message otherwise).
configure() {
  say "configuring $build (Python package: $1)"
  cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_PREFIX_PATH="$torch_prefix;$deps" -DCMAKE_LIBRARY_ARCHITECTURE="$arch" \
    -Dfmt_DIR="$deps/lib/$arch/cmake/fmt" -Dspdlog_DIR="$deps/lib/$arch/cmake/spdlog" \
    -DCatch2_DIR="$deps/lib/cmake/Catch2" -Dnlohmann_json_DIR="$deps/share/cmake/nlohmann_json" \
    -DSMP_BUILD_PYTHON="$1" -DPython3_EXECUTABLE="$(command -v "$python")" \
    "${extra_args[@]}" >&2 || die "configure failed (see above)"
}
case ${SMP_GPU_PYTHON_PACKAGE:-ON} in
  ON | on | On | 1 | TRUE | true | YES | yes) python_package=ON ;;
  *) python_package=OFF ;;
esac
if [ -n "$prebuilt" ]; then
  build=$prebuilt
  [ -x "$build/tests/test_gpu" ] && [ -x "$build/bin/bench_gpu" ] ||
    die "SMP_GPU_PREBUILT=$build: $build/tests/test_gpu or $build/bin/bench_gpu missing (carry them)"
  # The binaries look for torch, NCCL and CUDA's runtime where the development machine has them: point the loader
  # at this python's copies instead (same torch version, so the same libraries).
  torch_lib=$torch_prefix/../../lib
  site=$torch_prefix/../../..
  for dir in "$torch_lib" "$site/nvidia/nccl/lib" "$site/nvidia/cu13/lib" "$site/nvidia/cuda_runtime/lib"; do
    [ -d "$dir" ] && LD_LIBRARY_PATH=$(cd "$dir" && pwd):$LD_LIBRARY_PATH
  done
  export LD_LIBRARY_PATH
  # Tests name programs and configs by the absolute paths of the development machine's checkout.
  source_dir=$(sed -n 's/^CMAKE_HOME_DIRECTORY:INTERNAL=//p' "$build/CMakeCache.txt" 2>/dev/null || true)
  if [ -n "$source_dir" ] && [ ! -e "$source_dir" ]; then
    mkdir -p "$(dirname "$source_dir")" && ln -s "$repo" "$source_dir" || die "cannot link $source_dir to $repo"
  elif [ -n "$source_dir" ] && [ "$(cd "$source_dir" && pwd -P)" != "$(pwd -P)" ]; then
    die "$source_dir exists here and is not this checkout: the prebuilt tests would run another tree's files"
  fi
  for program in tests/test_gpu bin/bench_gpu bin/training_worker bin/smprun bin/hybrid_2x4; do
    [ -x "$build/$program" ] || die "SMP_GPU_PREBUILT=$build: $build/$program missing (carry $build/bin too)"
  done
  missing=$(ldd "$build/tests/test_gpu" "$build/bin/bench_gpu" "$build/bin/training_worker" 2>&1 | grep 'not found' | sort -u || true)
  [ -z "$missing" ] || die "prebuilt binaries miss libraries here: $missing"
  say "prebuilt $build (sources at ${source_dir:-?}); not building"
else
configure "$python_package"
if [ "${SMP_GPU_CONFIGURE_ONLY:-0}" = 1 ]; then
  say "configured $build (SMP_GPU_CONFIGURE_ONLY=1: not building)"
  exit 0
fi

targets=()
(($#)) && targets=(--target "$@")
jobs=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)  # GNU nproc reports OMP_NUM_THREADS where set
say "building ${*:-all} with $jobs jobs"
build_log=$(mktemp)
if ! cmake --build "$build" --parallel "$jobs" "${targets[@]}" 2>&1 | tee "$build_log"; then
  [ -n "$out" ] && cp "$build_log" "$out/build_gpu.txt"
  # The C++ GPU tests must still run when only the Python package fails to build here (ninja names every failed
  # object after FAILED:); any other failure is the build's.
  if [ "$python_package" = ON ] && grep -q '^FAILED: .*python/' "$build_log" &&
     ! grep '^FAILED:' "$build_log" | grep -qv 'python/'; then
    say "the Python package FAILED to build here; building the rest without it (its log: build_gpu_python.txt)"
    [ -n "$out" ] && cp "$build_log" "$out/build_gpu_python.txt"
    configure OFF
    logged build_gpu.txt cmake --build "$build" --parallel "$jobs" "${targets[@]}" || die "build failed (see above)"
  else
    die "build failed (see above)"
  fi
elif [ -n "$out" ]; then
  cp "$build_log" "$out/build_gpu.txt"
fi
rm -f "$build_log"
# What the libstdc++ link above is for: a program or module with a static copy of libstdc++ beside the shared one.
command -v readelf >/dev/null || die "readelf not found: cannot check how the programs link libstdc++"
for built in "$build"/bin/* "$build"/tests/test_gpu "$build"/python/smp/_smp*.so; do
  readelf -h "$built" >/dev/null 2>&1 || continue  # absent, or not an ELF file
  dynamic=$(readelf -d "$built")  # whole, not piped into grep -q: pipefail would see readelf's SIGPIPE
  grep -q 'NEEDED.*libstdc++[.]so' <<<"$dynamic" ||
    die "$built links libstdc++ statically: beside LibTorch's shared one it would crash"
done
fi

nccl_shares_gpu=0
# The NCCL that torch's calls bind to, as ncclGetVersion says (23007 for 2.30.7); torch.cuda.nccl.version() is the
# one torch was built against. torch's import also opens the wheel's copy by its path, but the preloaded one's
# symbols come first.
loaded_nccl_version() {
  timeout 120 "$python" -c 'import ctypes, torch
version = ctypes.c_int(0)
ctypes.CDLL("libnccl.so.2").ncclGetVersion(ctypes.byref(version))
print(version.value)'
}
# --- the NCCL the tests load ----------------------------------------------------------------------------------
nccl=${SMP_GPU_NCCL:-$repo/.deps/nccl/libnccl.so.2.xz}
if [ "$nccl" != none ] && [ -e "$nccl" ]; then
  if [[ $nccl == *.xz ]]; then
    unpacked=$root/nccl/libnccl.so.2
    if [ ! -e "$unpacked" ] || [ "$nccl" -nt "$unpacked" ]; then
      mkdir -p "$(dirname "$unpacked")"
      if command -v xz >/dev/null; then xz -dc "$nccl" >"$unpacked.part"
      else "$python" -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], "wb"))' \
             "$nccl" "$unpacked.part"
      fi || die "cannot unpack $nccl"
      mv "$unpacked.part" "$unpacked"
    fi
    nccl=$unpacked
  fi
  # Preloaded, not put on the library path: libtorch_cuda's RPATH, which comes before LD_LIBRARY_PATH, names the
  # wheel's copy.
  export LD_PRELOAD=$nccl${LD_PRELOAD:+:$LD_PRELOAD}
  loaded=$(loaded_nccl_version) || die "python with $nccl preloaded failed"
  say "NCCL $loaded loaded from $nccl (LD_PRELOAD)"
  ((loaded >= 23000)) && nccl_shares_gpu=1
elif [ "$nccl" != none ] && [ -n "${SMP_GPU_NCCL:-}" ]; then
  die "SMP_GPU_NCCL=$nccl does not exist"
else
  say "the torch wheel's NCCL $(loaded_nccl_version || echo '?'): one rank per GPU (no .deps/nccl: scripts/device_prepare.sh --nccl)"
fi

# --- tests and benchmark: both run even when the other fails; the exit status is the first failure ----------
status=0
if [ "${SMP_GPU_SKIP_TESTS:-0}" = 1 ]; then
  say "tests skipped (SMP_GPU_SKIP_TESTS=1)"
else
  say "ctest -L gpu"
  ctest_log=$(mktemp)
  # The planner's predicted step beside the measured one on this GPU (test_gpu's [plan] case): its calibration.
  plan_log=$(mktemp)
  export SMP_GPU_PLAN_LOG=$plan_log
  if [ -n "$prebuilt" ]; then  # no CTest files travel: the test program itself (exit 77 is its skip)
    (cd "$build/tests" && OMP_NUM_THREADS=1 timeout -k 10 "${SMP_GPU_TEST_TIMEOUT:-540}" ./test_gpu --durations yes) 2>&1 |
      tee "$ctest_log" || status=$?
    ((status != 77)) || { echo "test_gpu (Skipped)" >>"$ctest_log"; status=0; }
  else
    OMP_NUM_THREADS=1 ctest --test-dir "$build" -L gpu --output-on-failure --timeout 600 --no-tests=error 2>&1 |
      tee "$ctest_log" || status=$?
  fi
  [ -n "$out" ] && cp "$ctest_log" "$out/ctest_gpu.txt"
  if [ -s "$plan_log" ]; then
    say "the planner on this GPU (predicted against measured):"
    cat "$plan_log"
    [ -n "$out" ] && cp "$plan_log" "$out/plan_gpu.txt"
  fi
  rm -f "$plan_log"
  unset SMP_GPU_PLAN_LOG
  if ((status != 0)); then
    say "gpu tests FAILED (status $status)"
  elif grep -q '(Skipped)' "$ctest_log"; then
    say "gpu tests SKIPPED: the test program saw no CUDA device"
    status=1
  else
    say "gpu tests passed"
  fi
  rm -f "$ctest_log"
fi

if [ "${SMP_GPU_SKIP_BENCH:-0}" = 1 ]; then
  say "benchmark skipped (SMP_GPU_SKIP_BENCH=1)"
elif [ -x "$build/bin/bench_gpu" ]; then
  say "bench_gpu"
  bench_status=0
  bench_args=()
  [ -n "${SMP_GPU_BENCH_ARGS:-}" ] && read -r -a bench_args <<<"$SMP_GPU_BENCH_ARGS"
  logged bench_gpu.txt timeout -k 10 "${SMP_GPU_BENCH_TIMEOUT:-540}" "$build/bin/bench_gpu" "${bench_args[@]}" ||
    bench_status=$?
  ((bench_status == 0)) || say "bench_gpu FAILED (status $bench_status; 124 is the timeout)"
  ((status != 0)) || status=$bench_status
  if [ "$nccl_shares_gpu" = 1 ]; then  # collectives between 2 processes: NCCL launches a kernel for each
    say "bench_gpu collectives (2 ranks)"
    bench_status=0
    logged bench_gpu_collectives.txt timeout -k 10 120 "$build/bin/smprun" -n 2 --no-prefix -- \
      "$build/bin/bench_gpu" collectives || bench_status=$?
    ((bench_status == 0)) || say "bench_gpu collectives FAILED (status $bench_status; 124 is the timeout)"
    ((status != 0)) || status=$bench_status
  fi
else
  say "no $build/bin/bench_gpu; benchmark skipped"
fi
# A 1B-parameter Llama-shaped model in bf16, 2 stages sharing the GPU, against one process.
if [ "${SMP_GPU_SKIP_LLAMA:-0}" = 1 ]; then
  say "Llama benchmark skipped (SMP_GPU_SKIP_LLAMA=1)"
elif [ "$nccl_shares_gpu" != 1 ] || [ -z "$(ls "$build"/python/smp/_smp*.so 2>/dev/null)" ]; then
  say "Llama benchmark skipped: it needs the Python package and an NCCL that shares the GPU (2.30 or later)"
elif ! "$python" -c 'import transformers, safetensors' 2>/dev/null; then
  say "Llama benchmark skipped: $python has no transformers or safetensors"
else
  say "bench_llama_gpu"
  llama_status=0
  logged bench_llama_gpu.txt timeout -k 10 "${SMP_GPU_LLAMA_TIMEOUT:-300}" "$python" bench/bench_llama_gpu.py \
    "$build/bin" --timeout "$((${SMP_GPU_LLAMA_TIMEOUT:-300} - 60))" || llama_status=$?
  ((llama_status == 0)) || say "bench_llama_gpu FAILED (status $llama_status; 124 is the timeout)"
  ((status != 0)) || status=$llama_status
fi

# smp (C++ and Python) against torch.distributed.pipelining, 2 ranks sharing the GPU over NCCL, and one process.
if [ "${SMP_GPU_SKIP_PEERS:-0}" = 1 ]; then
  say "side-by-side benchmark skipped (SMP_GPU_SKIP_PEERS=1)"
elif [ "$nccl_shares_gpu" != 1 ]; then
  say "side-by-side benchmark skipped: its two ranks share the GPU over NCCL, which needs NCCL 2.30 or later"
elif [ -z "$(ls "$build"/python/smp/_smp*.so 2>/dev/null)" ]; then
  say "no Python package in $build; side-by-side benchmark skipped"
else
  peers_args=(--device cuda --only "d256 x 8 layers" --rounds 2 --steps 30)
  [ -n "${SMP_GPU_PEERS_ARGS:-}" ] && read -r -a peers_args <<<"--device cuda $SMP_GPU_PEERS_ARGS"
  say "bench_peers ${peers_args[*]}"
  peers_status=0
  logged bench_peers_gpu.txt timeout -k 10 "${SMP_GPU_PEERS_TIMEOUT:-300}" "$python" bench/bench_peers.py "$build/bin" \
    "${peers_args[@]}" || peers_status=$?
  ((peers_status == 0)) || say "bench_peers FAILED (status $peers_status; 124 is the timeout)"
  ((status != 0)) || status=$peers_status
fi
say "done (status $status)"
exit "$status"
