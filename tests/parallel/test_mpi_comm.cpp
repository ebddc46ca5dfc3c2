// MpiComm under mpirun (any number of ranks): point-to-point, all_to_all_v against a naive
// exchange built from send/recv, collectives, grid splits and MPI error reporting. Payloads are
// tagged with the sending rank so a misrouted byte shows. Large-message paths are exercised by
// lowering the message limit.
#include <gtest/gtest.h>

#include <climits>
#include <cstdint>
#include <functional>
#include <numeric>
#include <vector>

#include "parallel/grid.h"
#include "parallel/mpi_comm.h"

namespace glm5::parallel {
namespace {

// Sets the MPI message limit for one scope (all ranks do the same).
struct LimitGuard {
  explicit LimitGuard(size_t bytes) { set_mpi_message_limit(bytes); }
  ~LimitGuard() { set_mpi_message_limit(INT_MAX); }
};

uint8_t byte_of(int src, int dst, size_t i) { return uint8_t(src * 61 + dst * 17 + i * 7 + 1); }

// Bytes src sends to dst in the uneven exchange: several pairs get zero.
size_t pair_bytes(int src, int dst, int salt) {
  size_t n = size_t((src * 7 + dst * 3 + salt) % 5) * 13 + size_t(src == dst ? 0 : dst);
  return (src + dst + salt) % 3 == 0 ? 0 : n;
}

class MpiCommTest : public ::testing::Test {
 protected:
  void SetUp() override { world = make_mpi_world(); }
  std::unique_ptr<Comm> world;
};

TEST_F(MpiCommTest, WorldMatchesMpi) {
  int r = -1, s = -1;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  MPI_Comm_size(MPI_COMM_WORLD, &s);
  EXPECT_EQ(world->rank(), r);
  EXPECT_EQ(world->size(), s);
  EXPECT_EQ(mpi_world_rank(), r);
}

TEST_F(MpiCommTest, RingSendRecv) {
  const int p = world->size(), me = world->rank();
  if (p == 1) GTEST_SKIP() << "a ring needs two ranks";
  for (size_t limit : {size_t(INT_MAX), size_t(7)}) {
    LimitGuard guard(limit);
    const int next = (me + 1) % p, prev = (me + p - 1) % p;
    // Sizes differ per sender, including an empty message from rank 0.
    std::vector<uint8_t> out(size_t(me) * 37), in(size_t(prev) * 37, 0);
    for (size_t i = 0; i < out.size(); ++i) out[i] = byte_of(me, next, i);
    // Even ranks send first, odd ranks receive first: no deadlock for any p.
    if (me % 2 == 0) {
      world->send(out.data(), out.size(), next, 5);
      world->recv(in.data(), in.size(), prev, 5);
    } else {
      world->recv(in.data(), in.size(), prev, 5);
      world->send(out.data(), out.size(), next, 5);
    }
    [&] {  // ASSERT leaves only this lambda: every rank must still reach the next collective
      for (size_t i = 0; i < in.size(); ++i)
        ASSERT_EQ(in[i], byte_of(prev, me, i)) << "byte " << i << " from rank " << prev << ", limit " << limit;
    }();
  }
}

TEST_F(MpiCommTest, SendRecvChecksPeerAndTag) {
  char c = 0;
  EXPECT_THROW(world->send(&c, 1, world->size(), 0), Error);
  EXPECT_THROW(world->recv(&c, 1, -1, 0), Error);
  EXPECT_THROW(world->send(&c, 1, 0, -3), Error);
}

// all_to_all_v against a naive exchange: every ordered pair in one global order, send/recv.
// bytes(src, dst) gives each pair's size; gaps leaves unused bytes between the blocks.
void check_all_to_all_v(Comm& comm, const std::function<size_t(int, int)>& bytes, bool gaps) {
  const int p = comm.size(), me = comm.rank();
  std::vector<size_t> sb(p), so(p), rb(p), ro(p);
  size_t stot = 0, rtot = 0;
  for (int r = 0; r < p; ++r) {
    sb[r] = bytes(me, r);
    so[r] = stot;
    stot += sb[r] + (gaps ? 3 : 0);
    rb[r] = bytes(r, me);
    ro[r] = rtot + (gaps ? 2 : 0);
    rtot += rb[r] + (gaps ? 5 : 0);
  }
  std::vector<uint8_t> send(stot, 0xEE);
  for (int r = 0; r < p; ++r)
    for (size_t i = 0; i < sb[r]; ++i) send[so[r] + i] = byte_of(me, r, i);
  std::vector<uint8_t> recv(rtot, 0xAB), naive(rtot, 0xAB);
  comm.all_to_all_v(send.data(), sb.data(), so.data(), recv.data(), rb.data(), ro.data());

  for (int src = 0; src < p; ++src)
    for (int dst = 0; dst < p; ++dst) {
      if (src == me && dst == me)
        std::copy_n(&send[so[me]], sb[me], &naive[ro[me]]);
      else if (src == me)
        comm.send(&send[so[dst]], sb[dst], dst, 11);
      else if (dst == me)
        comm.recv(&naive[ro[src]], rb[src], src, 11);
    }
  // Identical to the naive exchange, gaps untouched (0xAB), each byte from the right sender.
  EXPECT_EQ(recv, naive) << "limit " << mpi_message_limit();
  for (int r = 0; r < p; ++r)
    for (size_t i = 0; i < rb[r]; ++i)
      ASSERT_EQ(recv[ro[r] + i], byte_of(r, me, i)) << "from rank " << r << " byte " << i;
  for (size_t i = 0; i < rtot; ++i) {
    bool inside = false;
    for (int r = 0; r < p; ++r) inside |= i >= ro[r] && i < ro[r] + rb[r];
    if (!inside) {
      ASSERT_EQ(recv[i], 0xAB) << "byte " << i << " outside every block was written";
    }
  }
}

void check_uneven(Comm& comm, int salt) {
  check_all_to_all_v(
      comm, [salt](int src, int dst) { return pair_bytes(src, dst, salt); }, true);
}

TEST_F(MpiCommTest, AllToAllVUnevenMatchesNaive) {
  for (int salt = 0; salt < 4; ++salt) check_uneven(*world, salt);
}

TEST_F(MpiCommTest, AllToAllVPointToPointPath) {
  // 7: every rank takes the Isend/Irecv path with chunks; 40: only ranks whose blocks or offsets
  // pass 40 bytes see it, and the others must follow them.
  for (size_t limit : {size_t(7), size_t(40)}) {
    LimitGuard guard(limit);
    for (int salt = 0; salt < 3; ++salt) check_uneven(*world, salt);
  }
}

TEST_F(MpiCommTest, AllToAllVPathAgreesWhenOnlySomeRanksAreLarge) {
  // Only rank 0 -> rank P-1 passes the 16-byte limit: those two ranks see it, the others have
  // 1-byte blocks at small offsets and must still take the point-to-point path with them.
  LimitGuard guard(16);
  const int p = world->size();
  check_all_to_all_v(
      *world, [p](int src, int dst) { return (src == 0 && dst == p - 1) ? size_t(20) : size_t(1); }, false);
}

TEST_F(MpiCommTest, AllToAllVAllEmpty) {
  const int p = world->size();
  std::vector<size_t> zeros(p, 0);
  uint8_t dummy = 7;
  world->all_to_all_v(nullptr, zeros.data(), zeros.data(), &dummy, zeros.data(), zeros.data());
  EXPECT_EQ(dummy, 7);
}

TEST_F(MpiCommTest, AllGather) {
  const int p = world->size(), me = world->rank();
  for (size_t limit : {size_t(INT_MAX), size_t(5)}) {
    LimitGuard guard(limit);
    for (size_t bytes : {size_t(1), size_t(13)}) {
      std::vector<uint8_t> mine(bytes), all(bytes * p, 0);
      for (size_t i = 0; i < bytes; ++i) mine[i] = byte_of(me, 0, i);
      world->all_gather(mine.data(), bytes, all.data());
      [&] {
        for (int r = 0; r < p; ++r)
          for (size_t i = 0; i < bytes; ++i)
            ASSERT_EQ(all[r * bytes + i], byte_of(r, 0, i)) << "block " << r << " limit " << limit;
      }();
      // In place: this rank's block already sits in the output.
      std::vector<uint8_t> inplace(bytes * p, 0);
      std::copy(mine.begin(), mine.end(), inplace.begin() + me * bytes);
      world->all_gather(inplace.data() + me * bytes, bytes, inplace.data());
      EXPECT_EQ(inplace, all);
    }
  }
}

TEST_F(MpiCommTest, AllReduce) {
  const int p = world->size(), me = world->rank();
  for (size_t limit : {size_t(INT_MAX), size_t(12)}) {
    LimitGuard guard(limit);
    const size_t n = 9;
    std::vector<float> fs(n), fm(n);
    std::vector<int64_t> is(n), im(n), imin(n);
    std::vector<double> ds(n);
    std::vector<int32_t> i32(n);
    for (size_t i = 0; i < n; ++i) {
      fs[i] = fm[i] = float(me + 1) * 0.5f + float(i);
      // Beyond 2^53: an i64 reduction that went through double would lose the low bits.
      is[i] = im[i] = imin[i] = (int64_t(1) << 60) / 8 * int64_t(me % 3) + int64_t(me) * 1000 + i;
      ds[i] = 0.25 * me + i;
      i32[i] = (me == p - 1) ? int32_t(100 + i) : -int32_t(i);
    }
    world->all_reduce(fs.data(), n, ReduceDType::F32, ReduceOp::Sum);
    world->all_reduce(fm.data(), n, ReduceDType::F32, ReduceOp::Max);
    world->all_reduce(is.data(), n, ReduceDType::I64, ReduceOp::Sum);
    world->all_reduce(im.data(), n, ReduceDType::I64, ReduceOp::Max);
    world->all_reduce(imin.data(), n, ReduceDType::I64, ReduceOp::Min);
    world->all_reduce(ds.data(), n, ReduceDType::F64, ReduceOp::Sum);
    world->all_reduce(i32.data(), n, ReduceDType::I32, ReduceOp::Max);
    world->all_reduce(nullptr, 0, ReduceDType::F32, ReduceOp::Sum);
    for (size_t i = 0; i < n; ++i) {
      float esum = 0, emax = -1e30f;
      int64_t isum = 0, imax = INT64_MIN, iminv = INT64_MAX;
      double dsum = 0;
      for (int r = 0; r < p; ++r) {
        float v = float(r + 1) * 0.5f + float(i);
        esum += v;  // small halves: exact in any order
        emax = std::max(emax, v);
        int64_t iv = (int64_t(1) << 60) / 8 * int64_t(r % 3) + int64_t(r) * 1000 + i;
        isum += iv;
        imax = std::max(imax, iv);
        iminv = std::min(iminv, iv);
        dsum += 0.25 * r + i;
      }
      EXPECT_EQ(fs[i], esum) << i;
      EXPECT_EQ(fm[i], emax) << i;
      EXPECT_EQ(is[i], isum) << i;
      EXPECT_EQ(im[i], imax) << i;
      EXPECT_EQ(imin[i], iminv) << i;
      EXPECT_EQ(ds[i], dsum) << i;
      EXPECT_EQ(i32[i], int32_t(100 + i)) << i;
    }
  }
}

TEST_F(MpiCommTest, BroadcastFromEveryRoot) {
  const int p = world->size(), me = world->rank();
  for (size_t limit : {size_t(INT_MAX), size_t(4)}) {
    LimitGuard guard(limit);
    for (int root = 0; root < p; ++root) {
      std::vector<uint8_t> buf(23, 0);
      if (me == root)
        for (size_t i = 0; i < buf.size(); ++i) buf[i] = byte_of(root, 99, i);
      world->broadcast(buf.data(), buf.size(), root);
      [&] {
        for (size_t i = 0; i < buf.size(); ++i)
          ASSERT_EQ(buf[i], byte_of(root, 99, i)) << "root " << root << " byte " << i;
      }();
    }
  }
  char c = 0;
  EXPECT_THROW(world->broadcast(&c, 1, p), Error);
}

// Every P x E factorisation of the world: stage communicators (one per stage, ranked by column)
// and column communicators (one per column, ranked by stage).
TEST_F(MpiCommTest, SplitIntoGridStagesAndColumns) {
  const int n = world->size(), me = world->rank();
  for (int stages = 1; stages <= n; ++stages) {
    if (n % stages) continue;
    Grid g{stages, n / stages};
    const int s = g.stage_of(me), c = g.column_of(me);
    auto stage = world->split(s, c);
    auto column = world->split(c, s);
    EXPECT_EQ(stage->size(), g.expert_parallel) << stages << "x" << g.expert_parallel;
    EXPECT_EQ(stage->rank(), c);
    EXPECT_EQ(column->size(), g.stages);
    EXPECT_EQ(column->rank(), s);
    // Membership: gather the world ranks of each sub-communicator.
    std::vector<int> members(stage->size(), -1);
    stage->all_gather(&me, sizeof(int), members.data());
    for (int k = 0; k < stage->size(); ++k) EXPECT_EQ(members[k], g.rank_of(s, k));
    members.assign(column->size(), -1);
    column->all_gather(&me, sizeof(int), members.data());
    for (int k = 0; k < column->size(); ++k) EXPECT_EQ(members[k], g.rank_of(k, c));
    // The sub-communicators are independent: a collective in one does not mix with the other.
    int64_t v = me;
    stage->all_reduce(&v, 1, ReduceDType::I64, ReduceOp::Sum);
    int64_t expect = 0;
    for (int k = 0; k < g.expert_parallel; ++k) expect += g.rank_of(s, k);
    EXPECT_EQ(v, expect);
    stage->barrier();
    column->barrier();
  }
}

TEST_F(MpiCommTest, SplitOrdersByKeyThenRank) {
  const int n = world->size(), me = world->rank();
  // One group, key reversed: new rank = n - 1 - me.
  auto rev = world->split(0, -me);
  EXPECT_EQ(rev->rank(), n - 1 - me);
  // Equal keys: old rank order. Split of a split works too.
  auto same = rev->split(3, 0);
  EXPECT_EQ(same->rank(), rev->rank());
  // Even/odd groups.
  auto parity = world->split(me % 2, 0);
  EXPECT_EQ(parity->size(), (n - me % 2 + 1) / 2);
  EXPECT_EQ(parity->rank(), me / 2);
  EXPECT_THROW(world->split(-1, 0), Error);
}

TEST_F(MpiCommTest, MpiCheckReportsMpiErrorAndRank) {
  char c = 0;
  try {
    MPI_CHECK(MPI_Send(&c, 1, MPI_BYTE, world->size() + 5, 0, MPI_COMM_WORLD));
    ADD_FAILURE() << "MPI_Send to a rank outside the world did not fail";
  } catch (const Error& e) {
    std::string msg = e.what();
    EXPECT_NE(msg.find("MPI_Send"), std::string::npos) << msg;
    EXPECT_NE(msg.find("rank " + std::to_string(world->rank())), std::string::npos) << msg;
    EXPECT_NE(msg.find("MPI_ERR_RANK"), std::string::npos) << msg;
  }
  EXPECT_THROW(set_mpi_message_limit(0), Error);
  world->barrier();
}

}  // namespace
}  // namespace glm5::parallel
