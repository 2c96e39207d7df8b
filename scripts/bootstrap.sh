#!/usr/bin/env bash
# Set up a fresh Debian/Ubuntu machine for aiodat: system packages (rdma-core, the
# QEMU test bed, perftest), then a virtual env at .venv with aiodat and its test tools.
# Safe to run again: it installs only what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

APT_PACKAGES=(
  # build and run aiodat
  gcc python3-dev python3-venv rdma-core ibverbs-providers libibverbs-dev librdmacm-dev
  # the rxe test bed (a QEMU guest of the distro kernel when the host kernel has no rxe)
  qemu-system-x86 linux-image-amd64 busybox-static kmod iproute2
  # tools the tests and benchmarks compare against
  ibverbs-utils rdmacm-utils perftest
  # rdma-core's own Python binding (for the system python3): the Python peer of aiodat bench
  python3-pyverbs
)

missing=()
for pkg in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "bootstrap: installing ${missing[*]}" >&2
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
.venv/bin/python -m pip install -q -e '.[test,docs,integrations]'
echo "bootstrap: ready (.venv, $(.venv/bin/python -c 'import aiodat; print("aiodat", aiodat.__version__)'))" >&2
