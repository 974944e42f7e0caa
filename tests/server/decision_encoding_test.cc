// Decision encodings (proto DecisionEncoding): the open option's translation, the
// sequence remembering and reporting it, server/translate.cc's positions, mask and AUTO
// forms of a decision, and the C++ client's EvictedPositions / KeepMask giving both forms
// back from either one. The sizes of the 64k prefill are printed for
// docs/BENCHMARKS.md ("Decision encodings").
#include <cstdint>
#include <iostream>
#include <memory>
#include <optional>
#include <random>
#include <vector>

#include "absl/time/clock.h"
#include "cache_manager/engine/sequence.h"
#include "cache_manager/table/sequence_slot.h"
#include "clients/cpp/kvcache_client.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/translate.h"
#include "tests/cache_manager/engine_test_util.h"

namespace kvcm {
namespace {

namespace v1 = ::kvcache::v1;
using ::kvcm::testing::Layers;
using ::kvcm::testing::RandomLayers;
using ::kvcm::testing::StepWith;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

v1::OpenSequenceRequest Request(v1::DecisionEncoding encoding) {
  v1::OpenSequenceRequest r;
  r.set_sequence_id("s");
  r.set_prefill_len(100);
  r.set_compression_ratio(0.9);
  r.set_decision_encoding(encoding);
  return r;
}

// A hand-made decision: `evicted_indices` into a cache of `cache_before` tokens plus the
// new token, whose positions are the indices times 10.
EvictionDecision Made(std::vector<int64_t> indices, int64_t cache_before,
                      DecisionEncoding encoding) {
  EvictionDecision d;
  d.step = 1;
  d.encoding = encoding;
  for (int64_t i : indices) d.evicted.push_back(10 * i);
  d.evicted_indices = std::move(indices);
  d.cache_size = cache_before + 1 - static_cast<int64_t>(d.evicted.size());
  return d;
}

v1::Decision Encoded(const EvictionDecision& d) {
  v1::Decision out;
  server::ToProto(d, &out);
  return out;
}

TEST(DecisionEncodingTranslation, OpenRequestEncodingsMapToTheEngineEnum) {
  const std::pair<v1::DecisionEncoding, DecisionEncoding> cases[] = {
      {v1::DECISION_ENCODING_UNSPECIFIED, DecisionEncoding::kPositions},
      {v1::DECISION_ENCODING_POSITIONS, DecisionEncoding::kPositions},
      {v1::DECISION_ENCODING_MASK, DecisionEncoding::kMask},
      {v1::DECISION_ENCODING_AUTO, DecisionEncoding::kAuto},
  };
  for (const auto& [wire, engine] : cases) {
    absl::StatusOr<server::OpenParams> params = server::FromProto(Request(wire));
    ASSERT_TRUE(params.ok()) << params.status();
    EXPECT_EQ(params->options.decision_encoding, engine) << wire;
  }
}

TEST(DecisionEncodingTranslation, AnUnknownEncodingIsInvalidArgumentNamingTheField) {
  absl::StatusOr<server::OpenParams> params =
      server::FromProto(Request(static_cast<v1::DecisionEncoding>(7)));
  ASSERT_EQ(params.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(params.status().message(), HasSubstr("sequence 's'"));
  EXPECT_THAT(params.status().message(), HasSubstr("decision_encoding 7"));
}

TEST(DecisionEncodingTranslation, TheSequenceRemembersItsEncodingAndReportsIt) {
  for (DecisionEncoding e :
       {DecisionEncoding::kPositions, DecisionEncoding::kMask, DecisionEncoding::kAuto}) {
    SequenceOptions options;
    options.prefill_len = 8;
    options.budget.budget_tokens = 4;
    options.preset = "streaming_llm";
    options.decision_encoding = e;
    absl::StatusOr<std::unique_ptr<Sequence>> s = Sequence::Create("s", options);
    ASSERT_TRUE(s.ok()) << s.status();
    EXPECT_EQ((*s)->decision_encoding(), e);
    EvictionDecision d;
    ASSERT_TRUE((*s)->Step(1, nullptr, &d).ok());
    EXPECT_EQ(d.encoding, e);  // stamped on every decision

    SequenceSlot slot(*std::move(s), 1, kernels::ScoreDtype::kFloat32, std::nullopt,
                      SlotLimits{}, /*charged_bytes=*/0, absl::Now());
    const SequenceInfo info = slot.Peek();
    EXPECT_EQ(info.decision_encoding, e);
    v1::SequenceState state;
    server::ToProto(info, absl::Now(), &state);
    EXPECT_EQ(state.decision_encoding(),
              e == DecisionEncoding::kMask   ? v1::DECISION_ENCODING_MASK
              : e == DecisionEncoding::kAuto ? v1::DECISION_ENCODING_AUTO
                                             : v1::DECISION_ENCODING_POSITIONS);
  }
}

TEST(DecisionEncodingTranslation, PositionsTravelAsTheEvictedList) {
  const v1::Decision out = Encoded(Made({1, 4}, 9, DecisionEncoding::kPositions));
  EXPECT_THAT(out.evicted(), ElementsAre(10, 40));
  EXPECT_EQ(out.cache_size(), 8);
  EXPECT_EQ(out.mask_tokens(), 0);
  EXPECT_TRUE(out.evicted_mask().empty());
}

TEST(DecisionEncodingTranslation, AMaskSetsTheBitOfEachEvictedIndexLsbFirst) {
  // 9 cached + the new token = 10 bits in 2 bytes; index 9 is the new token.
  const v1::Decision out = Encoded(Made({1, 4, 8, 9}, 9, DecisionEncoding::kMask));
  EXPECT_TRUE(out.evicted().empty());
  EXPECT_EQ(out.cache_size(), 6);
  EXPECT_EQ(out.mask_tokens(), 10);
  ASSERT_EQ(out.evicted_mask().size(), 2u);
  EXPECT_EQ(static_cast<unsigned char>(out.evicted_mask()[0]), 0b00010010);
  EXPECT_EQ(static_cast<unsigned char>(out.evicted_mask()[1]), 0b00000011);
}

TEST(DecisionEncodingTranslation, AMaskWithNothingEvictedIsAllZeroBitsOverTheCache) {
  const v1::Decision out = Encoded(Made({}, 16, DecisionEncoding::kMask));
  EXPECT_EQ(out.mask_tokens(), 17);
  EXPECT_EQ(out.evicted_mask(), std::string(3, '\0'));
}

TEST(DecisionEncodingTranslation, AutoPicksTheSmallerPayloadAndPositionsOnATie) {
  // 8 bits: a 1-byte mask + the 1-byte mask_tokens varint = 2 bytes; positions < 128 are
  // 1 byte each.
  const v1::Decision two = Encoded(Made({0, 1}, 7, DecisionEncoding::kAuto));
  EXPECT_EQ(two.mask_tokens(), 0) << "2 bytes each way: a tie goes to positions";
  EXPECT_THAT(two.evicted(), ElementsAre(0, 10));
  const v1::Decision three = Encoded(Made({0, 1, 2}, 7, DecisionEncoding::kAuto));
  EXPECT_EQ(three.mask_tokens(), 8);
  EXPECT_TRUE(three.evicted().empty());
  const v1::Decision none = Encoded(Made({}, 7, DecisionEncoding::kAuto));
  EXPECT_EQ(none.mask_tokens(), 0);
  EXPECT_TRUE(none.evicted_mask().empty());
}

TEST(DecisionEncodingTranslation, AReusedDecisionKeepsItsMaskBuffer) {
  v1::Decision out;
  server::ToProto(Made({3, 5000}, 6400, DecisionEncoding::kMask), &out);
  const char* buffer = out.evicted_mask().data();
  out.Clear();  // what StepBatchProcessor does with the Decisions of its reply
  server::ToProto(Made({7}, 6399, DecisionEncoding::kMask), &out);
  EXPECT_EQ(out.evicted_mask().data(), buffer);
  EXPECT_EQ(out.mask_tokens(), 6400);
  out.Clear();
  server::ToProto(Made({7}, 6399, DecisionEncoding::kPositions), &out);
  EXPECT_TRUE(out.evicted_mask().empty());
  EXPECT_EQ(out.mask_tokens(), 0);
}

// The client side: the worker's tracked cache (ascending, then the new token).
class Tracked {
 public:
  explicit Tracked(int64_t prefill_len) {
    for (int64_t p = 0; p < prefill_len; ++p) cache_.push_back(p);
  }
  // The cache before step `step`'s eviction, its new token last.
  std::span<const int64_t> Before(int64_t new_position) {
    cache_.push_back(new_position);
    return cache_;
  }
  void Keep(const std::vector<uint8_t>& keep) {
    size_t n = 0;
    for (size_t i = 0; i < cache_.size(); ++i) {
      if (keep[i]) cache_[n++] = cache_[i];
    }
    cache_.resize(n);
  }

 private:
  std::vector<int64_t> cache_;
};

struct Sizes {
  size_t positions_bytes = 0;  // the Decision message, POSITIONS
  size_t mask_bytes = 0;       // the Decision message, MASK
  int64_t evicted = 0;
  int64_t mask_tokens = 0;
  bool auto_is_mask = false;
};

// Encodes one engine decision each way (the message as it travels, sequence id and step
// included) and checks that each gives back the engine's evicted positions.
Sizes EncodeEachWay(EvictionDecision d, std::span<const int64_t> cache) {
  Sizes sizes;
  sizes.evicted = static_cast<int64_t>(d.evicted.size());
  for (DecisionEncoding e :
       {DecisionEncoding::kPositions, DecisionEncoding::kMask, DecisionEncoding::kAuto}) {
    d.encoding = e;
    v1::Decision out;
    out.set_sequence_id("prefill-64k");
    out.set_step(d.step);
    server::ToProto(d, &out);
    absl::StatusOr<std::vector<int64_t>> evicted = client::EvictedPositions(out, cache);
    EXPECT_TRUE(evicted.ok()) << evicted.status();
    EXPECT_EQ(*evicted, d.evicted);
    if (e == DecisionEncoding::kPositions) sizes.positions_bytes = out.ByteSizeLong();
    if (e == DecisionEncoding::kMask) {
      sizes.mask_bytes = out.ByteSizeLong();
      sizes.mask_tokens = out.mask_tokens();
    }
    if (e == DecisionEncoding::kAuto) sizes.auto_is_mask = out.mask_tokens() != 0;
  }
  return sizes;
}

void Print(const char* what, const Sizes& s) {
  std::cout << what << ": " << s.evicted << " evicted of " << s.mask_tokens
            << " tokens; Decision bytes: positions " << s.positions_bytes << ", mask "
            << s.mask_bytes << "; auto takes the " << (s.auto_is_mask ? "mask" : "positions")
            << "\n";
}

TEST(DecisionEncodingSizes, A64kPrefillAt90PercentTakesTheMaskFirstAndPositionsSteady) {
  constexpr int64_t kPrefill = 64000;
  SequenceOptions options;
  options.prefill_len = kPrefill;
  options.budget.compression_ratio = 0.9;
  options.preset = "inertia";
  absl::StatusOr<std::unique_ptr<Sequence>> s = Sequence::Create("prefill-64k", options);
  ASSERT_TRUE(s.ok()) << s.status();
  std::mt19937_64 rng(64);
  Tracked tracked(kPrefill);
  EvictionDecision d;
  for (int64_t step = 1; step <= 2; ++step) {
    const Layers layers = RandomLayers(rng, 1, (*s)->next_score_length(), false);
    ASSERT_TRUE(StepWith(**s, step, layers, &d).ok());
    std::span<const int64_t> cache = tracked.Before(kPrefill + step - 1);
    const Sizes sizes = EncodeEachWay(d, cache);
    Print(step == 1 ? "first step of a 64k prefill at 90%" : "steady step (6,400 cached)",
          sizes);
    if (step == 1) {
      EXPECT_EQ(sizes.evicted, kPrefill + 1 - 6400);
      EXPECT_TRUE(sizes.auto_is_mask);
      EXPECT_LT(sizes.mask_bytes * 15, sizes.positions_bytes);
    } else {
      EXPECT_EQ(sizes.evicted, 1);
      EXPECT_FALSE(sizes.auto_is_mask);
    }
    v1::Decision positions;
    d.encoding = DecisionEncoding::kPositions;
    server::ToProto(d, &positions);
    absl::StatusOr<std::vector<uint8_t>> keep = client::KeepMask(positions, cache);
    ASSERT_TRUE(keep.ok()) << keep.status();
    tracked.Keep(*keep);
  }
}

// Many steps of several policies, each encoding: the client's helpers give the engine's
// evicted positions and a keep mask that agrees with them, from either form.
TEST(DecisionEncodingClient, BothFormsComeBackFromEitherEncodingAtEveryStep) {
  for (const char* preset : {"inertia", "inertia_lazy4", "random", "streaming_llm"}) {
    for (DecisionEncoding e :
         {DecisionEncoding::kPositions, DecisionEncoding::kMask, DecisionEncoding::kAuto}) {
      SequenceOptions options;
      options.prefill_len = 37;
      options.budget.budget_tokens = 11;
      options.preset = preset;
      options.decision_encoding = e;
      absl::StatusOr<std::unique_ptr<Sequence>> s = Sequence::Create("s", options);
      ASSERT_TRUE(s.ok()) << s.status();
      std::mt19937_64 rng(7);
      Tracked tracked(options.prefill_len);
      EvictionDecision d;
      for (int64_t step = 1; step <= 40; ++step) {
        const Layers layers = (*s)->next_needs_scores()
                                  ? RandomLayers(rng, 2, (*s)->next_score_length(), true)
                                  : Layers{};
        ASSERT_TRUE(StepWith(**s, step, layers, &d).ok());
        v1::Decision out;
        server::ToProto(d, &out);
        std::span<const int64_t> cache = tracked.Before(options.prefill_len + step - 1);
        absl::StatusOr<std::vector<int64_t>> evicted = client::EvictedPositions(out, cache);
        absl::StatusOr<std::vector<uint8_t>> keep = client::KeepMask(out, cache);
        ASSERT_TRUE(evicted.ok() && keep.ok()) << preset << " step " << step;
        EXPECT_EQ(*evicted, d.evicted) << preset << " step " << step;
        std::vector<int64_t> dropped;
        for (size_t i = 0; i < cache.size(); ++i) {
          if (!(*keep)[i]) dropped.push_back(cache[i]);
        }
        EXPECT_EQ(dropped, d.evicted) << preset << " step " << step;
        tracked.Keep(*keep);
      }
    }
  }
}

TEST(DecisionEncodingClient, ADecisionThatDoesNotFitTheTrackedCacheIsInvalidArgument) {
  const std::vector<int64_t> cache = {0, 10, 20, 30, 40, 50, 60, 70, 80};
  const v1::Decision mask = Encoded(Made({1}, 9, DecisionEncoding::kMask));  // 10 bits
  EXPECT_EQ(client::EvictedPositions(mask, cache).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(client::KeepMask(mask, cache).status().message(), HasSubstr("out of step"));
  const v1::Decision positions = Encoded(Made({3}, 8, DecisionEncoding::kPositions));
  EXPECT_THAT(*client::KeepMask(positions, cache), ElementsAre(1, 1, 1, 0, 1, 1, 1, 1, 1));
  v1::Decision stray = positions;
  stray.set_evicted(0, 35);
  EXPECT_EQ(client::KeepMask(stray, cache).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvcm
