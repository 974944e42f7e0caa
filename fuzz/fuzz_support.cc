#include "fuzz/fuzz_support.h"

#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/io/zero_copy_stream_impl_lite.h"
#include "google/protobuf/stubs/logging.h"
#include "google/protobuf/wire_format_lite.h"

namespace kvcm::fuzz {

using google::protobuf::internal::WireFormatLite;

bool ParseStepCase(const uint8_t* data, size_t size, StepCase* out) {
  google::protobuf::io::CodedInputStream in(data, static_cast<int>(size));
  while (uint32_t tag = in.ReadTag()) {
    const int field = WireFormatLite::GetTagFieldNumber(tag);
    if (WireFormatLite::GetTagWireType(tag) != WireFormatLite::WIRETYPE_LENGTH_DELIMITED ||
        (field != 1 && field != 2)) {
      return false;
    }
    if ((field == 1 && out->opens.size() >= kMaxOpens) ||
        (field == 2 && out->batches.size() >= kMaxBatches)) {
      return true;  // the rest is ignored
    }
    uint32_t length = 0;
    if (!in.ReadVarint32(&length) || length > size) return false;
    const auto limit = in.PushLimit(static_cast<int>(length));
    const bool parsed = field == 1 ? out->opens.emplace_back().ParseFromCodedStream(&in)
                                   : out->batches.emplace_back().ParseFromCodedStream(&in);
    if (!parsed) return false;
    in.PopLimit(limit);
  }
  return in.ConsumedEntireMessage();
}

std::string SerializeStepCase(const StepCase& c) {
  std::string out;
  const auto append = [&](int field, const google::protobuf::MessageLite& m) {
    const std::string bytes = m.SerializeAsString();
    const uint32_t tag = WireFormatLite::MakeTag(field, WireFormatLite::WIRETYPE_LENGTH_DELIMITED);
    google::protobuf::io::StringOutputStream stream(&out);
    google::protobuf::io::CodedOutputStream coded(&stream);
    coded.WriteTag(tag);
    coded.WriteVarint32(static_cast<uint32_t>(bytes.size()));
    coded.WriteRaw(bytes.data(), static_cast<int>(bytes.size()));
  };
  for (const auto& open : c.opens) append(1, open);
  for (const auto& batch : c.batches) append(2, batch);
  return out;
}

void QuietProtobufLogs() { google::protobuf::SetLogHandler(nullptr); }

bool TooSlowToFuzz(const kvcache::v1::OpenSequenceRequest& request, int64_t max_tokens) {
  return request.prefill_len() > max_tokens;
}

}  // namespace kvcm::fuzz
