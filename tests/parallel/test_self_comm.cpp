// The one-rank self communicator (no MPI) and MoeExchange on it: the single-process path.
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "kernels/core/check.h"
#include "parallel/moe_exchange.h"

namespace glm5::parallel {
namespace {

TEST(SelfComm, OneRankCopiesAndRefusesPointToPoint) {
  auto comm = make_self_comm();
  EXPECT_EQ(comm->rank(), 0);
  EXPECT_EQ(comm->size(), 1);
  char c = 1;
  EXPECT_THROW(comm->send(&c, 1, 0, 0), Error);
  EXPECT_THROW(comm->recv(&c, 1, 0, 0), Error);

  const char src[] = "abcdefgh";
  char dst[12];
  std::memset(dst, '.', sizeof dst);
  size_t sb = 5, so = 2, rb = 5, ro = 4;
  comm->all_to_all_v(src, &sb, &so, dst, &rb, &ro);
  EXPECT_EQ(std::string(dst, 12), "....cdefg...");
  size_t bad = 4;
  EXPECT_THROW(comm->all_to_all_v(src, &sb, &so, dst, &bad, &ro), Error);

  int v = 42, g = 0;
  comm->all_gather(&v, sizeof v, &g);
  EXPECT_EQ(g, 42);
  float f[2] = {1.5f, -2.0f};
  comm->all_reduce(f, 2, ReduceDType::F32, ReduceOp::Sum);
  EXPECT_EQ(f[0], 1.5f);
  EXPECT_EQ(f[1], -2.0f);
  comm->broadcast(&v, sizeof v, 0);
  EXPECT_THROW(comm->broadcast(&v, sizeof v, 1), Error);
  comm->barrier();
  auto sub = comm->split(0, 5);
  EXPECT_EQ(sub->size(), 1);
  EXPECT_EQ(sub->rank(), 0);
}

TEST(SelfComm, MoeExchangeOrdersByTagThenSlot) {
  auto comm = make_self_comm();
  MoeExchange ex(*comm);
  // 3 tokens, top_k 2, d 2.
  const float x[] = {10, 11, 20, 21, 30, 31};
  const int32_t dest[] = {0, 0, -1, 0, 0, 0};
  const int32_t tag[] = {1, 0, 7, 1, 0, 1};
  ex.dispatch(x, 3, 2, 2, dest, tag);
  // Slots sent: 0 (tag 1), 1 (0), 3 (1), 4 (0), 5 (1) -> tag 0: 1, 4; tag 1: 0, 3, 5.
  ASSERT_EQ(ex.recv_count(), 5);
  const int32_t want_tag[] = {0, 0, 1, 1, 1};
  const float want_x0[] = {10, 30, 10, 20, 30};
  for (int i = 0; i < 5; ++i) {
    EXPECT_EQ(ex.recv_tag()[i], want_tag[i]) << i;
    EXPECT_EQ(ex.recv_src()[i], 0) << i;
    EXPECT_EQ(ex.recv_row_data(i)[0], want_x0[i]) << i;
    EXPECT_EQ(ex.recv_row_data(i)[1], want_x0[i] + 1) << i;
  }
  EXPECT_EQ(ex.recv_table(), x);   // one rank: the table is x itself, nothing is copied
  EXPECT_EQ(ex.bytes_sent(), 0u);  // nothing left this rank

  for (int i = 0; i < 10; ++i) ex.results()[i] = float(100 + i);
  ex.combine();
  // Slot s finds the result of the recv row that came from it; slot 2 was not sent.
  const int32_t want_row[] = {2, 0, -1, 3, 1, 4};
  for (int s = 0; s < 6; ++s) EXPECT_EQ(ex.slot_row()[s], want_row[s]) << s;
  EXPECT_EQ(ex.result_row_count(), 5);
  EXPECT_EQ(ex.result_rows()[2 * 2 + 1], 105.0f);

  // No tokens at all.
  ex.dispatch(nullptr, 0, 2, 2, nullptr, nullptr);
  EXPECT_EQ(ex.recv_count(), 0);
  ex.combine();
  EXPECT_EQ(ex.m(), 0);
  // Bad arguments are errors.
  const int32_t bad_dest[] = {1, 0, 0, 0, 0, 0};
  EXPECT_THROW(ex.dispatch(x, 3, 2, 2, bad_dest, tag), Error);
  EXPECT_THROW(ex.dispatch(x, 3, 0, 2, dest, tag), Error);
}

}  // namespace
}  // namespace glm5::parallel
