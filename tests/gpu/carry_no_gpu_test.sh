#!/usr/bin/env bash
# CTest gpu_carry_no_gpu_path: the GPU check's carry flow short of a device, on any
# machine. Stages a carry from this build (scripts/build-gpu-carry.sh --from-build), runs
# tests/gpu/run.sh --prebuilt on it with every GPU hidden (CUDA_VISIBLE_DEVICES=""), and
# requires what a machine without a GPU must get: the carry's libraries are all its
# binaries (kvcached included) need beyond the C library, the C++ runtime and NCCL; the
# carry's host checks pass (kvcached serves from the carry, nothing of it on
# LD_LIBRARY_PATH), the run says "no GPU", exits 77 and writes gpu-check.json with the
# verdict "no-gpu".
#
#   tests/gpu/carry_no_gpu_test.sh BUILD_DIR
set -uo pipefail
build=$(cd "${1:?usage: carry_no_gpu_test.sh BUILD_DIR}" && pwd)
repo=$(cd "$(dirname "$0")/../.." && pwd)
work=$(mktemp -d /tmp/kvcm-carry-test.XXXXXX)
trap 'rm -rf "$work"' EXIT
"$repo/scripts/build-gpu-carry.sh" --from-build "$build" "$work/carry" >"$work/stage.log" 2>&1 ||
  { cat "$work/stage.log"; echo "FAIL: staging the carry"; exit 1; }
# Nothing of this machine's beyond what a bare CUDA machine has: with the carry's lib/ on
# the path, every library ldd resolves outside the carry is the C library's, the C++
# runtime's (lib/compat holds a copy) or NCCL (the machine's wheel brings it).
outside=$(for f in "$work/carry"/bin/* "$work/carry"/libexec/*; do
            LD_LIBRARY_PATH="$work/carry/lib" ldd "$f" 2>/dev/null | awk -v f="${f##*/}" '/=>/ {print f ": " $1 " => " $3}'
          done | grep -v " => $work/carry/" |
          grep -vE ': (libc|libm|libdl|libpthread|librt|libstdc\+\+|libgcc_s|libnccl)\.so' || true)
[ -z "$outside" ] || { echo "$outside"; echo "FAIL: the carry's binaries need libraries it lacks"; exit 1; }
env -u LD_LIBRARY_PATH CUDA_VISIBLE_DEVICES="" OUT="$work/out" timeout 120 "$repo/tests/gpu/run.sh" --prebuilt "$work/carry" \
  >"$work/run.log" 2>&1
rc=$?
cat "$work/run.log"
[ "$rc" = 77 ] || { echo "FAIL: run.sh exited $rc, want 77"; exit 1; }
grep -q "^no GPU" "$work/run.log" || { echo "FAIL: run.sh did not say \"no GPU\""; exit 1; }
if command -v python3 >/dev/null 2>&1; then
  python3 -c 'import json,sys; v=json.load(open(sys.argv[1]))["verdict"]; sys.exit(v != "no-gpu")' \
    "$work/out/gpu-check.json" || { echo "FAIL: gpu-check.json lacks the verdict no-gpu"; exit 1; }
fi
echo "PASS: the carry flow says no GPU and exits 77"
