#!/usr/bin/env bash
# The main job (README.md): installs what is missing, builds, starts kvcached on its
# default host backend on loopback, runs a demo worker against it, prints the per-policy
# tables, and stops the daemon cleanly (SIGTERM, exit 0).
#   1. kvcache-replay sends the bundled demo trace through the daemon under every policy:
#      retained tokens, evictions, scoring steps taken and skipped.
#   2. kvcache-loadgen steps 64 concurrent sequences over 2 worker streams for every
#      policy on the recommended path (folded rows written into score regions kvcached
#      creates): throughput and batch latency through the daemon and in-process.
#   3. kvcache-loadgen --serve: what a node gains, the concurrent decoding sequences of
#      the daemon's fixed KV pool at rho = 0.9 against the full cache (docs/BENCHMARKS.md,
#      "Capacity", has every configuration and the hand-off).
#   4. kvcache-eval --first_step_only: the trained decoder's first decode step through a
#      daemon of its own shape, plain inertia against inertia with the observation window
#      and span pooling: how much of the answer's evidence step 1 keeps at rho = 0.9
#      (docs/EVALUATION.md, "The first step composed", has accuracy and every preset).
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/install-deps.sh
mkdir -p build
if [ ! -f build/CMakeCache.txt ]; then
  cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo >build.configure.log 2>&1 ||
    { cat build.configure.log; exit 1; }
fi
cmake --build build -j "$(nproc)" --target kvcached kvcache-replay kvcache-loadgen kvcm_python_stubs

work=$(mktemp -d)
daemon_pid=""
cleanup() {
  if [ -n "$daemon_pid" ] && kill -0 "$daemon_pid" 2>/dev/null; then kill -KILL "$daemon_pid"; fi
  rm -rf "$work"
}
trap cleanup EXIT

# A host KV pool of 28,672 blocks of 16 tokens (the capacity benchmark's: one layer, one
# head of dimension 8, so 14 MiB; only the block count matters for capacity) and score
# regions in shared memory.
build/bin/kvcached --listen=127.0.0.1:0 --metrics_listen=127.0.0.1:0 \
  --port_file="$work/ports.json" --allow_shm_scores --pool_memory_bytes=$((14 << 20)) \
  --kv_layers=1 --kv_heads=1 --kv_head_dim=8 --kv_tokens_per_block=16 --kv_dtype=float16 \
  2>"$work/kvcached.log" &
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
echo "== 64 sequences, 2 worker streams, 32 layers, 4k context at 90%, float16 folded rows"
echo "   in score regions kvcached creates, per policy"
build/bin/kvcache-loadgen --server "$grpc" --policy all --sequences 64 --streams 2 \
  --layers 32 --context 4096 --compression_ratio 0.9 --dtype float16 --duration 2s \
  --transport created --folded
echo
echo "== capacity: Poisson arrivals (150/s, prompts 2k-32k, 128 tokens each) on the pool of"
echo "   28,672 blocks, full cache against inertia at rho = 0.9, 5 s of arrivals each"
build/bin/kvcache-loadgen --server "$grpc" --serve --serve_configs=full,inertia@0.9 \
  --serve_duration=5s --arrival_rate=150 --json="$work/capacity.json"
/usr/bin/python3 - "$work/capacity.json" <<'PY'
import json, sys
runs = {r["config"]: r for r in json.load(open(sys.argv[1]))["configs"]}
full, inertia = runs["full"], runs["inertia@0.9"]
print(f"capacity gain at rho = 0.9: {inertia['decoding_mean'] / full['decoding_mean']:.1f}x the "
      f"concurrent decoding sequences of the full cache ({inertia['decoding_mean']:.1f} against "
      f"{full['decoding_mean']:.1f}), {inertia['tokens_per_second'] / full['tokens_per_second']:.1f}x "
      f"the decode tokens/s")
PY
echo

kill -TERM "$daemon_pid"
status=0
wait "$daemon_pid" || status=$?
daemon_pid=""
echo "kvcached stopped on SIGTERM with exit status $status"
echo

# The decoder's K/V shape differs from the demo pool's, so the evaluation starts a kvcached
# of its own (and stops it).
echo "== the first step composed: the trained decoder (eval/weights), 8 samples of each of"
echo "   5 retrieval tasks, step 1 at rho = 0.9 through kvcached"
/usr/bin/python3 eval/kvcache-eval --first_step_only --per_task 8 --lengths 256,512 \
  --kvcached build/bin/kvcached
exit "$status"
