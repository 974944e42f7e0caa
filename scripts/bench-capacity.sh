#!/usr/bin/env bash
# The capacity figures of docs/BENCHMARKS.md ("Capacity"), in one run: two kvcached on
# loopback with the same small host KV pool (a decode node, and a prefill node for the
# hand-off, peers by token), `kvcache-loadgen --serve` over every configuration, its JSON,
# and the two plots.
#   scripts/bench-capacity.sh [BIN_DIR]          (default build/bin)
# Environment: CONFIGS (all), DURATION (15s of arrivals per configuration), RATE (150
# requests/s), POOL_BYTES (14 MiB: about 26 full-cache sequences of the default prompts),
# KV_TRANSFER (ucx), JSON (build/capacity.json), IMG (docs/img), EXTRA (more loadgen flags).
# Only block accounting matters for capacity: the geometry is one layer, one head of
# dimension 8 (512-byte blocks of 16 tokens) so that the pool is small; a model's bytes
# per token scale the pool, not the number of sequences it holds per block.
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${1:-build/bin}
json=${JSON:-build/capacity.json}
img=${IMG:-docs/img}
dir=$(mktemp -d)
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  wait || true
  rm -rf "$dir"
}
trap cleanup EXIT

pool=(--backend=host --pool_memory_bytes="${POOL_BYTES:-$((14 << 20))}" --kv_layers=1
      --kv_heads=1 --kv_head_dim=8 --kv_tokens_per_block=16 --kv_dtype=float16
      --allow_shm_scores --kv_transfer="${KV_TRANSFER:-ucx}" --metrics_listen=
      --auth_tokens_file="$dir/tokens")
# One worker tenant on both nodes (an import runs as the importing worker's tenant), and
# the peer credential the decode node presents to the prefill node.
printf 'tok-worker bench\ntok-peer peers peer\n' >"$dir/tokens"
printf 'tok-peer\n' >"$dir/peer-token"
printf 'tok-worker\n' >"$dir/worker-token"

# start NAME FLAGS...: starts a kvcached, waits for its port file.
start() {
  local name=$1
  shift
  "$bin/kvcached" --listen=127.0.0.1:0 --port_file="$dir/$name.port" "${pool[@]}" "$@" \
    2>"$dir/$name.log" &
  pids+=($!)
  for _ in $(seq 100); do [ -s "$dir/$name.port" ] && return 0; sleep 0.1; done
  echo "kvcached ($name) did not start:" >&2
  cat "$dir/$name.log" >&2
  exit 1
}
port() { sed -E "s/.*\"$2\": \"([^\"]+)\".*/\1/" "$dir/$1.port"; }

start prefill --peer_listen=127.0.0.1:0
start decode --peer_token_file="$dir/peer-token"
mkdir -p "$(dirname "$json")" "$img"
"$bin/kvcache-loadgen" --serve --server="$(port decode grpc)" \
  --prefill_server="$(port prefill grpc)" --prefill_peer="$(port prefill peer)" \
  --auth_token_file="$dir/worker-token" --serve_configs="${CONFIGS:-all}" \
  --serve_duration="${DURATION:-15s}" --arrival_rate="${RATE:-150}" --json="$json" ${EXTRA:-}
/usr/bin/python3 scripts/plot_capacity.py "$json" --out="$img"
