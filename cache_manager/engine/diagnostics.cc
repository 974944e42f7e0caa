#include "cache_manager/engine/diagnostics.h"

#include <algorithm>

#include "cache_manager/base/check.h"
#include "kernels/momentum_update.h"
#include "kernels/selection.h"

namespace kvcm {
namespace {

// |a ∩ b| of two ascending, duplicate-free lists.
int64_t IntersectionSize(std::span<const int64_t> a, std::span<const int64_t> b) {
  int64_t common = 0;
  size_t i = 0, j = 0;
  while (i < a.size() && j < b.size()) {
    if (a[i] < b[j]) {
      ++i;
    } else if (b[j] < a[i]) {
      ++j;
    } else {
      ++common;
      ++i;
      ++j;
    }
  }
  return common;
}

double Jaccard(int64_t common, size_t a, size_t b) {
  const int64_t united = static_cast<int64_t>(a + b) - common;
  return united == 0 ? 1.0 : static_cast<double>(common) / static_cast<double>(united);
}

}  // namespace

bool SampledForDiagnostics(const DiagnosticsOptions& options, std::string_view id) {
  if (options.every <= 0 || options.sample <= 0) return false;
  if (options.sample >= 1) return true;
  uint64_t h = 14695981039346656037ull;  // FNV-1a 64: fixed, unlike absl::Hash
  for (unsigned char c : id) {
    h ^= c;
    h *= 1099511628211ull;
  }
  // MurmurHash3's finalizer: FNV's high bits barely move between ids that differ in their
  // last characters ("req-1", "req-2"), and the fraction is read from the high bits.
  h ^= h >> 33;
  h *= 0xff51afd7ed558ccdull;
  h ^= h >> 33;
  h *= 0xc4ceb9fe1a85ec53ull;
  h ^= h >> 33;
  const double u = static_cast<double>(h >> 11) * 0x1.0p-53;  // [0, 1)
  return u < options.sample;
}

int64_t DiagnosticsTopK(int64_t budget) { return std::max<int64_t>(1, (budget + 9) / 10); }

SequenceDiagnostics::SequenceDiagnostics(int64_t every, int64_t budget)
    : every_(every), budget_(budget), top_k_(DiagnosticsTopK(budget)) {
  KVCM_CHECK(every >= 1 && budget >= 1);
  // Reserved up to a bound: the budget is a client's number, and the vectors grow to
  // what the cache really holds within a step or two.
  constexpr int64_t kMaxReserve = int64_t{1} << 16;
  const auto n = static_cast<size_t>(std::min(budget + 1, kMaxReserve));
  const auto k = static_cast<size_t>(std::min(top_k_, kMaxReserve));
  raw_.reserve(n);
  keys_.reserve(n);
  top_.reserve(k);
  raw_top_.reserve(k);
  momentum_top_.reserve(k);
  prev_raw_.reserve(k);
  prev_momentum_.reserve(k);
}

void SequenceDiagnostics::SelectTop(const float* values, int64_t count) {
  const int64_t k = std::min(top_k_, count);
  top_.resize(static_cast<size_t>(k));
  keys_.resize(static_cast<size_t>(count));
  kernels::cpu::SelectHighest(values, count, k, top_.data(), keys_.data(), nullptr);
}

void SequenceDiagnostics::Observe(int64_t scoring_step, const kernels::ScoreMatrix& scores,
                                  std::span<const int64_t> retained,
                                  std::span<const float> momentum,
                                  std::span<const int64_t> evicted_indices,
                                  std::span<const int64_t> evicted, StepDiagnostics* out) {
  if (!Examines(scoring_step)) return;
  const int64_t n = scores.tokens;
  KVCM_CHECK(n == static_cast<int64_t>(retained.size() + evicted.size()) &&
             evicted.size() == evicted_indices.size() && momentum.size() == retained.size());

  // The raw scores: the single_step rule over the step's rows (validated by the step).
  raw_.resize(static_cast<size_t>(n));
  int64_t invalid = 0;
  kernels::cpu::UpdateMomentum(nullptr, raw_.data(), n, scores,
                               {kernels::ScoreAggregation::kSingleStep}, &invalid, nullptr);

  // R_t: one walk over the candidates, each the next evicted token when its index is next
  // in `evicted_indices`, otherwise the next retained one.
  SelectTop(raw_.data(), n);
  raw_top_.clear();
  int64_t relevant = 0;
  size_t next_evicted = 0, next_retained = 0, next_top = 0;
  for (int64_t i = 0; i < n && next_top < top_.size(); ++i) {
    const bool was_evicted =
        next_evicted < evicted_indices.size() && evicted_indices[next_evicted] == i;
    const int64_t position = was_evicted ? evicted[next_evicted++] : retained[next_retained++];
    if (top_[next_top] != i) continue;
    ++next_top;
    raw_top_.push_back(position);
    if (was_evicted) ++relevant;
  }

  // M_t over the cache after eviction.
  SelectTop(momentum.data(), static_cast<int64_t>(retained.size()));
  momentum_top_.clear();
  for (int64_t index : top_) momentum_top_.push_back(retained[static_cast<size_t>(index)]);

  if (last_examined_ != 0 && last_examined_ == scoring_step - 1) {
    const int64_t raw_common = IntersectionSize(raw_top_, prev_raw_);
    const int64_t momentum_common = IntersectionSize(momentum_top_, prev_momentum_);
    StepDiagnostics& d = *out;
    d.measured = true;
    d.raw_topk_churn = 1.0 - Jaccard(raw_common, raw_top_.size(), prev_raw_.size());
    d.momentum_topk_churn =
        1.0 - Jaccard(momentum_common, momentum_top_.size(), prev_momentum_.size());
    d.raw_momentum_jaccard = Jaccard(IntersectionSize(raw_top_, momentum_top_), raw_top_.size(),
                                     momentum_top_.size());
    d.small_change = static_cast<int64_t>(momentum_top_.size()) - momentum_common <= 1;
    d.evicted = static_cast<int64_t>(evicted.size());
    d.evicted_relevant = relevant;
  }

  raw_top_.swap(prev_raw_);
  momentum_top_.swap(prev_momentum_);
  last_examined_ = scoring_step;
  // After a step far above the budget (a long prefill's first), give the scratch back.
  const auto steady = static_cast<size_t>(budget_ + 1);
  if (raw_.capacity() > 2 * steady) {
    raw_ = std::vector<float>();
    keys_ = std::vector<uint64_t>();
    raw_.reserve(std::min<size_t>(steady, size_t{1} << 16));
    keys_.reserve(std::min<size_t>(steady, size_t{1} << 16));
  }
}

}  // namespace kvcm
