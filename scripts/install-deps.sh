#!/usr/bin/env bash
# Installs the Debian 12 packages kvcache-manager builds and tests with, skipping those
# already present. Safe to run repeatedly. Uses sudo when not root.
set -euo pipefail

packages=(
  build-essential cmake ninja-build pkg-config git
  libabsl-dev libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  prometheus-cpp-dev nlohmann-json3-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  python3 python3-grpcio python3-protobuf python3-pytest python3-yaml python3-numpy
  python3-torch libopenblas0-pthread python3-matplotlib
  python3-setuptools python3-wheel python3-venv
  prometheus yamllint unzip
  openssl libssl-dev
  libucx-dev
)
# Helm comes from an npm package at test time (tests/deploy); npm is on the machine image,
# Debian's package is the fallback.
command -v npm >/dev/null 2>&1 || packages+=(npm)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all ${#packages[@]} packages present"
  exit 0
fi
sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
echo "install-deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq
$sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
echo "install-deps: done"
