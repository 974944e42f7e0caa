#!/usr/bin/env bash
# The fuzz targets of fuzz/ (docs/RELIABILITY.md, "Fuzzing"): builds them in build-fuzz/
# (clang, ASan + UBSan + libFuzzer coverage, and the thread-safety analysis as errors),
# makes the seed corpora from the golden vectors, replays fuzz/regressions/, then runs
# each target for SECONDS (default 60), one after the other.
#   scripts/fuzz.sh [SECONDS]
# The corpus each run grows is kept in build-fuzz/corpus/TARGET/ for the next run; a crash,
# leak or timeout leaves its input in build-fuzz/artifacts/TARGET/ and fails the script.
# Environment: KVCM_FUZZ_JOBS (build parallelism, default nproc).
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-60}
jobs=${KVCM_FUZZ_JOBS:-$(nproc)}
dir=build-fuzz
targets=(step_batch open_sequence trace)

mkdir -p "$dir"
CC=clang-14 CXX=clang++-14 cmake -S . -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=Fuzz \
  -DKVCM_FUZZ=ON -DKVCM_THREAD_SAFETY=ON \
  -DKVCM_WERROR=ON -DKVCM_CUDA=OFF -DKVCM_BUILD_TESTS=OFF -DKVCM_BUILD_BENCH=OFF \
  >"$dir.configure.log" 2>&1 || { cat "$dir.configure.log"; exit 1; }
cmake --build "$dir" -j "$jobs"

rm -rf "$dir/seeds"
"$dir/bin/make_seeds" tests/data/golden "$dir/seeds"

# Leaks fail a run too; a UBSan report aborts (-fno-sanitize-recover).
export ASAN_OPTIONS=detect_leaks=1:abort_on_error=1:allocator_may_return_null=0
export UBSAN_OPTIONS=print_stacktrace=1

summary="$dir/fuzz-summary.txt"
: >"$summary"
for target in "${targets[@]}"; do
  fuzzer="$dir/bin/${target}_fuzzer"
  # The inputs of bugs found so far must not crash (each is run once).
  regressions=(fuzz/regressions/"$target"/*)
  if [ -e "${regressions[0]}" ]; then
    echo "== $target: ${#regressions[@]} regression inputs"
    "$fuzzer" -runs=1 "${regressions[@]}" >"$dir/$target.regressions.log" 2>&1 ||
      { tail -50 "$dir/$target.regressions.log"; exit 1; }
  fi
  corpus="$dir/corpus/$target"
  artifacts="$dir/artifacts/$target"
  mkdir -p "$corpus" "$artifacts"
  extra=()
  if [ -f "fuzz/$target.dict" ]; then extra+=(-dict="fuzz/$target.dict"); fi
  # kvtrace lines are parsed whole: short inputs keep the executions fast (the seeds are
  # cut to fit).
  if [ "$target" = trace ]; then extra+=(-max_len=4096); fi
  echo "== $target: fuzzing for ${seconds}s"
  # -timeout: an input running 10 s is a hang (a batch that never completes, say);
  # -rss_limit_mb / -malloc_limit_mb: an input may not make the process hold 2 GB, nor
  # ask for 1 GB at once (memory must not be sized from a request field).
  if ! "$fuzzer" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 \
      -malloc_limit_mb=1024 -print_final_stats=1 -artifact_prefix="$artifacts/" \
      "${extra[@]}" "$corpus" "$dir/seeds/$target" >"$dir/$target.log" 2>&1; then
    tail -80 "$dir/$target.log"
    echo "== $target: FAILED; the input is in $artifacts/"
    exit 1
  fi
  runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$dir/$target.log")
  echo "$target: ${runs:-?} executions in ${seconds}s, $(find "$corpus" -type f | wc -l) corpus inputs, no crash, leak or timeout" |
    tee -a "$summary"
done
