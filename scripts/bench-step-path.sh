#!/usr/bin/env bash
# The step-path figures of docs/BENCHMARKS.md, in one run: kvcache-loadgen against a fresh
# kvcached (loopback, host backend) for each transport (grpc, shm, created), layout
# (per-layer, folded) and engine-thread count, next to the in-process engine doing the
# same work.
#   scripts/bench-step-path.sh [BIN_DIR]        (default build/bin; DURATION=10s)
#   ENGINE=emulated ROWS=transports scripts/bench-step-path.sh
# ENGINE: kvcached's --engine_backend (cpu; emulated: the device code path on the CPU).
# ROWS=transports: only the three transports, per layer, default engine threads.
# Loadgen and daemon share the machine's cores, as they do on a worker node.
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${1:-build/bin}
duration=${DURATION:-10s}
engine=${ENGINE:-cpu}
load=(--sequences=64 --streams=4 --layers=32 --context=65536 --compression_ratio=0.9
      --dtype=float16 --policy=inertia --duration="$duration")
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT

# run THREADS TRANSPORT FOLDED EMBEDDED: prints the loadgen row.
run() {
  local threads=$1 transport=$2 folded=$3 embedded=$4
  rm -f "$dir/port"
  "$bin/kvcached" --listen=127.0.0.1:0 --metrics_listen= --port_file="$dir/port" \
    --allow_shm_scores --engine_threads="$threads" --engine_backend="$engine" \
    2>"$dir/kvcached.log" &
  local pid=$!
  for _ in $(seq 100); do [ -s "$dir/port" ] && break; sleep 0.1; done
  local addr
  addr=$(sed -E 's/.*"grpc": "([^"]+)".*/\1/' "$dir/port")
  local row
  row=$("$bin/kvcache-loadgen" --server="$addr" "${load[@]}" --transport="$transport" \
          --folded="$folded" --embedded="$embedded" | tail -n 1)
  kill -TERM "$pid"; wait "$pid" || true
  printf '%-4s %-6s %-6s %s\n' "$threads" "$transport" "$folded" "$row"
}

echo "engine $engine"
echo "threads transport folded | policy budget seq-steps/s p50_ms p99_ms bytes/step scored step1_ms [in-process/s ratio]"
if [ "${ROWS:-all}" = transports ]; then
  run 0 grpc false true
  run 0 shm false false
  run 0 created false false
  exit 0
fi
run 0 grpc false true
run 0 shm false false
run 0 created false false
run 0 grpc true true
run 0 shm true false
run 0 created true false
for threads in 1 2; do
  run "$threads" grpc false false
  run "$threads" shm false false
  run "$threads" grpc true false
  run "$threads" shm true false
done
