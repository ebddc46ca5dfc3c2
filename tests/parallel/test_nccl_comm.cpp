// NcclComm under mpirun, one GPU per rank: collectives, all_to_all_v with uneven and empty pairs,
// a send/recv ring and split ordering, on device buffers with payloads tagged by the sending
// rank so a misrouted element shows. Every rank skips together when CUDA is not built, no GPU is
// usable, or there are fewer GPUs than ranks (NCCL refuses two ranks on one GPU).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "kernels/core/check.h"
#include "kernels/ops.h"
#include "parallel/moe_exchange.h"
#include "parallel/mpi_comm.h"
#ifdef GLM5_HAVE_CUDA
#include <cuda_runtime.h>

#include "parallel/nccl_comm.h"
#endif

namespace glm5::parallel {
namespace {

#ifdef GLM5_HAVE_CUDA

// Why this rank cannot run the test ("" if it can).
std::string local_skip_reason(int world_size) {
  if (!kernels::cuda_available()) {
    try {
      kernels::make_cuda_backend(0);
    } catch (const std::exception& e) {
      return std::string("no usable CUDA device: ") + e.what();
    }
    return "no usable CUDA device";
  }
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) return "cudaGetDeviceCount failed";
  if (n < world_size)
    return "NCCL needs one GPU per rank: " + std::to_string(world_size) + " ranks, " + std::to_string(n) + " GPU(s)";
  return "";
}

class NcclCommTest : public ::testing::Test {
 protected:
  void SetUp() override {
    world = make_mpi_world();
    const std::string reason = local_skip_reason(world->size());
    int ok = reason.empty() ? 1 : 0;
    world->all_reduce(&ok, 1, ReduceDType::I32, ReduceOp::Min);  // skip on all ranks or none
    if (!ok) GTEST_SKIP() << (reason.empty() ? "another rank has no usable GPU" : reason);
    const int device = world->rank();
    gpu = kernels::make_cuda_backend(device);
    nccl = make_nccl_comm(*world, device);
  }

  template <class T>
  T* to_dev(const std::vector<T>& v) {
    void* p = gpu->alloc(v.size() * sizeof(T) + 64);
    if (!v.empty()) gpu->to_device(p, v.data(), v.size() * sizeof(T));
    buffers.push_back(p);
    return static_cast<T*>(p);
  }
  template <class T>
  std::vector<T> to_host(const T* p, size_t n) {
    std::vector<T> v(n);
    if (n) gpu->to_host(v.data(), p, n * sizeof(T));
    return v;
  }
  void TearDown() override {
    nccl.reset();
    for (void* p : buffers) gpu->free(p);
  }

  std::unique_ptr<Comm> world, nccl;
  std::unique_ptr<kernels::Backend> gpu;
  std::vector<void*> buffers;
};

TEST_F(NcclCommTest, AllReduceAllGatherBroadcastBarrier) {
  const int p = nccl->size(), me = nccl->rank();
  EXPECT_EQ(me, world->rank());
  EXPECT_EQ(p, world->size());
  const size_t n = 1000;
  std::vector<float> f(n);
  std::vector<int64_t> l(n);
  std::vector<int32_t> i32(n);
  std::vector<double> d(n);
  for (size_t i = 0; i < n; ++i) {
    f[i] = float(me + 1) + float(i);
    l[i] = int64_t(me) * 10 + int64_t(i);
    i32[i] = me * 10 + int32_t(i);
    d[i] = 0.5 * me + double(i);
  }
  float* df = to_dev(f);
  int64_t* dl = to_dev(l);
  int32_t* di = to_dev(i32);
  double* dd = to_dev(d);
  nccl->all_reduce(df, n, ReduceDType::F32, ReduceOp::Sum);
  nccl->all_reduce(dl, n, ReduceDType::I64, ReduceOp::Max);
  nccl->all_reduce(di, n, ReduceDType::I32, ReduceOp::Min);
  nccl->all_reduce(dd, n, ReduceDType::F64, ReduceOp::Sum);
  const auto hf = to_host(df, n);
  const auto hl = to_host(dl, n);
  const auto hi = to_host(di, n);
  const auto hd = to_host(dd, n);
  for (size_t i = 0; i < n; ++i) {
    EXPECT_EQ(hf[i], float(p * (p + 1) / 2) + float(p) * float(i)) << i;
    EXPECT_EQ(hl[i], int64_t(p - 1) * 10 + int64_t(i)) << i;
    EXPECT_EQ(hi[i], int32_t(i)) << i;
    EXPECT_EQ(hd[i], 0.25 * p * (p - 1) + double(p) * double(i)) << i;
  }

  const size_t block = 7;
  std::vector<int32_t> mine(block);
  for (size_t i = 0; i < block; ++i) mine[i] = me * 100 + int32_t(i);
  int32_t* dsend = to_dev(mine);
  int32_t* drecv = to_dev(std::vector<int32_t>(block * size_t(p), -1));
  nccl->all_gather(dsend, block * sizeof(int32_t), drecv);
  const auto all = to_host(drecv, block * size_t(p));
  for (int r = 0; r < p; ++r)
    for (size_t i = 0; i < block; ++i)
      EXPECT_EQ(all[size_t(r) * block + i], r * 100 + int32_t(i)) << "block of rank " << r;

  std::vector<int32_t> b(33, -1);
  if (me == p - 1)
    for (size_t i = 0; i < b.size(); ++i) b[i] = 1000 + int32_t(i);
  int32_t* db = to_dev(b);
  nccl->broadcast(db, b.size() * sizeof(int32_t), p - 1);
  const auto hb = to_host(db, b.size());
  for (size_t i = 0; i < b.size(); ++i) EXPECT_EQ(hb[i], 1000 + int32_t(i));
  EXPECT_THROW(nccl->broadcast(db, 4, p), Error);

  nccl->barrier();
}

// Elements `src` sends to `dst`: uneven, and zero for some pairs (both sides agree).
size_t pair_count(int src, int dst) { return (src + dst) % 3 == 2 ? 0 : size_t((src + 1) * (dst + 1)); }
int32_t tag(int src, int dst, size_t j) { return src * 10000 + dst * 100 + int32_t(j); }

TEST_F(NcclCommTest, AllToAllVWithEmptyPairs) {
  const int p = nccl->size(), me = nccl->rank();
  const size_t np = size_t(p);
  std::vector<size_t> sb(np), so(np), rb(np), ro(np);
  std::vector<int32_t> send;
  size_t roff = 0;
  for (int r = 0; r < p; ++r) {
    so[size_t(r)] = send.size() * sizeof(int32_t);
    for (size_t j = 0; j < pair_count(me, r); ++j) send.push_back(tag(me, r, j));
    sb[size_t(r)] = pair_count(me, r) * sizeof(int32_t);
    ro[size_t(r)] = roff + 4;  // a gap of one element before each block
    rb[size_t(r)] = pair_count(r, me) * sizeof(int32_t);
    roff += rb[size_t(r)] + 4;
  }
  int32_t* dsend = to_dev(send);
  int32_t* drecv = to_dev(std::vector<int32_t>(roff / 4, -1));
  nccl->all_to_all_v(dsend, sb.data(), so.data(), drecv, rb.data(), ro.data());
  const auto got = to_host(drecv, roff / 4);
  for (int r = 0; r < p; ++r) {
    EXPECT_EQ(got[ro[size_t(r)] / 4 - 1], -1) << "gap before the block from rank " << r;
    for (size_t j = 0; j < pair_count(r, me); ++j)
      EXPECT_EQ(got[ro[size_t(r)] / 4 + j], tag(r, me, j)) << "from rank " << r << " element " << j;
  }
}

TEST_F(NcclCommTest, RingSendRecvAndSelfRefused) {
  const int p = nccl->size(), me = nccl->rank();
  int32_t* d = to_dev(std::vector<int32_t>(4, 0));
  EXPECT_THROW(nccl->send(d, 4, me, 0), Error);
  EXPECT_THROW(nccl->recv(d, 4, p, 0), Error);
  if (p == 1) GTEST_SKIP() << "a ring needs two ranks";
  const int next = (me + 1) % p, prev = (me + p - 1) % p;
  std::vector<int32_t> out(size_t(100 + me));
  for (size_t j = 0; j < out.size(); ++j) out[j] = tag(me, next, j);
  int32_t* dout = to_dev(out);
  int32_t* din = to_dev(std::vector<int32_t>(size_t(100 + prev), -1));
  // NCCL send completes only when the peer receives: even ranks send first, odd ranks receive.
  if (me % 2 == 0) {
    nccl->send(dout, out.size() * 4, next, 3);
    nccl->recv(din, size_t(100 + prev) * 4, prev, 3);
  } else {
    nccl->recv(din, size_t(100 + prev) * 4, prev, 3);
    nccl->send(dout, out.size() * 4, next, 3);
  }
  const auto got = to_host(din, size_t(100 + prev));
  for (size_t j = 0; j < got.size(); ++j) EXPECT_EQ(got[j], tag(prev, me, j)) << j;
}

TEST_F(NcclCommTest, SplitOrdersByKeyThenRank) {
  const int p = nccl->size(), me = nccl->rank();
  auto sub = nccl->split(me % 2, -me);  // reversed order inside each color
  std::vector<int> members;
  for (int r = p - 1; r >= 0; --r)
    if (r % 2 == me % 2) members.push_back(r);
  const size_t n = size_t(sub->size());  // EXPECT, not ASSERT: every rank must reach all_gather
  EXPECT_EQ(n, members.size());
  int pos = 0;
  while (members[size_t(pos)] != me) ++pos;
  EXPECT_EQ(sub->rank(), pos);
  int32_t* d = to_dev(std::vector<int32_t>{me});
  int32_t* all = to_dev(std::vector<int32_t>(n, -1));
  sub->all_gather(d, 4, all);
  const auto got = to_host(all, n);
  for (size_t i = 0; i < n && i < members.size(); ++i) EXPECT_EQ(got[i], members[i]) << i;
  sub->barrier();
  EXPECT_THROW(nccl->split(-1, 0), Error);
}

// The MoE exchange with its payload on the GPU over a stream-ordered NCCL communicator (the
// backend's stream, as `comm: nccl` runs it) against the host exchange on the same inputs:
// the same plan, bitwise the same rows and results. On one rank it checks the device pack /
// unpack path (gather_rows over uploaded indices, table = x); on two GPUs the NCCL transfers.
TEST_F(NcclCommTest, StreamOrderedMoeExchangeMatchesHost) {
  auto stream_nccl = make_nccl_comm(*world, world->rank(), gpu->stream());
  const int p = world->size(), me = world->rank();
  const int64_t m = 37, d = 96, k = 4;
  std::vector<float> x(size_t(m * d));
  std::vector<int32_t> dest(size_t(m * k)), tag(size_t(m * k));
  for (int64_t i = 0; i < m * d; ++i) x[size_t(i)] = float(me * 100000 + i);
  for (int64_t s = 0; s < m * k; ++s) {
    dest[size_t(s)] = int32_t((s * 7 + me) % (p + 1)) - 1;
    tag[size_t(s)] = int32_t((s * 5) % 6);
  }
  MoeExchange host(*world), dev(*world, *gpu, *stream_nccl);
  host.dispatch(x.data(), m, d, k, dest.data(), tag.data());
  for (int64_t i = 0; i < host.recv_count(); ++i)
    for (int64_t c = 0; c < d; ++c)
      host.results()[i * d + c] = 2 * host.recv_row_data(i)[c] + float(host.recv_tag()[i]);
  host.combine();
  dev.dispatch(to_dev(x), m, d, k, dest.data(), tag.data());
  const int64_t n = dev.recv_count();
  EXPECT_EQ(n, host.recv_count());
  std::vector<float> y(size_t(std::max<int64_t>(n, 1) * d));
  for (int64_t i = 0; i < n && i < host.recv_count(); ++i) {
    const auto row = to_host(dev.recv_table() + int64_t(dev.recv_row()[i]) * d, size_t(d));
    EXPECT_EQ(std::memcmp(row.data(), host.recv_row_data(i), size_t(d) * 4), 0) << "row " << i;
    for (int64_t c = 0; c < d; ++c) y[size_t(i * d + c)] = 2 * row[size_t(c)] + float(dev.recv_tag()[i]);
  }
  if (n) gpu->to_device(dev.results(), y.data(), size_t(n * d) * 4);
  dev.combine();
  for (int64_t s = 0; s < m * k; ++s) {
    const int32_t r = dev.slot_row()[s];
    ASSERT_EQ(r, host.slot_row()[s]);
    if (r < 0) continue;
    const auto got = to_host(dev.result_rows() + int64_t(r) * d, size_t(d));
    EXPECT_EQ(std::memcmp(got.data(), host.result_rows() + int64_t(r) * d, size_t(d) * 4), 0) << "slot " << s;
  }
  EXPECT_EQ(stream_nccl->transport(), std::string("nccl"));
}

#else  // no CUDA in this build

TEST(NcclCommTest, SkippedWithoutCuda) {
  GTEST_SKIP() << "this build has no CUDA/NCCL support (configure on a machine with nvcc and NCCL)";
}

#endif

}  // namespace
}  // namespace glm5::parallel
