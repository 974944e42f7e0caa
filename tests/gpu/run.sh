#!/usr/bin/env bash
# Builds and runs every GPU test and the kernel benchmarks on a machine with an NVIDIA GPU,
# and prints pass/fail and the CUDA timings next to the CPU reference.
#
#   tests/gpu/run.sh [BUILD_DIR]        (default: build-gpu)
#
# Environment: KVCM_CUDA_ARCH (CMAKE_CUDA_ARCHITECTURES, default 90 = H100/H200),
# KVCM_BENCH_MIN_TIME (seconds per benchmark, default 0.2), KVCM_SKIP_BENCH=1.
# Works on a bare copy of the repository: it installs the Debian packages it needs with
# scripts/install-deps.sh only when cmake, ninja, GoogleTest, Google Benchmark, Abseil or
# nlohmann-json are missing. The build is gRPC-free (KVCM_ENGINE_ONLY) and Release.
# Exit status: 0 when every test passed and no benchmark failed, 1 otherwise.
set -euo pipefail
cd "$(dirname "$0")/../.."
build=${1:-build-gpu}
min_time=${KVCM_BENCH_MIN_TIME:-0.2}
t0=$(date +%s)
phase_start=""

say() { printf '%s\n' "$*"; }
phase() {  # prints the previous phase's duration, then the new phase's title
  local now
  now=$(date +%s)
  [ -z "$phase_start" ] || say "   ($((now - phase_start)) s)"
  phase_start=$now
  printf '\n== %s\n' "$*"
}

phase "device"
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader ||
    say "nvidia-smi: failed (driver not loaded?)"
  gpus=$(nvidia-smi --list-gpus 2>/dev/null | wc -l || true)
else
  say "nvidia-smi: not found; the GPU tests will skip"
  gpus=0
fi

phase "toolchain"
if ! command -v nvcc >/dev/null 2>&1 && [ -x /usr/local/cuda/bin/nvcc ]; then
  export PATH="/usr/local/cuda/bin:$PATH"
fi
if ! command -v nvcc >/dev/null 2>&1; then
  say "FAIL: nvcc not found (install the CUDA toolkit or put its bin/ on PATH)"
  exit 1
fi
say "nvcc: $(nvcc --version | tail -1)"
missing=()
for tool in cmake ninja g++; do command -v "$tool" >/dev/null 2>&1 || missing+=("$tool"); done
for pkg in libgtest-dev libgmock-dev libbenchmark-dev libabsl-dev nlohmann-json3-dev; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" ||
    missing+=("$pkg")
done
if [ ${#missing[@]} -gt 0 ]; then
  say "missing: ${missing[*]}; running scripts/install-deps.sh"
  scripts/install-deps.sh
else
  say "cmake, ninja, GoogleTest, Google Benchmark, Abseil, nlohmann-json: present"
fi

phase "configure ($build)"
# A build directory copied from another checkout cannot be reused.
if [ -f "$build/CMakeCache.txt" ] &&
   ! grep -qx "CMAKE_HOME_DIRECTORY:INTERNAL=$(pwd)" "$build/CMakeCache.txt"; then
  say "removing $build: it was configured for another source tree"
  rm -rf "$build"
fi
mkdir -p "$build"
if ! cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DKVCM_CUDA=ON \
     -DKVCM_ENGINE_ONLY=ON -DCMAKE_CUDA_ARCHITECTURES="${KVCM_CUDA_ARCH:-90}" \
     >"$build/configure.log" 2>&1; then
  cat "$build/configure.log"
  say "FAIL: configure"
  exit 1
fi
grep -E "kvcache-manager: CUDA" "$build/configure.log" || true

phase "build (GPU tests, host references, kvcache-kernel-bench)"
if ! cmake --build "$build" -j "$(nproc)" --target kvcm_gpu_checks >"$build/build.log" 2>&1; then
  tail -50 "$build/build.log"
  say "FAIL: build (full log: $build/build.log)"
  exit 1
fi
say "built"

phase "tests"
status=0
test_log="$build/gpu-tests.log"
# GPU tests (label gpu) and their host references: the pools and the rank join.
tests_ok=1
ctest --test-dir "$build" --output-on-failure --timeout 300 -j 4 -L gpu >"$test_log" 2>&1 ||
  tests_ok=0
ctest --test-dir "$build" --output-on-failure --timeout 300 -j 4 \
  -R 'HostRankJoin|BlockPool|BlockLease|HostKvStorage|CompactKvCpu|KvLayout' \
  >>"$test_log" 2>&1 || tests_ok=0
[ "$tests_ok" = 1 ] || status=1
# ctest's summary lines: "100% tests passed, 0 tests failed out of 130".
total=$(awk '/tests failed out of/ {n += $NF} END {print n + 0}' "$test_log")
failed=$(awk '/tests failed out of/ {n += $4} END {print n + 0}' "$test_log")
skipped=$(grep -cE '\*\*\*Skipped' "$test_log" || true)
passed=$((total - failed - skipped))
grep -E 'tests passed|tests failed' "$test_log" || true
if [ "$tests_ok" = 1 ]; then
  say "PASS: $passed passed, $skipped skipped"
else
  grep -E '\*\*\*(Failed|Timeout|Exception)|The following tests FAILED' -A40 "$test_log" | head -80
  say "FAIL: $failed failed, $passed passed, $skipped skipped (log: $test_log)"
fi
if [ "$gpus" -gt 0 ] && [ "$skipped" -gt 0 ]; then
  say "note: $skipped tests skipped although nvidia-smi lists $gpus GPU(s);" \
      "multi-rank NCCL cases need one GPU per rank, anything else skipped is a problem:"
  grep -E '\*\*\*Skipped' "$test_log" | sed -E 's/^ *[0-9]+\/[0-9]+ Test +#[0-9]+: ([^ ]+).*/  \1/' |
    grep -v 'NcclJoinTest.*/[248]$' || true
fi

if [ "${KVCM_SKIP_BENCH:-0}" != 1 ]; then
  phase "kernel benchmarks (CUDA next to the CPU reference)"
  bench_json="$build/kernel-bench.json"
  if "$build/bin/kvcache-kernel-bench" --benchmark_min_time="$min_time" \
       --benchmark_out="$bench_json" --benchmark_out_format=json; then
    if command -v python3 >/dev/null 2>&1; then
      python3 - "$bench_json" <<'PY' || status=1
import json, sys
runs = json.load(open(sys.argv[1]))["benchmarks"]
by = {}
errors = []
for r in runs:
    name = r["name"].replace("/manual_time", "")
    case, _, backend = name.rpartition("/")
    if r.get("error_occurred"):
        errors.append(f"{name}: {r.get('error_message', '')}")
        continue
    scale = {"ns": 1e-3, "us": 1.0, "ms": 1e3, "s": 1e6}[r.get("time_unit", "ns")]
    by.setdefault(case, {})[backend] = r["real_time"] * scale
print(f"\n{'case':34} {'cpu':>12} {'cuda':>12} {'speed-up':>9}")
for case, t in by.items():
    cpu, cuda = t.get("cpu"), t.get("cuda")
    cell = lambda v: f"{v:10.1f}us" if v is not None else f"{'-':>12}"
    ratio = f"{cpu / cuda:8.1f}x" if cpu and cuda else f"{'-':>9}"
    print(f"{case:34} {cell(cpu)} {cell(cuda)} {ratio}")
for e in errors:
    print("benchmark error:", e)
# No device is a skip, not a failure; anything else is.
sys.exit(1 if any("no CUDA device" not in e for e in errors) else 0)
PY
    fi
  else
    say "FAIL: kvcache-kernel-bench exited with an error"
    status=1
  fi
fi

phase "summary"
if [ "$status" = 0 ]; then
  say "gpu checks: PASS in $(( $(date +%s) - t0 )) s"
else
  say "gpu checks: FAIL in $(( $(date +%s) - t0 )) s"
fi
exit "$status"
