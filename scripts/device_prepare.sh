#!/usr/bin/env bash
# Runs on the development machine (Debian 12, apt access). Downloads, without installing, the .deb files that the
# GPU machine lacks into <repo>/.deps/debs/, for scripts/device_gpu.sh to unpack there with `dpkg -x` (that
# machine has no package registry). Idempotent: a package whose .deb is already there is skipped.
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
debs=$repo/.deps/debs

say() { printf '[device-prepare] %s\n' "$*" >&2; }

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
total=$(du -cb "$debs"/*.deb | tail -n 1 | cut -f 1)
say "total: $(awk -v b="$total" 'BEGIN { printf "%.1f MiB", b / 1048576 }') in $debs"
if ((total > 40 * 1024 * 1024)); then
  say "more than 40 MiB: the device tool carries at most 64 MiB of working tree; remove stale .debs from $debs"
  exit 1
fi
say "next: a device \`run\` call with carry [\".deps\"] and command \"bash scripts/device_gpu.sh\""
