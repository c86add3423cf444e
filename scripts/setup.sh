#!/usr/bin/env bash
# Installs what is missing and builds smp in Release. Idempotent: seconds when everything is already there.
#   SMP_VENV    virtual environment holding the torch wheel (default ~/.cache/smp/venv, shared by every clone)
#   SMP_BUILD   build directory (default <repo>/build)
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${SMP_VENV:-$HOME/.cache/smp/venv}
build=${SMP_BUILD:-$repo/build}
torch_version=2.11.0
# For real models (tests build unmodified Hugging Face and torchvision models from small configs; nothing is
# fetched from a model hub): torchvision's release for this torch, and a transformers 5 release. scikit-build-core:
# `pip install --no-build-isolation .` (README, "Installing"); pytest runs the Python tests.
model_packages=("torchvision==0.26.0" "transformers==5.23.0" "scikit-build-core==1.1.2" "pytest==9.2.0")
apt_packages=(build-essential cmake ninja-build ccache python3-venv python3-dev libmetis-dev libspdlog-dev catch2
              nlohmann-json3-dev libgloo-dev zlib1g-dev fortunes)

say() { printf '[setup] %s\n' "$*" >&2; }

missing=()
for package in "${apt_packages[@]}"; do
  dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "ok installed" || missing+=("$package")
done
if ((${#missing[@]})); then
  say "installing Debian packages: ${missing[*]}"
  sudo_cmd=(); [ "$(id -u)" -ne 0 ] && sudo_cmd=(sudo)
  "${sudo_cmd[@]}" apt-get update -q
  DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -q --no-install-recommends "${missing[@]}"
fi

python=${SMP_PYTHON:-python3}
if ! "$venv/bin/python" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$torch_version')" 2>/dev/null; then
  say "installing torch==$torch_version into $venv (one time, shared by every clone)"
  "$python" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip
  "$venv/bin/python" -m pip install -q "torch==$torch_version"
fi
if ! "$venv/bin/python" - "${model_packages[@]}" <<'PY' 2>/dev/null; then
import sys
from importlib.metadata import version
sys.exit(any(version(name) != wanted for name, wanted in (spec.split("==") for spec in sys.argv[1:])))
PY
  say "installing ${model_packages[*]} into $venv"
  "$venv/bin/python" -m pip install -q "${model_packages[@]}"
fi
torch_prefix=$("$venv/bin/python" -c "import torch; print(torch.utils.cmake_prefix_path)" 2>/dev/null)

generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
if [ ! -f "$build/CMakeCache.txt" ]; then
  say "configuring $build"
  cmake -S "$repo" -B "$build" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$torch_prefix" \
    -DPython3_EXECUTABLE="$venv/bin/python" >&2
fi
# GNU nproc reports OMP_NUM_THREADS where a caller set it (to 1 for multi-process jobs): count the cores instead.
jobs=${SMP_JOBS:-$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)}
say "building ($jobs jobs)"
cmake --build "$build" --parallel "$jobs" >&2
say "ready: $build/bin"
