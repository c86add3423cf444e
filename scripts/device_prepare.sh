#!/usr/bin/env bash
# Runs on the development machine (Debian 12, apt access). Downloads, without installing, the .deb files that the
# GPU machine lacks into <repo>/.deps/debs/, for scripts/device_gpu.sh to unpack there with `dpkg -x` (that
# machine has no package registry). Idempotent: a package whose .deb is already there is skipped.
#
#   scripts/device_prepare.sh [--nccl NCCL_SOURCE] [--nccl-arch 90] [--wheels [--wheels-python 3.12]]
#
# --nccl also builds NCCL (2.30 or later: several ranks of different processes on one GPU) from a checkout of
# github.com/NVIDIA/nccl for one GPU architecture (sm_90: H100, H200) and the collectives smp calls, and puts the
# library, stripped and xz-compressed, in .deps/nccl/ for scripts/device_gpu.sh to load in place of the torch
# wheel's 2.28. Why not the PyPI wheel (nvidia-nccl-cu13 2.30.7): its libnccl.so.2 is 252 MB, 194 MB after strip
# and xz (its fatbins are compressed already), and a device call carries 64 MiB; this build is 12.9 MB stripped,
# 10 MB compressed (2.30.7, sm_90). It takes about 15 minutes on 2 cores, kept under ~/.cache/smp/nccl-build.
#
# --wheels also downloads transformers at this venv's version, for the GPU machine's python (3.12 there), into
# .deps/wheels/, with regex, the one requirement whose least version (2025.10.22) that machine's image may miss: the
# image has transformers 5.17 and every other requirement (KINDS.md's package list), and device_gpu.sh prefers a
# carried wheel to another version of it there, so the models run as this machine's tests ran them. About 14 MiB
# (all of transformers' requirements would be 44 MiB, and would replace the image's numpy under its torch).
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
debs=$repo/.deps/debs

say() { printf '[device-prepare] %s\n' "$*" >&2; }

nccl_source=
nccl_arch=90
wheels=0
wheels_python=3.12
while (($#)); do
  case $1 in
    --nccl) nccl_source=${2:?--nccl needs the NCCL source directory}; shift 2 ;;
    --nccl-arch) nccl_arch=${2:?--nccl-arch needs a compute capability such as 90}; shift 2 ;;
    --wheels) wheels=1; shift ;;
    --wheels-python) wheels_python=${2:?--wheels-python needs a version such as 3.12}; shift 2 ;;
    -h | --help) sed -n '2,18p' "${BASH_SOURCE[0]}"; exit 0 ;;
    *) say "unknown argument: $1 (see --help)"; exit 2 ;;
  esac
done

# Names as Debian 12 (bookworm) spells them; checked with `apt-cache depends` / `apt-cache show`.
# Dependencies the GPU machine already has (libc6, libstdc++6, libgcc-s1) are left out on purpose.
packages=(
  libmetis-dev        # metis.h and libmetis.so (FindMETIS.cmake)
  libmetis5           # libmetis.so.5: libmetis-dev's symlink target, and the runtime library
  libspdlog-dev       # spdlog headers and spdlogConfig.cmake (find_package(spdlog))
  libspdlog1.10       # libspdlog.so.1.10: the runtime library
  libfmt-dev          # fmt headers, fmt-config.cmake: libspdlog-dev depends on it (Debian's spdlog uses external fmt)
  libfmt9             # libfmt.so.9: runtime library of libfmt-dev, needed by libspdlog1.10
  catch2              # Catch2 v2 (2.13) headers, Catch2Config.cmake and Catch.cmake (tests/CMakeLists.txt)
  nlohmann-json3-dev  # nlohmann/json.hpp and nlohmann_jsonConfig.cmake (header only)
  libgloo-dev         # gloo/*.h for torch's ProcessGroupGloo.hpp; headers only, so libgloo0 and its
                      # dependencies (libhiredis, libibverbs) are not fetched: nothing links Gloo itself
  zlib1g-dev          # zlib.h and libz.so (find_package(ZLIB))
  zlib1g              # libz.so.1.2.13, target of zlib1g-dev's libz.so symlink
  fortunes-min        # fortune files: the examples' text corpus (usr/share/games/fortunes)
  fortunes            # the bulk of that corpus; depends on fortunes-min
)

command -v apt-get >/dev/null || { say "apt-get not found: this script needs a Debian machine"; exit 1; }
mkdir -p "$debs"

# Each .deb is stored as <package>.deb: apt's names (<package>_<epoch>%3a<version>_<arch>.deb) carry characters
# that the device tool may refuse to carry.
missing=()
for package in "${packages[@]}"; do
  if [ -s "$debs/$package.deb" ]; then
    say "have $package"
  else
    missing+=("$package")
  fi
done

if ((${#missing[@]})); then
  say "downloading: ${missing[*]}"
  download=$(mktemp -d)
  trap 'rm -rf "$download"' EXIT
  chmod 777 "$download"  # apt run as root downloads as its _apt user, which must be able to write there
  if ! (cd "$download" && apt-get download "${missing[@]}"); then
    say "download failed; running apt-get update and trying again"
    sudo_cmd=(); [ "$(id -u)" -ne 0 ] && sudo_cmd=(sudo)
    "${sudo_cmd[@]}" apt-get update -q
    (cd "$download" && apt-get download "${missing[@]}")
  fi
  for file in "$download"/*.deb; do
    mv "$file" "$debs/$(dpkg-deb -f "$file" Package).deb"
  done
fi

for package in "${packages[@]}"; do
  [ -s "$debs/$package.deb" ] || { say "missing after download: $package"; exit 1; }
done

for package in "${packages[@]}"; do
  printf '  %8.1f KiB  %-20s %s\n' "$(du -b "$debs/$package.deb" | awk '{ print $1 / 1024 }')" "$package" \
    "$(dpkg-deb -f "$debs/$package.deb" Version)" >&2
done
# The collectives smp's communicators call (comm/src/nccl_communicator.cpp: sums, gathers, broadcasts, point to
# point); the others' kernels are most of NCCL's build time and size.
nccl_functions="AllReduce Sum * * *|ReduceScatter Sum * * *|Reduce Sum * * *|AllGather * *|AllGatherV * *|Broadcast * *|SendRecv"
if [ -n "$nccl_source" ]; then
  [ -f "$nccl_source/makefiles/version.mk" ] || { say "--nccl $nccl_source: not an NCCL checkout (no makefiles/version.mk)"; exit 1; }
  version=$(awk '/^NCCL_(MAJOR|MINOR|PATCH)/ { printf "%s%s", sep, $3; sep = "." }' "$nccl_source/makefiles/version.mk")
  minor=$(cut -d . -f 2 <<<"$version")
  ((minor >= 30)) || { say "NCCL $version: ranks share a GPU from 2.30 on; check out a newer NCCL"; exit 1; }
  command -v nvcc >/dev/null || export PATH=/usr/local/cuda/bin:$PATH
  nccl_build=${SMP_NCCL_BUILD:-$HOME/.cache/smp/nccl-build}/$version-sm$nccl_arch
  mkdir -p "$nccl_build"
  say "building NCCL $version for sm_$nccl_arch in $nccl_build (a first build takes about 15 minutes on 2 cores)"
  cuda_home=$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")
  # The CUDA toolkit's include directory may hold an older NCCL's nccl_device/ headers, which its -I would put ahead
  # of the checkout's own (a 2.30 build then fails on NCCL_GIN_MAX_CONNECTIONS): the toolkit's headers but those.
  cuda_include=$nccl_build/cuda-include
  rm -rf "$cuda_include" && mkdir -p "$cuda_include"
  for entry in "$cuda_home"/include/*; do
    case $(basename "$entry") in nccl*) ;; *) ln -s "$entry" "$cuda_include/" ;; esac
  done
  start=$SECONDS
  make -C "$nccl_source" -j "$(nproc)" src.build BUILDDIR="$nccl_build" CUDA_HOME="$cuda_home" CUDA_INC="$cuda_include" \
    NVCC_GENCODE="-gencode=arch=compute_$nccl_arch,code=sm_$nccl_arch" ONLY_FUNCS="$nccl_functions" >"$nccl_build/make.log" 2>&1 ||
    { tail -n 30 "$nccl_build/make.log" >&2; say "NCCL build failed (log: $nccl_build/make.log)"; exit 1; }
  say "built in $((SECONDS - start)) s"
  mkdir -p "$repo/.deps/nccl"
  strip --strip-unneeded -o "$repo/.deps/nccl/libnccl.so.2" "$(readlink -f "$nccl_build/lib/libnccl.so.2")"
  rm -f "$repo/.deps/nccl/libnccl.so.2.xz"
  xz -T0 -6 "$repo/.deps/nccl/libnccl.so.2"
  echo "$version" >"$repo/.deps/nccl/VERSION"
  say "NCCL $version: $(du -b "$repo/.deps/nccl/libnccl.so.2.xz" | awk '{ printf "%.1f MiB", $1 / 1048576 }') in .deps/nccl"
fi

if ((wheels)); then
  venv_python=${SMP_VENV:-$HOME/.cache/smp/venv}/bin/python
  [ -x "$venv_python" ] || { say "--wheels: no $venv_python (run scripts/setup.sh first)"; exit 1; }
  pins=$("$venv_python" -c 'import importlib.metadata as m; print(" ".join(f"{n}=={m.version(n)}" for n in ("transformers", "regex")))')
  rm -rf "$repo/.deps/wheels" && mkdir -p "$repo/.deps/wheels"
  say "downloading wheels for python $wheels_python: $pins"
  # shellcheck disable=SC2086  # $pins is a list of requirements
  "$venv_python" -m pip download -q --no-deps --only-binary=:all: --python-version "$wheels_python" \
    --implementation cp --platform any --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux_2_28_x86_64 -d "$repo/.deps/wheels" $pins
fi

shopt -s nullglob
carried=("$debs"/*.deb "$repo"/.deps/nccl/*.xz "$repo"/.deps/wheels/*.whl)
shopt -u nullglob
total=$(du -cb "${carried[@]}" | tail -n 1 | cut -f 1)
say "total: $(awk -v b="$total" 'BEGIN { printf "%.1f MiB", b / 1048576 }') in $repo/.deps"
if ((total > 60 * 1024 * 1024)); then
  say "more than 60 MiB: the device tool carries at most 64 MiB with the working tree; remove stale files from .deps"
  exit 1
fi
say "next: a device \`run\` call with carry [\".deps\"] and command \"bash scripts/device_gpu.sh\""
