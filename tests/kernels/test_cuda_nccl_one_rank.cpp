// The NCCL communicator on one GPU with no MPI at all (bootstrapped over the self communicator),
// in the stream-ordered mode `comm: nccl` runs, so that a GPU machine without MPI (the bundle's)
// checks it: collectives and the block to itself ordered with the backend's stream, a barrier
// that completes on the host, and the MoE exchange's device payload path on one rank (the index
// upload, table = x) against the host exchange. Two-rank NCCL needs two GPUs (tests/parallel).
// Skips without a usable GPU or without CUDA in the build.
#include <gtest/gtest.h>

#include <cstring>
#include <numeric>
#include <vector>

#include "kernels/ops.h"
#include "parallel/comm.h"
#include "parallel/moe_exchange.h"
#ifdef GLM5_HAVE_CUDA
#include "parallel/nccl_comm.h"
#endif

namespace glm5::parallel {
namespace {

#ifdef GLM5_HAVE_CUDA

TEST(CudaNcclOneRank, StreamOrderedCollectivesAndMoeExchange) {
  if (!kernels::cuda_available()) GTEST_SKIP() << "no usable CUDA device";
  auto gpu = kernels::make_cuda_backend(0);
  ASSERT_NE(gpu->stream(), nullptr) << "the cuda backend must expose its stream";
  auto self = make_self_comm();
  auto nccl = make_nccl_comm(*self, 0, gpu->stream());
  EXPECT_STREQ(nccl->transport(), "nccl");
  EXPECT_TRUE(nccl->device_buffers());

  // all_to_all_v to itself (a device copy on the NCCL stream) right after a kernel that wrote the
  // source on the backend's stream, then a kernel reading the result: the events must order them.
  const int64_t n = 1 << 20;
  std::vector<float> host(static_cast<size_t>(n));
  std::iota(host.begin(), host.end(), 0.0f);
  float* a = static_cast<float*>(gpu->alloc(n * sizeof(float)));
  float* b = static_cast<float*>(gpu->alloc(n * sizeof(float)));
  float* c = static_cast<float*>(gpu->alloc(n * sizeof(float)));
  gpu->to_device(a, host.data(), n * sizeof(float));
  gpu->add({a, a, n});  // a = 2 * i on the backend's stream
  const size_t bytes = n * sizeof(float), zero = 0;
  nccl->all_to_all_v(a, &bytes, &zero, b, &bytes, &zero);
  gpu->copy_2d({b, n, c, n, 1, n});  // reads b after the exchange
  std::vector<float> got(static_cast<size_t>(n));
  gpu->to_host(got.data(), c, bytes);
  for (int64_t i = 0; i < n; i += 4099) ASSERT_EQ(got[size_t(i)], 2.0f * float(i)) << i;

  nccl->all_reduce(b, size_t(n), ReduceDType::F32, ReduceOp::Sum);  // one rank: unchanged
  nccl->broadcast(b, bytes, 0);
  nccl->barrier();  // completes on the host
  gpu->to_host(got.data(), b, bytes);
  EXPECT_EQ(got[12345], 2.0f * 12345);

  // The MoE exchange's device path on one rank against the host path.
  const int64_t m = 9, d = 64, k = 3;
  std::vector<float> x(size_t(m * d));
  for (size_t i = 0; i < x.size(); ++i) x[i] = float(i % 977) * 0.5f;
  std::vector<int32_t> dest(size_t(m * k), 0), tag(size_t(m * k));
  for (size_t s = 0; s < tag.size(); ++s) tag[s] = int32_t((s * 7) % 5), dest[s] = s % 4 == 3 ? -1 : 0;
  MoeExchange hx(*self), dx(*self, *gpu, *nccl);
  hx.dispatch(x.data(), m, d, k, dest.data(), tag.data());
  float* xd = static_cast<float*>(gpu->alloc(x.size() * sizeof(float)));
  gpu->to_device(xd, x.data(), x.size() * sizeof(float));
  dx.dispatch(xd, m, d, k, dest.data(), tag.data());
  ASSERT_EQ(dx.recv_count(), hx.recv_count());
  std::vector<int32_t> rr(size_t(dx.recv_count())), sr(size_t(m * k));
  gpu->to_host(rr.data(), dx.recv_row_payload(), rr.size() * sizeof(int32_t));
  gpu->to_host(sr.data(), dx.slot_row_payload(), sr.size() * sizeof(int32_t));
  EXPECT_TRUE(std::equal(rr.begin(), rr.end(), hx.recv_row()));
  EXPECT_TRUE(std::equal(sr.begin(), sr.end(), hx.slot_row()));
  EXPECT_EQ(dx.recv_table(), xd);  // one rank: the table is x itself
  for (float* p : {a, b, c, xd}) gpu->free(p);
}

#else

TEST(CudaNcclOneRank, SkippedWithoutCuda) { GTEST_SKIP() << "this build has no CUDA/NCCL support"; }

#endif

}  // namespace
}  // namespace glm5::parallel
