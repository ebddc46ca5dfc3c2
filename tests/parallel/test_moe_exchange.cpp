// MoeExchange under mpirun: rows tagged with (source rank, token) are dispatched and combined,
// and compared with a naive exchange made of send/recv. Covers ranks with no tokens, slots that
// are not sent (dest -1), the (tag, source, slot) receive order, combine back to the slots,
// repeated rounds, byte accounting (a token travels once per destination rank, however many of
// its slots go there) and bad arguments that must stop every rank, not hang one. The device
// payload path (rows in a device backend's memory, moved by a device communicator or staged)
// must give the host path's results bitwise with no payload byte through host memory.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <tuple>
#include <vector>

#include "kernels/cpu/device_like.h"
#include "parallel/device_comm.h"
#include "parallel/moe_exchange.h"
#include "parallel/mpi_comm.h"

namespace glm5::parallel {
namespace {

uint32_t mix(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t h = a * 0x9E3779B1u ^ (b + 0x7F4A7C15u) * 0x85EBCA77u ^ (c + 1u) * 0xC2B2AE3Du;
  h ^= h >> 15;
  h *= 0x2C1B3C6Du;
  h ^= h >> 12;
  return h;
}

// Row t of rank src, column c: exact in f32 (< 2^24) and unique per (src, t, c).
float x_value(int src, int64_t t, int64_t c) { return float(src * 1000000 + t * 1000 + c); }
// What the "experts" compute from a received row; exact in f32.
float y_value(float x, int32_t tag) { return 2.0f * x + float(tag); }

// One rank's inputs for a round.
struct Inputs {
  int64_t m = 0, d = 0, top_k = 0;
  std::vector<float> x;
  std::vector<int32_t> dest, tag;
};

Inputs make_inputs(int round, int me, int p, int64_t d, int64_t top_k, int n_tags) {
  Inputs in;
  in.d = d;
  in.top_k = top_k;
  // Rank 1 has no tokens in every round, rank 0 none in round 2; the others vary.
  in.m = (me == 1 || (round == 2 && me == 0)) ? 0 : int64_t(mix(round, me, 7) % 9 + 1);
  if (round == 3) in.m = 0;         // nobody has tokens
  if (round == 4) in.m = 150 + me;  // big enough for the threaded copies
  in.x.resize(size_t(in.m * d));
  for (int64_t t = 0; t < in.m; ++t)
    for (int64_t c = 0; c < d; ++c) in.x[t * d + c] = x_value(me, t, c);
  in.dest.resize(size_t(in.m * top_k));
  in.tag.resize(size_t(in.m * top_k));
  for (int64_t s = 0; s < in.m * top_k; ++s) {
    uint32_t h = mix(round * 131 + me, uint32_t(s), 3);
    in.dest[s] = int32_t(h % uint32_t(p + 1)) - 1;  // -1 = not sent
    in.tag[s] = in.dest[s] < 0 ? 12345 : int32_t((h >> 8) % uint32_t(n_tags));
  }
  return in;
}

struct Expected {
  int32_t tag, src;
  int64_t slot;
  std::vector<float> row;
};

// The naive exchange: each ordered pair in one global order; the sender sends the number of
// slots, then (slot, tag) pairs and rows.
std::vector<Expected> naive_dispatch(Comm& comm, const Inputs& in) {
  const int p = comm.size(), me = comm.rank();
  std::vector<Expected> got;
  for (int src = 0; src < p; ++src)
    for (int dst = 0; dst < p; ++dst) {
      if (src != me && dst != me) continue;
      std::vector<int64_t> slots;
      std::vector<int32_t> tags;
      std::vector<float> rows;
      if (src == me) {
        for (int64_t s = 0; s < in.m * in.top_k; ++s)
          if (in.dest[s] == dst) {
            slots.push_back(s);
            tags.push_back(in.tag[s]);
            const float* r = &in.x[(s / in.top_k) * in.d];
            rows.insert(rows.end(), r, r + in.d);
          }
      }
      int64_t n = int64_t(slots.size());
      if (src != dst) {
        if (src == me) {
          comm.send(&n, sizeof n, dst, 21);
          comm.send(slots.data(), n * sizeof(int64_t), dst, 22);
          comm.send(tags.data(), n * sizeof(int32_t), dst, 23);
          comm.send(rows.data(), n * in.d * sizeof(float), dst, 24);
          continue;
        }
        comm.recv(&n, sizeof n, src, 21);
        slots.resize(n);
        tags.resize(n);
        rows.resize(size_t(n * in.d));
        comm.recv(slots.data(), n * sizeof(int64_t), src, 22);
        comm.recv(tags.data(), n * sizeof(int32_t), src, 23);
        comm.recv(rows.data(), n * in.d * sizeof(float), src, 24);
      }
      for (int64_t k = 0; k < n; ++k)
        got.push_back(
            {tags[k], src, slots[k], std::vector<float>(rows.begin() + k * in.d, rows.begin() + (k + 1) * in.d)});
    }
  // The documented order, written as a full sort key.
  std::sort(got.begin(), got.end(), [](const Expected& a, const Expected& b) {
    return std::tie(a.tag, a.src, a.slot) < std::tie(b.tag, b.src, b.slot);
  });
  return got;
}

void run_round(Comm& comm, MoeExchange& ex, int round, int64_t d, int64_t top_k, int n_tags) {
  const int p = comm.size(), me = comm.rank();
  Inputs in = make_inputs(round, me, p, d, top_k, n_tags);
  const uint64_t bytes_before = ex.bytes_sent();
  ex.dispatch(in.x.data(), in.m, in.d, in.top_k, in.dest.data(), in.tag.data());
  std::vector<Expected> want = naive_dispatch(comm, in);

  // ASSERTs leave only these lambdas: every rank must still reach combine().
  [&] {
    ASSERT_EQ(ex.recv_count(), int64_t(want.size())) << "round " << round;
    for (int64_t i = 0; i < ex.recv_count(); ++i) {
      ASSERT_EQ(ex.recv_tag()[i], want[i].tag) << "round " << round << " row " << i;
      ASSERT_EQ(ex.recv_src()[i], want[i].src) << "round " << round << " row " << i;
      ASSERT_GE(ex.recv_row()[i], 0);
      ASSERT_LT(ex.recv_row()[i], ex.recv_table_rows());
      ASSERT_EQ(std::memcmp(ex.recv_row_data(i), want[i].row.data(), d * sizeof(float)), 0)
          << "round " << round << " row " << i << " from rank " << want[i].src << " slot " << want[i].slot;
      if (i > 0) {  // the order rule itself
        ASSERT_LE(std::tie(ex.recv_tag()[i - 1], ex.recv_src()[i - 1]), std::tie(ex.recv_tag()[i], ex.recv_src()[i]));
      }
    }
  }();

  // "Experts": y = 2x + tag, then back to the slots.
  float* y = ex.results();
  for (int64_t i = 0; i < ex.recv_count(); ++i)
    for (int64_t c = 0; c < d; ++c) y[i * d + c] = y_value(ex.recv_row_data(i)[c], ex.recv_tag()[i]);
  ex.combine();
  EXPECT_EQ(ex.m(), in.m);
  [&] {
    for (int64_t s = 0; s < in.m * top_k; ++s) {
      const int32_t row = ex.slot_row()[s];
      if (in.dest[s] < 0) {
        ASSERT_EQ(row, -1) << "round " << round << " slot " << s << " was not sent";
        continue;
      }
      ASSERT_GE(row, 0);
      ASSERT_LT(row, ex.result_row_count());
      for (int64_t c = 0; c < d; ++c)
        ASSERT_EQ(ex.result_rows()[row * d + c], y_value(x_value(me, s / top_k, c), in.tag[s]))
            << "round " << round << " slot " << s << " col " << c;
    }
  }();

  // Payload bytes to other ranks: each destination's distinct token rows and its (row, tag)
  // slot entries padded to whole rows, then one result row per slot back.
  uint64_t payload = 0;
  for (int r = 0; r < p; ++r) {
    if (r == me) continue;
    int64_t toks = 0, slots = 0;
    for (int64_t t = 0; t < in.m; ++t) {
      bool any = false;
      for (int64_t j = 0; j < top_k; ++j)
        if (in.dest[t * top_k + j] == r) any = true, ++slots;
      toks += any;
    }
    payload += uint64_t(toks + (2 * slots + d - 1) / d) * d * sizeof(float);
  }
  for (const Expected& e : want)
    if (e.src != me) payload += d * sizeof(float);
  const uint64_t delta = ex.bytes_sent() - bytes_before;
  // Plus one 32-byte count header to every other rank.
  EXPECT_EQ(delta, payload + 32 * uint64_t(p - 1)) << "round " << round;
}

TEST(MoeExchange, DispatchCombineMatchNaiveExchange) {
  auto world = make_mpi_world();
  MoeExchange ex(*world);
  for (int round = 0; round < 5; ++round) {
    const int64_t d = round == 4 ? 64 : 5, top_k = round == 1 ? 1 : 3;
    run_round(*world, ex, round, d, top_k, /*n_tags=*/round == 4 ? 8 : 3);
  }
}

TEST(MoeExchange, WorksOnStageSubCommunicators) {
  auto world = make_mpi_world();
  const int n = world->size(), me = world->rank();
  // Two groups (2 stages x n/2 columns for even n, sizes 2 and 1 for n = 3); each exchanges on
  // its own, with ranks renumbered inside the group.
  const int half = (n + 1) / 2;
  auto stage = world->split(me < half ? 0 : 1, me < half ? me : me - half);
  MoeExchange ex(*stage);
  for (int round = 0; round < 3; ++round) run_round(*stage, ex, round, 4, 2, 2);
}

TEST(MoeExchange, BadArgumentsStopEveryRank) {
  auto world = make_mpi_world();
  const int p = world->size(), me = world->rank();
  MoeExchange ex(*world);
  std::vector<float> x(2 * 4, 1.0f);
  std::vector<int32_t> tag(2 * 2, 0), dest(2 * 2, 0);
  // The last rank names a rank that does not exist: it throws its own message, the others learn
  // of it in the count exchange and throw too.
  if (me == p - 1) dest[3] = p;
  try {
    ex.dispatch(x.data(), 2, 4, 2, dest.data(), tag.data());
    ADD_FAILURE() << "dispatch with dest_rank = " << p << " on rank " << p - 1 << " did not throw";
  } catch (const Error& e) {
    std::string msg = e.what();
    if (me == p - 1)
      EXPECT_NE(msg.find("dest_rank[3]"), std::string::npos) << msg;
    else
      EXPECT_NE(msg.find("rank " + std::to_string(p - 1)), std::string::npos) << msg;
  }
  EXPECT_THROW(ex.combine(), Error);  // no successful dispatch to combine

  // Row widths that disagree.
  if (p > 1) {
    const int64_t d = me == 0 ? 3 : 4;
    dest.assign(4, 0);
    EXPECT_THROW(ex.dispatch(x.data(), 2, d, 2, dest.data(), tag.data()), Error);
  }
  // The exchange is usable again afterwards.
  dest.assign(4, -1);
  dest[0] = (me + 1) % p;
  ex.dispatch(x.data(), 2, 4, 2, dest.data(), tag.data());
  EXPECT_EQ(ex.recv_count(), 1);
  std::fill_n(ex.results(), 4, 3.0f);
  ex.combine();
  ASSERT_GE(ex.slot_row()[0], 0);
  EXPECT_EQ(ex.result_rows()[ex.slot_row()[0] * 4], 3.0f);
  EXPECT_EQ(ex.slot_row()[1], -1);
}

// Host transfers of the device-like backend between two points.
struct Transfers {
  uint64_t to_host = 0, to_device = 0;
};
Transfers transfers(const kernels::Backend& be) {
  const kernels::DeviceLikeCounters* c = kernels::device_like_counters(be);
  return {c->to_host_bytes, c->to_device_bytes};
}

// The host exchange and the device-payload exchange on the same inputs, round by round: the same
// plan (counts, order, rows, slot rows), bitwise the same rows and results, and through the
// host only the plan's index arrays (with a device communicator) or the staged payload.
void device_rounds(Comm& comm, bool staged) {
  const int p = comm.size();
  auto be = kernels::make_device_like_backend();
  auto payload = staged ? make_staged_comm(comm, *be) : make_device_like_comm(comm);
  MoeExchange host(comm), dev(comm, *be, *payload);
  for (int round = 0; round < 5; ++round) {
    const int64_t d = round == 4 ? 64 : 5, top_k = round == 1 ? 1 : 3;
    Inputs in = make_inputs(round, comm.rank(), p, d, top_k, round == 4 ? 8 : 3);
    host.dispatch(in.x.data(), in.m, d, top_k, in.dest.data(), in.tag.data());
    for (int64_t i = 0; i < host.recv_count(); ++i)
      for (int64_t c = 0; c < d; ++c) host.results()[i * d + c] = y_value(host.recv_row_data(i)[c], host.recv_tag()[i]);
    host.combine();

    float* x = static_cast<float*>(be->alloc(size_t(std::max<int64_t>(in.m * d, 1)) * sizeof(float)));
    be->to_device(x, in.x.data(), in.x.size() * sizeof(float));
    const Transfers t0 = transfers(*be);
    const uint64_t staged0 = payload->staged_bytes(), sent0 = dev.payload_bytes_sent();
    dev.dispatch(x, in.m, d, top_k, in.dest.data(), in.tag.data());
    const Transfers t1 = transfers(*be);
    const int64_t n = dev.recv_count();
    std::vector<float> rows(size_t(std::max<int64_t>(n, 1) * d)), y(rows.size());
    [&] {
      ASSERT_EQ(n, host.recv_count()) << "round " << round;
      ASSERT_TRUE(std::equal(dev.recv_tag(), dev.recv_tag() + n, host.recv_tag()));
      ASSERT_TRUE(std::equal(dev.recv_src(), dev.recv_src() + n, host.recv_src()));
      // The index arrays the kernels read are the host plan's, in device memory.
      std::vector<int32_t> rr(static_cast<size_t>(n)), sr(static_cast<size_t>(in.m * top_k));
      be->to_host(rr.data(), dev.recv_row_payload(), rr.size() * sizeof(int32_t));
      be->to_host(sr.data(), dev.slot_row_payload(), sr.size() * sizeof(int32_t));
      ASSERT_TRUE(std::equal(rr.begin(), rr.end(), dev.recv_row()));
      ASSERT_TRUE(std::equal(sr.begin(), sr.end(), host.slot_row()));
      for (int64_t i = 0; i < n; ++i) {
        be->to_host(&rows[i * d], dev.recv_table() + int64_t(dev.recv_row()[i]) * d, d * sizeof(float));
        ASSERT_EQ(std::memcmp(&rows[i * d], host.recv_row_data(i), d * sizeof(float)), 0)
            << "round " << round << " row " << i;
      }
    }();
    for (int64_t i = 0; i < n; ++i)
      for (int64_t c = 0; c < d; ++c) y[i * d + c] = y_value(rows[i * d + c], dev.recv_tag()[i]);
    be->to_device(dev.results(), y.data(), size_t(n * d) * sizeof(float));
    const Transfers t2 = transfers(*be);
    dev.combine();
    const Transfers t3 = transfers(*be);
    [&] {
      ASSERT_TRUE(std::equal(dev.slot_row(), dev.slot_row() + in.m * top_k, host.slot_row()));
      std::vector<float> got(static_cast<size_t>(d));
      for (int64_t s = 0; s < in.m * top_k; ++s) {
        const int32_t row = dev.slot_row()[s];
        if (row < 0) continue;
        be->to_host(got.data(), dev.result_rows() + int64_t(row) * d, d * sizeof(float));
        ASSERT_EQ(std::memcmp(got.data(), host.result_rows() + int64_t(row) * d, d * sizeof(float)), 0)
            << "round " << round << " slot " << s;
      }
    }();
    // What went through host memory: nothing read back; one upload of int32 indices (pack and
    // own rows, recv_row, slot_row and the rows going back; the test's own transfers excluded).
    if (!staged) {
      EXPECT_EQ(t1.to_host - t0.to_host, 0u) << "round " << round;
      EXPECT_EQ(t3.to_host - t2.to_host, 0u) << "round " << round;
      EXPECT_EQ(payload->staged_bytes(), 0u);
      EXPECT_LE(t1.to_device - t0.to_device, sizeof(int32_t) * uint64_t(2 * in.m * top_k + 2 * n)) << "round " << round;
      EXPECT_EQ(t3.to_device - t2.to_device, 0u) << "round " << round;
    } else if (dev.payload_bytes_sent() > sent0) {
      EXPECT_GT(payload->staged_bytes(), staged0) << "round " << round;  // rows moved: staged
    }
    be->free(x);
  }
}

TEST(MoeExchange, DevicePayloadOverADeviceCommMatchesHostBitwise) {
  auto world = make_mpi_world();
  device_rounds(*world, /*staged=*/false);
}

TEST(MoeExchange, DevicePayloadStagedOverMpiMatchesHostBitwise) {
  auto world = make_mpi_world();
  device_rounds(*world, /*staged=*/true);
}

TEST(MoeExchange, HostCommunicatorsRefuseDeviceMemory) {
  auto world = make_mpi_world();
  auto be = kernels::make_device_like_backend();
  void* p = be->alloc(64);
  try {
    world->broadcast(p, 64, 0);
    ADD_FAILURE() << "MPI broadcast of device-like memory did not throw";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("MPI broadcast was handed device memory"), std::string::npos) << e.what();
  }
  auto dev = make_device_like_comm(*world);
  dev->broadcast(p, 64, 0);  // the device communicator may
  be->free(p);
}

}  // namespace
}  // namespace glm5::parallel
