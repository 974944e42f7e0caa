#!/usr/bin/env bash
# The main job (README.md): installs what is missing, builds, starts kvcached on its
# default host backend on loopback, runs a demo worker against it, prints the per-policy
# tables, and stops the daemon cleanly (SIGTERM, exit 0).
#   1. kvcache-replay sends the bundled demo trace through the daemon under every policy:
#      retained tokens, evictions, scoring steps taken and skipped.
#   2. kvcache-loadgen steps 16 concurrent sequences over 2 worker streams for every
#      policy: throughput and batch latency through the daemon and in-process.
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/install-deps.sh
mkdir -p build
if [ ! -f build/CMakeCache.txt ]; then
  cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo >build.configure.log 2>&1 ||
    { cat build.configure.log; exit 1; }
fi
cmake --build build -j "$(nproc)" --target kvcached kvcache-replay kvcache-loadgen

work=$(mktemp -d)
daemon_pid=""
cleanup() {
  if [ -n "$daemon_pid" ] && kill -0 "$daemon_pid" 2>/dev/null; then kill -KILL "$daemon_pid"; fi
  rm -rf "$work"
}
trap cleanup EXIT

build/bin/kvcached --listen=127.0.0.1:0 --metrics_listen=127.0.0.1:0 \
  --port_file="$work/ports.json" 2>"$work/kvcached.log" &
daemon_pid=$!
for _ in $(seq 1 300); do
  [ -s "$work/ports.json" ] && break
  kill -0 "$daemon_pid" 2>/dev/null || { cat "$work/kvcached.log"; exit 1; }
  sleep 0.1
done
grpc=$(sed -n 's/.*"grpc": "\([^"]*\)".*/\1/p' "$work/ports.json")
metrics=$(sed -n 's/.*"metrics": "\([^"]*\)".*/\1/p' "$work/ports.json")
echo "kvcached is serving gRPC on $grpc, metrics on http://$metrics/metrics"
echo

echo "== the demo trace (clients/replay/demo/demo.trace.jsonl) through kvcached, per policy"
build/bin/kvcache-replay --server "$grpc" --compare all \
  --trace clients/replay/demo/demo.trace.jsonl
echo
echo "== 16 sequences, 2 worker streams, 8 layers, 8k context at 90%, float16, per policy"
build/bin/kvcache-loadgen --server "$grpc" --policy all --sequences 16 --streams 2 \
  --layers 8 --context 8192 --compression_ratio 0.9 --dtype float16 --duration 2s
echo

kill -TERM "$daemon_pid"
status=0
wait "$daemon_pid" || status=$?
daemon_pid=""
echo "kvcached stopped on SIGTERM with exit status $status"
exit "$status"
