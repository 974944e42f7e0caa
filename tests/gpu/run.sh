#!/usr/bin/env bash
# The GPU check: every GPU test, the sanitizers where they work, the kernel benchmarks
# (which check their own results) and the golden vectors through kvcache-replay
# --device cuda, with a verdict.
#
#   tests/gpu/run.sh --prebuilt DIR   run a carry made by scripts/build-gpu-carry.sh; needs
#                                     no compiler, no package registry, no -dev packages:
#                                     only the NVIDIA driver, python3 (for the JSON) and,
#                                     for the NCCL test, libnccl.so.2 (the nvidia-nccl wheel)
#   tests/gpu/run.sh [DIR]            build the carry into DIR (default build-gpu-carry)
#                                     first, on this machine (nvcc, cmake, ninja, g++ and the
#                                     Debian -dev packages), then run it
#
# Every step runs under `timeout`. Logs, the gtest and benchmark JSON and gpu-check.json
# (the verdict and the figures) go to $OUT when it is set, else to a new /tmp directory.
# Environment: KVCM_STEP_TIMEOUT (seconds per step, default 240), KVCM_BENCH_MIN_TIME
# (seconds per benchmark, default 0.2), KVCM_SKIP_BENCH=1, KVCM_SKIP_SANITIZER=1,
# KVCM_SKIP_WORKER=1 (the Python stage), KVCM_NCCL_LIB_DIR (where libnccl.so.2 is),
# CUDA_VISIBLE_DEVICES (honoured).
#
# The Python stage (a GPU visible): the carry's client wheel installed into a virtual
# environment of the machine's python3 (its torch and grpcio), then
# tests/gpu/worker_check.py from the carry's src/: the torch-helper tests on CUDA, the
# short evaluation through the carry's kvcached (CUDA engine, then CPU engine: identical
# generations), decode tokens/s with each, the first step at a 128k-token prompt; its
# figures go into gpu-check.json under "worker".
#
# Exit status: 0 when everything passed; 1 when anything failed (with a GPU visible, any
# skipped test is a failure except the NCCL cases that need more GPUs than there are);
# 77 when no GPU is visible (after the host checks of the carry passed): it says "no GPU".
set -uo pipefail
cd "$(dirname "$0")/../.."
repo=$(pwd)

if [ "${1:-}" != "--prebuilt" ]; then
  carry=${1:-build-gpu-carry}
  scripts/build-gpu-carry.sh "$carry" || exit 1
  exec "$0" --prebuilt "$carry"
fi
carry=${2:?usage: tests/gpu/run.sh --prebuilt DIR}
carry=$(cd "$carry" 2>/dev/null && pwd) || { echo "FAIL: no carry at ${2}"; exit 1; }
out=${OUT:-}
[ -n "$out" ] || out=$(mktemp -d /tmp/kvcm-gpu-check.XXXXXX)
mkdir -p "$out/logs" "$out/tests" "$out/replay"
step_timeout=${KVCM_STEP_TIMEOUT:-240}
min_time=${KVCM_BENCH_MIN_TIME:-0.2}
t0=$(date +%s)
status=0
failures=()
notes=()

say() { printf '%s\n' "$*"; }
fail() { failures+=("$*"); say "FAIL: $*"; status=1; }
note() { notes+=("$*"); say "note: $*"; }
phase_start=""
phase() {
  local now
  now=$(date +%s)
  [ -z "$phase_start" ] || say "   ($((now - phase_start)) s)"
  phase_start=$now
  printf '\n== %s\n' "$*"
}
# run NAME SECONDS CMD...: runs under timeout, output to $out/logs/NAME.log; returns its status.
run() {
  local name=$1 seconds=$2
  shift 2
  timeout --kill-after=10 "$seconds" "$@" >"$out/logs/$name.log" 2>&1
  local rc=$?
  [ "$rc" -ne 124 ] && [ "$rc" -ne 137 ] || say "   $name: timed out after $seconds s"
  return "$rc"
}

phase "device"
smi_gpus=0
if command -v nvidia-smi >/dev/null 2>&1; then
  if timeout 30 nvidia-smi --query-gpu=index,name,driver_version,memory.total,uuid,pci.bus_id \
       --format=csv,noheader >"$out/logs/nvidia-smi.log" 2>&1; then
    cat "$out/logs/nvidia-smi.log"
    smi_gpus=$(grep -c . "$out/logs/nvidia-smi.log" || true)
  else
    say "nvidia-smi: failed ($(head -1 "$out/logs/nvidia-smi.log"))"
  fi
else
  say "nvidia-smi: not found"
fi
hardware=0
[ "$smi_gpus" -gt 0 ] && hardware=1
ls /dev/nvidia[0-9]* >/dev/null 2>&1 && hardware=1
[ -n "$(ls -A /proc/driver/nvidia/gpus 2>/dev/null)" ] && hardware=1
visible=$smi_gpus
if [ -n "${CUDA_VISIBLE_DEVICES+set}" ]; then
  case "${CUDA_VISIBLE_DEVICES}" in
    ""|-1|none|NoDevFiles) visible=0 ;;
    *) n=$(awk -F, '{print NF}' <<<"$CUDA_VISIBLE_DEVICES")
       [ "$n" -lt "$visible" ] && visible=$n ;;
  esac
  say "CUDA_VISIBLE_DEVICES='${CUDA_VISIBLE_DEVICES}': $visible visible"
fi
if [ "$hardware" = 1 ] && [ "$smi_gpus" = 0 ]; then
  fail "this machine shows an NVIDIA GPU (/dev/nvidia*, /proc/driver/nvidia) but nvidia-smi lists none: broken driver?"
fi

phase "carry ($carry)"
[ -f "$carry/MANIFEST" ] && [ -d "$carry/bin" ] || { say "FAIL: $carry is not a carry (no MANIFEST or bin/)"; exit 1; }
sed -n '1,8p' "$carry/MANIFEST"
libs="$carry/lib"
# The bundled C++ runtime only where the machine's is older than the one linked against.
ldconfig=$(command -v ldconfig || echo /sbin/ldconfig)
system_cxx=$("$ldconfig" -p 2>/dev/null | awk '/libstdc\+\+\.so\.6 / {print $NF; exit}')
cxx_needed=$(cat "$carry/lib/compat/needs" 2>/dev/null)  # what the carry needs
[ -n "$cxx_needed" ] || cxx_needed=GLIBCXX_3.4.29
if [ -z "$system_cxx" ] || ! grep -qF "$cxx_needed" "$system_cxx" 2>/dev/null; then
  libs="$libs:$carry/lib/compat"
  note "using the carry's libstdc++ (the machine's is missing or older than $cxx_needed)"
fi
nccl_dir=${KVCM_NCCL_LIB_DIR:-}
if [ -z "$nccl_dir" ] && command -v python3 >/dev/null 2>&1; then
  nccl_dir=$(timeout 30 python3 -c 'import os, nvidia.nccl as n; print(os.path.join(list(n.__path__)[0], "lib"))' 2>/dev/null || true)
fi
if [ -z "$nccl_dir" ] || [ ! -e "$nccl_dir/libnccl.so.2" ]; then
  nccl_dir=""
  for d in $("$ldconfig" -p 2>/dev/null | awk '/libnccl\.so\.2 / {print $NF}' | xargs -r -n1 dirname) \
           /usr/local/cuda/lib /usr/local/cuda/lib64 /usr/lib/x86_64-linux-gnu; do
    [ -e "$d/libnccl.so.2" ] && { nccl_dir=$d; break; }
  done
fi
[ -n "$nccl_dir" ] && libs="$libs:$nccl_dir" && say "NCCL: $nccl_dir/libnccl.so.2"
# The test binaries run with the carry's libraries on LD_LIBRARY_PATH; Python keeps the
# machine's own (its ssl, zlib and C++ runtime) and starts kvcached through the carry's
# launcher bin/kvcached, which takes this path from KVCM_CARRY_LIBRARY_PATH.
machine_ld_path=${LD_LIBRARY_PATH:-}
export KVCM_CARRY_LIBRARY_PATH="$libs"
export LD_LIBRARY_PATH="$libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export KVCM_TEST_DATA_DIR="$carry/data"
[ "$smi_gpus" -gt 0 ] && [ "$visible" = "$smi_gpus" ] && export KVCM_EXPECT_GPUS=$visible
have_python=0
venv_python=""  # the client installed (python_wheel_check)
command -v python3 >/dev/null 2>&1 && have_python=1
[ "$have_python" = 1 ] || note "python3 not found: skips cannot be told apart, the JSON is not written"

# gtest BINARY [FILTER]: runs a test binary, JSON to $out/tests/BINARY.json.
gtest() {
  local bin=$1 filter=${2:-*} name=${3:-$1}
  if [ ! -x "$carry/bin/$bin" ]; then fail "$bin is not in the carry"; return 1; fi
  run "$name" "$step_timeout" "$carry/bin/$bin" --gtest_filter="$filter" \
      --gtest_output="json:$out/tests/$name.json"
  local rc=$?
  local summary
  summary=$(grep -E '^\[  (PASSED|FAILED|SKIPPED) +\]' "$out/logs/$name.log" | head -3 | tr '\n' ' ')
  say "   $name: exit $rc ${summary}"
  if [ "$rc" -ne 0 ]; then
    grep -E '^\[  FAILED  \]|Failure|error:' "$out/logs/$name.log" | head -15 | sed 's/^/     /'
    fail "$name (log: $out/logs/$name.log)"
  fi
  return "$rc"
}

phase "host checks (the carry's binaries start here; no GPU needed)"
gtest device_engine_test
gtest rank_join_test
gtest kernels_test
gtest pools_test
gtest gpu_kernel_parity_test 'CudaAdapterTest.*:DeviceCountTest.*' device_count
gtest gpu_block_pool_test 'CudaBlockPoolTest.HostStorageHasNoCudaExport:CudaBlockPoolTest.RejectsADeviceThatDoesNotExist' pool_host

# kvcached from the carry, as the Python stage starts it: the launcher, nothing of the
# carry on LD_LIBRARY_PATH, the CPU engine; it must serve (write its port file) and drain
# on SIGTERM (exit 0).
daemon_check() {
  local dir="$out/daemon-check" pid rc waited=0
  rm -rf "$dir" && mkdir -p "$dir"
  [ -x "$carry/bin/kvcached" ] && [ -x "$carry/libexec/kvcached" ] ||
    { fail "kvcached is not in the carry (bin/kvcached, libexec/kvcached)"; return 1; }
  LD_LIBRARY_PATH="$machine_ld_path" "$carry/bin/kvcached" --listen=127.0.0.1:0 \
    --metrics_listen=127.0.0.1:0 --port_file="$dir/ports.json" --engine_backend=cpu \
    >"$out/logs/kvcached-start.log" 2>&1 &
  pid=$!
  while [ ! -s "$dir/ports.json" ] && kill -0 "$pid" 2>/dev/null && [ "$waited" -lt 300 ]; do
    sleep 0.1; waited=$((waited + 1))
  done
  if [ ! -s "$dir/ports.json" ]; then
    kill -KILL "$pid" 2>/dev/null; wait "$pid" 2>/dev/null
    tail -5 "$out/logs/kvcached-start.log" | sed 's/^/     /'
    fail "the carry's kvcached did not start (log: $out/logs/kvcached-start.log)"
    return 1
  fi
  kill -TERM "$pid"
  wait "$pid"
  rc=$?
  if [ "$rc" -ne 0 ]; then
    fail "the carry's kvcached exited $rc after SIGTERM (log: $out/logs/kvcached-start.log)"
    return 1
  fi
  say "   kvcached: served on $(cat "$dir/ports.json") and drained"
}
daemon_check

# The Python client's wheel (the carry's python/), installed as a user would: a virtual
# environment on this machine's python3 that sees its grpcio, protobuf and torch, the wheel
# without dependencies (no registry here), then the client, its stubs and kvcache_client.torch
# imported from outside the carry. A python3 without those packages is a note, not a failure.
# Called with a GPU visible only (after the no-GPU exit), which keeps that path short.
python_wheel_check() {
  local wheel venv="$out/python-venv"
  venv_python=""
  wheel=$(ls "$carry"/python/kvcache_client-*.whl 2>/dev/null | tail -1)
  [ -n "$wheel" ] || { note "no Python wheel in the carry: the client's install was not checked"; return 0; }
  [ "$have_python" = 1 ] || return 0
  if ! run python_deps 120 python3 -c 'import grpc, google.protobuf, torch'; then
    note "python3 lacks grpcio, protobuf or torch: the wheel was not installed ($(tail -1 "$out/logs/python_deps.log"))"
    return 0
  fi
  # Without ensurepip (Debian without python3-venv), the system's pip serves the venv.
  run python_venv 120 python3 -m venv --system-site-packages "$venv" ||
    run python_venv 120 python3 -m venv --system-site-packages --without-pip "$venv" ||
    { fail "python3 -m venv failed (logs/python_venv.log)"; return 0; }
  run python_wheel_install 180 env -u PYTHONPATH "$venv/bin/python" -m pip install --no-index \
      --no-deps --disable-pip-version-check "$wheel" ||
    { fail "pip could not install $(basename "$wheel") (logs/python_wheel_install.log)"; return 0; }
  (cd "$out" && run python_wheel_import 180 env -u PYTHONPATH "$venv/bin/python" -c '
import sys, kvcache_client, kvcache_client.torch, kvcache.v1.kvcache_pb2_grpc as g
for m in (kvcache_client, kvcache_client.torch, g):
    assert m.__file__.startswith(sys.prefix), f"{m.__name__} from {m.__file__}, not {sys.prefix}"
    print(m.__name__, m.__file__)') ||
    { fail "the installed wheel does not import (logs/python_wheel_import.log)"; return 0; }
  say "python wheel: $(basename "$wheel") installed and imported"
  venv_python="$venv/bin/python"
}

# The worker (tests/gpu/worker_check.py from the carry's src/) on the installed client,
# pytest from the carry where the machine's Python has none; its figures land in
# worker-check.json, which write_json puts into gpu-check.json.
python_worker_check() {
  local site="" rc
  [ -n "$venv_python" ] || { note "the Python worker did not run (the client wheel is not installed)"; return 0; }
  if ! env -u PYTHONPATH "$venv_python" -c 'import pytest' >/dev/null 2>&1; then
    if [ -d "$carry/python/site" ]; then
      site="$carry/python/site"
      note "pytest from the carry (the machine's Python has none)"
    else
      note "no pytest: the torch-helper tests will not run"
    fi
  fi
  (cd "$out" && run python_worker $((step_timeout * 3)) env -u PYTHONPATH ${site:+PYTHONPATH="$site"} \
      LD_LIBRARY_PATH="$machine_ld_path" KVCM_KVCACHED="$carry/bin/kvcached" \
      "$venv_python" "$carry/src/tests/gpu/worker_check.py" --device cuda \
      --kvcached "$carry/bin/kvcached" --out "$out/worker-check.json" --pytest-timeout "$step_timeout" \
      --log-dir "$out/logs")
  rc=$?
  grep -E '^(worker|pytest|eval|decode|first step|FAIL)' "$out/logs/python_worker.log" | sed 's/^/   /'
  [ "$rc" -eq 0 ] || fail "the Python worker check failed (exit $rc; log: $out/logs/python_worker.log)"
}

write_json() {  # the verdict and the figures, from the logs and JSON written so far
  [ "$have_python" = 1 ] || return 0
  timeout 60 python3 - "$out" "$1" "$visible" "$(( $(date +%s) - t0 ))" "$carry" \
      "${failures[@]+"${failures[@]}"}" <<'PY' || true
import glob, json, os, sys
out, verdict, visible, seconds, carry, *failures = sys.argv[1:]
result = {"verdict": verdict, "gpus_visible": int(visible), "seconds": int(seconds),
          "carry": carry, "failures": failures, "devices": [], "tests": {}, "benchmarks": {},
          "goals": {}, "sanitizer": {}, "replay": {}}
smi = os.path.join(out, "logs", "nvidia-smi.log")
if os.path.exists(smi):
    result["devices"] = [l.strip() for l in open(smi) if l.strip() and "," in l]
for path in sorted(glob.glob(os.path.join(out, "tests", "*.json"))):
    try:
        data = json.load(open(path))
    except Exception as e:
        result["tests"][os.path.basename(path)] = {"error": str(e)}
        continue
    counts = {"passed": 0, "failed": 0, "skipped": 0, "skipped_names": []}
    for suite in data.get("testsuites", []):
        for t in suite.get("testsuite", []):
            name = f'{suite["name"]}.{t["name"]}'
            if t.get("result") == "SKIPPED" or t.get("status") == "NOTRUN":
                counts["skipped"] += 1
                counts["skipped_names"].append(name)
            elif t.get("failures"):
                counts["failed"] += 1
            else:
                counts["passed"] += 1
    result["tests"][os.path.basename(path)[:-5]] = counts
bench = os.path.join(out, "kernel-bench.json")
if os.path.exists(bench):
    try:
        for r in json.load(open(bench))["benchmarks"]:
            name = r["name"].replace("/manual_time", "")
            scale = {"ns": 1e-3, "us": 1.0, "ms": 1e3, "s": 1e6}[r.get("time_unit", "ns")]
            entry = {"error": r.get("error_message")} if r.get("error_occurred") else \
                    {"us": r["real_time"] * scale, "gpu_us": r.get("gpu_us")}
            result["benchmarks"][name] = entry
    except Exception as e:
        result["benchmarks"] = {"error": str(e)}
b = result["benchmarks"] if isinstance(result["benchmarks"], dict) else {}
def us(name):
    return b.get(name, {}).get("us") if isinstance(b.get(name), dict) else None
first, steady = us("FirstStep128k/float32/cuda"), us("SteadyStep6400/float32/cuda")
result["goals"]["first_step_128k_x32_under_200us"] = None if first is None else first < 200
result["goals"]["steady_step_6400_under_20us_end_to_end"] = None if steady is None else steady < 20
for kind in ("replay", "sanitizer"):
    path = os.path.join(out, f"{kind}.txt")
    if os.path.exists(path):
        for line in open(path):
            key, _, value = line.strip().partition(" ")
            if key:
                result[kind][key] = value
if result["replay"]:
    result["goals"]["golden_vectors_exact_through_replay_device_cuda"] = all(
        v == "exact" for v in result["replay"].values())
worker = os.path.join(out, "worker-check.json")
if os.path.exists(worker):
    try:
        result["worker"] = w = json.load(open(worker))
        result["goals"]["worker_torch_tests_ran_on_cuda"] = w.get("pytest", {}).get("ok")
        result["goals"]["worker_generations_identical_cuda_vs_cpu_engine"] = \
            w.get("eval", {}).get("identical")
    except Exception as e:
        result["worker"] = {"error": str(e)}
json.dump(result, open(os.path.join(out, "gpu-check.json"), "w"), indent=2)
PY
}

if [ "$visible" = 0 ]; then
  phase "summary"
  if [ "$status" != 0 ]; then
    write_json fail
    say "gpu checks: FAIL (host checks; no GPU visible) in $(( $(date +%s) - t0 )) s; logs: $out"
    exit 1
  fi
  write_json no-gpu
  if [ "$hardware" = 1 ]; then
    say "no GPU: CUDA_VISIBLE_DEVICES hides every GPU of this machine; the host checks passed"
  else
    say "no GPU: this machine has no NVIDIA GPU; the carry's host checks passed, the GPU checks did not run"
  fi
  say "logs and gpu-check.json: $out"
  exit 77
fi

phase "Python client wheel"
python_wheel_check

phase "GPU tests ($visible GPU(s))"
gtest gpu_kernel_parity_test
gtest gpu_block_pool_test
gtest gpu_device_engine_test
if [ -x "$carry/bin/gpu_nccl_join_test" ]; then
  if [ -z "$nccl_dir" ]; then
    fail "gpu_nccl_join_test: libnccl.so.2 not found (install the nvidia-nccl wheel or set KVCM_NCCL_LIB_DIR)"
  else
    gtest gpu_nccl_join_test
  fi
else
  note "the carry has no NCCL test (built without NCCL)"
fi
# With a GPU, a skip is a failure, except NCCL cases that need more GPUs than are visible.
if [ "$have_python" = 1 ]; then
  timeout 60 python3 - "$out/tests" "$visible" >"$out/logs/skips.log" 2>&1 <<'PY'
import glob, json, re, sys
tests, visible = sys.argv[1], int(sys.argv[2])
bad = []
for path in glob.glob(tests + "/*.json"):
    if path.endswith(("device_count.json", "pool_host.json")):
        continue
    for suite in json.load(open(path)).get("testsuites", []):
        for t in suite.get("testsuite", []):
            if t.get("result") != "SKIPPED":
                continue
            name = f'{suite["name"]}.{t["name"]}'
            m = re.search(r"NcclJoinTest\.\w+/ranks(\d+)$", name)
            if m and int(m.group(1)) > visible:
                continue
            bad.append(name)
for name in bad:
    print(name)
sys.exit(1 if bad else 0)
PY
  if [ $? -ne 0 ]; then
    sed 's/^/     skipped: /' "$out/logs/skips.log" | head -20
    fail "tests skipped on a machine with $visible GPU(s) (only NCCL cases needing more GPUs may skip)"
  fi
fi

phase "compute-sanitizer"
sanitizer=$(command -v compute-sanitizer || true)
for c in /usr/local/cuda/bin/compute-sanitizer /usr/local/cuda/compute-sanitizer/compute-sanitizer \
         /usr/local/cuda-*/bin/compute-sanitizer; do
  [ -n "$sanitizer" ] || { [ -x "$c" ] && sanitizer=$c; }
done
: >"$out/sanitizer.txt"
if [ "${KVCM_SKIP_SANITIZER:-0}" = 1 ]; then
  note "compute-sanitizer skipped (KVCM_SKIP_SANITIZER=1)"
elif [ -z "$sanitizer" ]; then
  note "compute-sanitizer not found: memcheck and racecheck did not run"
  echo "available no" >>"$out/sanitizer.txt"
else
  # sanitize NAME TOOL TEST FILTER: 0 clean; 86 errors found; 1 test failures; else unusable.
  sanitize() {
    local name=$1 tool=$2 test=$3 filter=$4
    run "sanitizer-$name" "$step_timeout" "$sanitizer" --tool "$tool" --error-exitcode 86 \
        --print-limit 20 "$carry/bin/$test" --gtest_filter="$filter"
    local rc=$?
    case $rc in
      0) say "   $tool ($name): clean"; echo "$name clean" >>"$out/sanitizer.txt" ;;
      86) fail "compute-sanitizer $tool found errors ($name; log: $out/logs/sanitizer-$name.log)"
          echo "$name errors" >>"$out/sanitizer.txt" ;;
      1) fail "tests failed under compute-sanitizer $tool ($name)"; echo "$name test-failure" >>"$out/sanitizer.txt" ;;
      124|137) fail "compute-sanitizer $tool ($name) timed out after $step_timeout s"
               echo "$name timeout" >>"$out/sanitizer.txt" ;;
      *) note "compute-sanitizer $tool does not work here (exit $rc; log: $out/logs/sanitizer-$name.log)"
         echo "$name unusable" >>"$out/sanitizer.txt" ;;
    esac
  }
  # memcheck on the parity cases (the sizes up to 4,096 and the steady step's real shape),
  # racecheck on the single-block selection and removal kernels.
  sanitize memcheck memcheck gpu_kernel_parity_test \
    'SizesAndDtypes/*_n1:SizesAndDtypes/*_n7:SizesAndDtypes/*_n111:SizesAndDtypes/*_n4096:Sizes/ArrayKernelParityTest.*/0:Sizes/ArrayKernelParityTest.*/1:Sizes/ArrayKernelParityTest.*/2:Sizes/ArrayKernelParityTest.*/3:RealShapes/*SteadyStep6400*:MovesAndLayouts/*moves111*'
  sanitize racecheck racecheck gpu_kernel_parity_test \
    'Sizes/ArrayKernelParityTest.SelectLowest*/2:Sizes/ArrayKernelParityTest.SelectLowest*/3:Sizes/ArrayKernelParityTest.RemoveEntries*/2:Sizes/ArrayKernelParityTest.RemoveEntries*/3:Sizes/ArrayKernelParityTest.MeanMomentum*/3'
  # memcheck on the engine's stream order: threads stepping sequences at once on streams of
  # their own, a sequence stepped by another thread than its own, arrays grown and freed
  # stream-ordered (a kernel reading memory freed on another stream shows up here).
  sanitize engine-streams memcheck gpu_device_engine_test \
    'DeviceEngineTest.Threads*:DeviceEngineTest.ASequenceSteppedByAnotherThread*:DeviceEngineTest.GrowingArrays*'
fi

phase "golden vectors through kvcache-replay --device cuda"
: >"$out/replay.txt"
mismatches=0
for trace in "$carry"/data/golden/*.trace.jsonl; do
  name=$(basename "$trace" .trace.jsonl)
  for tp in 1 2; do
    run "replay-$name-tp$tp" "$step_timeout" "$carry/bin/kvcache-replay" --device cuda --tp "$tp" \
        --trace "$trace" --out "$out/replay/$name.tp$tp.jsonl"
    rc=$?
    if [ "$rc" -ne 0 ]; then
      echo "$name.tp$tp error" >>"$out/replay.txt"; mismatches=$((mismatches + 1))
      say "   $name (tp $tp): kvcache-replay failed: $(tail -1 "$out/logs/replay-$name-tp$tp.log")"
    elif cmp -s "$out/replay/$name.tp$tp.jsonl" "$carry/data/golden/$name.decisions.jsonl"; then
      echo "$name.tp$tp exact" >>"$out/replay.txt"
    else
      echo "$name.tp$tp differs" >>"$out/replay.txt"; mismatches=$((mismatches + 1))
      say "   $name (tp $tp): decisions differ from the golden file"
    fi
  done
done
if [ "$mismatches" = 0 ]; then
  say "   every golden vector exact ($(grep -c exact "$out/replay.txt") replays)"
else
  fail "$mismatches golden replays on the GPU failed or differ"
fi

if [ "${KVCM_SKIP_BENCH:-0}" != 1 ]; then
  phase "kernel benchmarks (CUDA next to the CPU reference; each checks its own result)"
  run kernel-bench "$step_timeout" "$carry/bin/kvcache-kernel-bench" \
      --benchmark_min_time="$min_time" --benchmark_out="$out/kernel-bench.json" \
      --benchmark_out_format=json
  rc=$?
  if [ "$rc" -ne 0 ]; then
    tail -20 "$out/logs/kernel-bench.log"
    fail "kvcache-kernel-bench exited $rc"
  elif [ "$have_python" = 1 ]; then
    timeout 60 python3 - "$out/kernel-bench.json" <<'PY' || fail "a kernel benchmark reported an error"
import json, sys
runs = json.load(open(sys.argv[1]))["benchmarks"]
by, errors = {}, []
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
sys.exit(1 if errors else 0)  # with a GPU visible, every error counts (a wrong result too)
PY
  fi
fi

if [ "${KVCM_SKIP_WORKER:-0}" = 1 ]; then
  note "the Python worker stage skipped (KVCM_SKIP_WORKER=1)"
else
  phase "Python worker (torch-helper tests on CUDA, the evaluation through the carry's kvcached)"
  python_worker_check
fi

phase "summary"
verdict=pass
[ "$status" = 0 ] || verdict=fail
write_json "$verdict"
for f in "${failures[@]+"${failures[@]}"}"; do say "  failed: $f"; done
for n in "${notes[@]+"${notes[@]}"}"; do say "  note: $n"; done
say "gpu checks: $(tr a-z A-Z <<<"$verdict") on $visible GPU(s) in $(( $(date +%s) - t0 )) s; logs and gpu-check.json: $out"
exit "$status"
