#!/usr/bin/env bash
# Builds, on a CPU machine with nvcc, everything the GPU check runs, into one directory
# that a bare CUDA machine (driver, CUDA runtime, Python with the nvidia-nccl wheel; no
# compiler, no package registry, no -dev packages) can run with
#   tests/gpu/run.sh --prebuilt build-gpu-carry
#
#   scripts/build-gpu-carry.sh [--from-build BUILD_DIR] [CARRY_DIR]   (default build-gpu-carry)
#
# Without --from-build it configures a Release CUDA build in CARRY_DIR.build
# (CMAKE_CUDA_ARCHITECTURES from KVCM_CUDA_ARCH, default 90 = H100/H200) and builds the
# GPU tests, their host references, kvcache-kernel-bench, kvcache-replay and kvcached (so
# it needs the Debian -dev packages of scripts/install-deps.sh). With it, it stages the
# binaries of an existing CUDA build (what the carry's CTest check does).
#
# The carry:
#   bin/       the test and tool executables, stripped; bin/kvcached is a launcher
#   libexec/   kvcached itself (CUDA-enabled), started through bin/kvcached
#   lib/       the shared libraries they need that a bare CUDA machine lacks (found with
#              ldd: gRPC, protobuf, Abseil, prometheus-cpp, UCX, OpenSSL, c-ares, re2,
#              Google Benchmark); NCCL is NOT bundled (218 MB): run.sh takes libnccl.so.2
#              from the machine's nvidia-nccl wheel
#   lib/compat the C++ runtime they were linked against, used only where the machine's
#              is older
#   data/      the golden vectors
#   python/    the Python client's wheel, when the build made it (run.sh installs it), and
#              site/ with pytest, used only where the machine's Python lacks it
#   src/       the repository's files the Python stage runs, at their repository paths
#              (tests/python, tests/gpu/worker_check.py, eval/kvcache_eval and its
#              weights, the docs the tests read)
#   MANIFEST   what was built from which commit, with sizes
#
# Library paths: the binaries find lib/ through LD_LIBRARY_PATH (run.sh for the tests;
# bin/kvcached for the daemon, so that the Python processes that start it keep the
# machine's own libssl, libz and libstdc++). Without patchelf (not a dependency) neither
# the binaries' RUNPATH nor the bundled libraries' can be rewritten after linking, and a
# RUNPATH on an executable does not reach the libraries' own dependencies; where patchelf
# is installed it also sets RUNPATH $ORIGIN/../lib on the executables and $ORIGIN on lib/.
# It must stay under 48 MiB; the script fails otherwise.
set -euo pipefail
cd "$(dirname "$0")/.."
from_build=""
if [ "${1:-}" = "--from-build" ]; then
  from_build=${2:?--from-build needs a build directory}
  shift 2
fi
carry=${1:-build-gpu-carry}
limit_mib=48
say() { printf 'build-gpu-carry: %s\n' "$*"; }

binaries=(gpu_kernel_parity_test gpu_block_pool_test kvcm_gpu_ipc_child gpu_device_engine_test
          device_engine_test rank_join_test pools_test kernels_test kvcache-kernel-bench
          kvcache-replay)
optional_binaries=(gpu_nccl_join_test)  # only when NCCL was found at build time

if [ -z "$from_build" ]; then
  if ! command -v nvcc >/dev/null 2>&1 && [ -x /usr/local/cuda/bin/nvcc ]; then
    export PATH="/usr/local/cuda/bin:$PATH"
  fi
  for tool in nvcc cmake ninja g++; do
    command -v "$tool" >/dev/null 2>&1 || { say "FAIL: $tool not found"; exit 1; }
  done
  build="$carry.build"
  say "configuring $build (CUDA arch ${KVCM_CUDA_ARCH:-90})"
  timeout 600 cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DKVCM_CUDA=ON \
    -DCMAKE_CUDA_ARCHITECTURES="${KVCM_CUDA_ARCH:-90}" \
    -DCMAKE_BUILD_RPATH='$ORIGIN/../lib' \
    >"$carry.configure.log" 2>&1 || { tail -30 "$carry.configure.log"; say "FAIL: configure"; exit 1; }
  say "building (log: $carry.build.log)"
  timeout 3600 cmake --build "$build" -j "${KVCM_BUILD_JOBS:-$(nproc)}" \
    --target kvcm_gpu_checks kvcached >"$carry.build.log" 2>&1 ||
    { tail -40 "$carry.build.log"; say "FAIL: build"; exit 1; }
  # The Python client's wheel, for run.sh to install; absent without protoc,
  # grpc_python_plugin or setuptools (the carry is complete without it).
  timeout 600 cmake --build "$build" --target kvcm_python_wheel >>"$carry.build.log" 2>&1 ||
    say "note: no Python wheel (target kvcm_python_wheel not built; see $carry.build.log)"
else
  build="$from_build"
fi
[ -d "$build/bin" ] || { say "FAIL: $build/bin does not exist"; exit 1; }
[ -x "$build/bin/gpu_kernel_parity_test" ] || { say "FAIL: $build is not a CUDA build (no GPU tests)"; exit 1; }

[ -x "$build/bin/kvcached" ] || { say "FAIL: $build/bin/kvcached was not built (an engine-only build?)"; exit 1; }
# A CUDA-enabled daemon links the CUDA runtime: statically (CMake's default; it then loads
# the driver by name) or as libcudart.
if ! ldd "$build/bin/kvcached" 2>/dev/null | grep -q libcudart && ! grep -q 'libcuda\.so' "$build/bin/kvcached"; then
  say "FAIL: $build/bin/kvcached does not link the CUDA runtime (built without CUDA?)"; exit 1
fi

rm -rf "$carry"
mkdir -p "$carry/bin" "$carry/libexec" "$carry/lib/compat" "$carry/data"
for b in "${binaries[@]}"; do
  [ -x "$build/bin/$b" ] || { say "FAIL: $build/bin/$b was not built"; exit 1; }
  cp "$build/bin/$b" "$carry/bin/"
done
for b in "${optional_binaries[@]}"; do
  if [ -x "$build/bin/$b" ]; then cp "$build/bin/$b" "$carry/bin/"; else say "note: no $b (built without NCCL)"; fi
done
cp "$build/bin/kvcached" "$carry/libexec/"
if command -v strip >/dev/null 2>&1; then
  strip --strip-unneeded "$carry"/bin/* "$carry"/libexec/* 2>/dev/null || true
fi

# Shared libraries: everything ldd resolves outside the C library, the C++ runtime, the
# CUDA driver and NCCL (a bare CUDA machine has the first three; NCCL comes from its
# wheel). The C++ runtime goes to lib/compat (run.sh uses it only when needed). UCX's
# transport modules (loaded from lib/ucx at run time) are not bundled: the daemon's UCX
# sidecar is for hand-offs between nodes, which the GPU check does not make.
declare -A bundled=()
for f in "$carry"/bin/* "$carry"/libexec/*; do
  while read -r name _ path _; do
    [ -n "${path:-}" ] && [ -f "$path" ] || continue
    case "$name" in
      linux-vdso*|ld-linux*|libc.so*|libm.so*|libdl.so*|libpthread.so*|librt.so*|libcuda.so*|libnccl.so*)
        continue ;;
      libstdc++.so*|libgcc_s.so*) dest="$carry/lib/compat" ;;
      *) dest="$carry/lib" ;;
    esac
    if [ -z "${bundled[$name]:-}" ]; then
      cp -L "$path" "$dest/$name"
      bundled[$name]=1
    fi
  done < <(ldd "$f" 2>/dev/null | awk '/=>/ {print $1, $2, $3, $4}')
done
if command -v strip >/dev/null 2>&1; then
  strip --strip-unneeded "$carry"/lib/*.so* "$carry"/lib/compat/*.so* 2>/dev/null || true
fi
# The newest C++ runtime version they need: run.sh adds lib/compat where the machine's
# libstdc++ lacks it.
grep -aohE 'GLIBCXX_3\.4\.[0-9]+' "$carry"/bin/* "$carry"/libexec/* "$carry"/lib/*.so* |
  sort -uV | tail -1 >"$carry/lib/compat/needs"
if command -v patchelf >/dev/null 2>&1; then
  for f in "$carry"/bin/* "$carry"/libexec/*; do patchelf --set-rpath '$ORIGIN/../lib' "$f"; done
  for f in "$carry"/lib/*.so* "$carry"/lib/compat/*.so*; do patchelf --set-rpath '$ORIGIN' "$f"; done
fi
# The daemon's launcher (after strip and patchelf, which it is not for): the carry's lib/,
# or the whole path run.sh found (KVCM_CARRY_LIBRARY_PATH: lib/, the C++ runtime where
# needed, NCCL), for kvcached alone.
cat >"$carry/bin/kvcached" <<'LAUNCHER'
#!/bin/sh
# kvcached of the GPU carry with the carry's libraries (scripts/build-gpu-carry.sh).
here=$(cd "$(dirname "$0")" && pwd)
LD_LIBRARY_PATH="${KVCM_CARRY_LIBRARY_PATH:-$here/../lib}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export LD_LIBRARY_PATH
exec "$here/../libexec/kvcached" "$@"
LAUNCHER
chmod +x "$carry/bin/kvcached"
cp -r tests/data/golden "$carry/data/"
# The Python client's wheel (clients/python/CMakeLists.txt), which run.sh installs.
wheel=$(ls "$build"/python/dist/kvcache_client-*-py3-none-any.whl 2>/dev/null | tail -1 || true)
if [ -n "$wheel" ]; then
  mkdir -p "$carry/python" && cp "$wheel" "$carry/python/"
else
  say "note: no Python wheel in $build/python/dist (build the target kvcm_python_wheel)"
fi
# pytest (pure Python) for a machine whose Python lacks it: the packages this machine's
# python3 (the first on PATH that has it) imports it from, without their bytecode.
pytest_from=""
for py in $(type -ap python3); do
  pytest_from=$("$py" -c 'import os, pytest; print(os.path.dirname(os.path.dirname(pytest.__file__)))' 2>/dev/null) && break
done
if [ -n "$pytest_from" ]; then
  mkdir -p "$carry/python/site"
  for p in pytest _pytest pluggy iniconfig packaging py.py; do
    [ -e "$pytest_from/$p" ] && cp -r "$pytest_from/$p" "$carry/python/site/"
  done
  find "$carry/python/site" -name __pycache__ -prune -exec rm -rf {} +
else
  say "note: no python3 on PATH has pytest: the carry brings none (the GPU machine's Python must have it)"
fi
# The repository's files the Python stage runs, at their repository paths (the tests find
# the repository root two folders above themselves).
(
  set -e
  mkdir -p "$carry/src/tests/python" "$carry/src/tests/gpu" "$carry/src/docs" \
    "$carry/src/eval/kvcache_eval" "$carry/src/eval/weights"
  cp tests/python/*.py "$carry/src/tests/python/"
  cp tests/gpu/worker_check.py "$carry/src/tests/gpu/"
  cp eval/kvcache_eval/*.py "$carry/src/eval/kvcache_eval/"
  cp eval/weights/decoder.pt "$carry/src/eval/weights/"
  cp docs/PYTHON.md docs/GPU.md "$carry/src/docs/"
  cp README.md "$carry/src/"
) || { say "FAIL: copying the Python stage's files"; exit 1; }

# What it is, and the size check.
bytes=$(du -sb "$carry" | awk '{print $1}')
{
  echo "kvcache-manager GPU carry"
  echo "commit: $(git rev-parse HEAD 2>/dev/null || echo unknown)$(git diff --quiet 2>/dev/null || echo ' (with uncommitted changes)')"
  echo "built: $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(uname -m), $(nvcc --version 2>/dev/null | tail -1 || echo 'nvcc ?')"
  echo "cuda arch: $(grep -E '^CMAKE_CUDA_ARCHITECTURES' "$build/CMakeCache.txt" | cut -d= -f2)"
  echo "build type: $(grep -E '^CMAKE_BUILD_TYPE' "$build/CMakeCache.txt" | cut -d= -f2)"
  echo "nccl: $([ -x "$carry/bin/gpu_nccl_join_test" ] && echo 'built (libnccl.so.2 from the machine)' || echo 'not built')"
  echo "python wheel: $([ -n "$wheel" ] && basename "$wheel" || echo 'none')"
  echo "daemon: libexec/kvcached (bin/kvcached starts it with the carry's libraries)"
  echo "bytes: $bytes"
  echo
  (cd "$carry" && find . -type f ! -name MANIFEST | sort | xargs ls -l | awk '{print $5, $9}')
} >"$carry/MANIFEST"
limit=$((limit_mib * 1024 * 1024))
say "$carry: $((bytes / 1024)) KiB in $(find "$carry" -type f | wc -l) files (limit $limit_mib MiB)"
if [ "$bytes" -ge "$limit" ]; then
  say "FAIL: the carry is $((bytes / 1024 / 1024)) MiB, over $limit_mib MiB"
  exit 1
fi
say "done: run it with tests/gpu/run.sh --prebuilt $carry"
