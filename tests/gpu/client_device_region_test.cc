// The C++ client's ScoreRegion over a CUDA engine's device memory: a real
// `kvcached --engine_backend=cuda` on loopback creates the region on its GPU, the client
// opens its IPC handle (this process's ordinal of that GPU, found by PCI bus id and checked
// by UUID), writes packed scores into it on a stream of its own, waits for them with
// WaitForWrites, and the step decides as the same scores sent inline. Skips without a GPU.
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "clients/cpp/score_region.h"
#include "gtest/gtest.h"
#include "kernels/cuda/cuda_adapter.h"
#include "tests/gpu/gpu_test_util.h"
#include "tests/server/daemon_test.h"

namespace kvcm {
namespace {

namespace v1 = ::kvcache::v1;
using ::kvcm::testing::DeviceArray;
using ::kvcm::testing::Scores;

constexpr int32_t kLayers = 3;

std::span<const std::byte> Bytes(const std::vector<float>& v) { return std::as_bytes(std::span(v)); }

std::vector<int64_t> Evicted(const v1::Decision& decision) {
  return std::vector<int64_t>(decision.evicted().begin(), decision.evicted().end());
}

// A non-blocking stream of the current device, destroyed with the test.
class Stream {
 public:
  Stream() {
    const absl::Status made = kernels::cuda::CudaStatus(
        cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
    EXPECT_TRUE(made.ok()) << made;
  }
  ~Stream() {
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  void* get() const { return stream_; }

 private:
  cudaStream_t stream_ = nullptr;
};

class ClientDeviceRegionTest : public testing::DaemonTest {
 protected:
  void SetUp() override {
    KVCM_SKIP_WITHOUT_GPU();
    StartDaemon({"--engine_backend=cuda", "--allow_shm_scores"});
  }

  void Open(const std::string& id, int64_t prefill) {
    const absl::StatusOr<v1::SequenceState> opened =
        client_->Open(client::OpenRequest(id, prefill, 0.5, "inertia"));
    ASSERT_TRUE(opened.ok()) << opened.status();
  }
};

// The region is the daemon's device memory, opened here: on a GPU this process sees, with
// a device pointer and no host span, zero-filled, and as large as asked.
TEST_F(ClientDeviceRegionTest, CreateInDaemonOpensTheDaemonsDeviceMemory) {
  absl::StatusOr<std::unique_ptr<client::ScoreRegion>> region =
      client::ScoreRegion::CreateInDaemon(*client_, 1 << 20);
  ASSERT_TRUE(region.ok()) << region.status();
  EXPECT_TRUE((*region)->on_device());
  EXPECT_GE((*region)->device(), 0);
  EXPECT_LT((*region)->device(), testing::GpuCountOrFail());
  ASSERT_NE((*region)->device_pointer(), nullptr);
  EXPECT_TRUE((*region)->bytes().empty()) << "a device pointer is no host span";
  EXPECT_EQ((*region)->size(), 1 << 20);
  EXPECT_TRUE(absl::StartsWith((*region)->name(), absl::StrCat("cuda-ipc:", (*region)->id(), "@GPU-")))
      << (*region)->name();

  cudaPointerAttributes attributes{};
  KVCM_ASSERT_CUDA(cudaPointerGetAttributes(&attributes, (*region)->device_pointer()));
  EXPECT_EQ(attributes.type, cudaMemoryTypeDevice);
  EXPECT_EQ(attributes.device, (*region)->device());
  std::vector<std::byte> head(4096, std::byte{0x5a});
  KVCM_ASSERT_CUDA(cudaMemcpy(head.data(), (*region)->device_pointer(), head.size(),
                              cudaMemcpyDeviceToHost));
  for (std::byte b : head) ASSERT_EQ(b, std::byte{0});
}

// Packed scores Put on the worker's stream (from host memory on odd steps, from device
// memory on even ones), then WaitForWrites, then the step: each decision and the final
// momentum equal those of the same scores inline. Destroying the region unregisters it.
TEST_F(ClientDeviceRegionTest, PutOnAStreamThenWaitForWritesDecidesLikeInline) {
  Open("inline", 64);
  Open("device", 64);
  absl::StatusOr<std::unique_ptr<client::ScoreRegion>> region =
      client::ScoreRegion::CreateInDaemon(*client_, 1 << 20);
  ASSERT_TRUE(region.ok()) << region.status();
  ASSERT_TRUE((*region)->on_device());
  const uint64_t id = (*region)->id();
  KVCM_ASSERT_CUDA(cudaSetDevice((*region)->device()));
  Stream stream;
  auto steps = client_->OpenStepStream();
  ASSERT_TRUE(steps.ok()) << steps.status();
  int64_t cache = 64;
  for (int64_t t = 1; t <= 6; ++t) {
    const std::vector<float> s = Scores(kLayers, cache + 1, static_cast<uint64_t>(t));
    const DeviceArray<float> on_gpu(s);
    const std::span<const std::byte> packed =
        t % 2 == 1 ? Bytes(s)
                   : std::span<const std::byte>(reinterpret_cast<const std::byte*>(on_gpu.get()),
                                                s.size() * sizeof(float));
    v1::StepBatch batch;
    client::SetFloat32Scores(client::AddReport(&batch, "inline", t), s, kLayers);
    const absl::Status put =
        (*region)->Put(client::AddReport(&batch, "device", t), 8192 * t, packed, kLayers,
                       kernels::ScoreDtype::kFloat32, /*head_count=*/0, stream.get());
    ASSERT_TRUE(put.ok()) << put;
    const absl::Status waited = (*region)->WaitForWrites();
    ASSERT_TRUE(waited.ok()) << waited;
    ASSERT_EQ(batch.reports(1).score_ref().region(), id);
    absl::StatusOr<v1::DecisionBatch> reply = (*steps)->Step(batch);
    ASSERT_TRUE(reply.ok()) << reply.status();
    ASSERT_EQ(reply->decisions(0).code(), 0) << reply->decisions(0).message();
    ASSERT_EQ(reply->decisions(1).code(), 0) << reply->decisions(1).message();
    EXPECT_EQ(Evicted(reply->decisions(0)), Evicted(reply->decisions(1))) << "step " << t;
    cache = reply->decisions(0).cache_size();
  }
  const auto x = client_->Inspect("inline", true), y = client_->Inspect("device", true);
  ASSERT_TRUE(x.ok() && y.ok());
  EXPECT_EQ(std::vector<float>(x->momentum().begin(), x->momentum().end()),
            std::vector<float>(y->momentum().begin(), y->momentum().end()));

  region->reset();  // closes the handle, then unregisters: the daemon frees the memory
  grpc::ClientContext context;
  v1::UnregisterScoreRegionRequest request;
  request.set_region(id);
  v1::UnregisterScoreRegionResponse response;
  EXPECT_EQ(client::FromGrpc(client_->stub().UnregisterScoreRegion(&context, request, &response))
                .code(),
            absl::StatusCode::kNotFound);
}

// A range that does not fit is refused before anything is enqueued, and leaves nothing to
// wait for.
TEST_F(ClientDeviceRegionTest, APutThatDoesNotFitIsRefusedAndEnqueuesNothing) {
  absl::StatusOr<std::unique_ptr<client::ScoreRegion>> region =
      client::ScoreRegion::CreateInDaemon(*client_, 4096);
  ASSERT_TRUE(region.ok()) << region.status();
  const std::vector<float> s = Scores(kLayers, 400, 1);  // 4800 bytes
  v1::StepBatch batch;
  const absl::Status put = (*region)->Put(client::AddReport(&batch, "x", 1), 0, Bytes(s), kLayers,
                                          kernels::ScoreDtype::kFloat32, 0, nullptr);
  EXPECT_EQ(put.code(), absl::StatusCode::kInvalidArgument) << put;
  EXPECT_FALSE(batch.reports(0).has_score_ref());
  EXPECT_TRUE((*region)->WaitForWrites().ok());
}

}  // namespace
}  // namespace kvcm
