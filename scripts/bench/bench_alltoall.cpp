// MoE exchange benchmark (run under mpirun): MoeExchange dispatch + combine
// next to two plain MPI_Alltoallv calls that move what an exchange built directly on Alltoallv
// moves: one row per (token, expert) slot out and one result per slot back, packed by
// destination beforehand (packing not timed). Same run, interleaved. Tokens route uniformly:
// top_k distinct experts of n_experts per token, expert e on rank e / (n_experts / P).
// Neither side is timed with expert work: the reference's received rows are not grouped by
// expert, and MoeExchange's results are not written in the timed loop (in the model the expert
// GEMMs write them in place); one untimed round with identity "experts" checks every slot.
// GB/s = slot row bytes delivered between different ranks (dispatch + combine, all ranks) / time,
// the same count for both. A third column times plain MPI_Alltoallv of exactly the bytes
// MoeExchange puts on the wire (each token once per destination rank, slot entries, results):
// the transport floor of its own traffic.
//   mpirun -np 4 bench_alltoall [--tokens 64,256,1024] [--hidden 1024,6144] [--top-k 8]
//                               [--experts 256] [--reps 3] [--min-time 0.2]
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "kernels/core/check.h"
#include "parallel/moe_exchange.h"
#include "parallel/mpi_comm.h"

using namespace glm5;
using Clock = std::chrono::steady_clock;

namespace {

std::vector<int64_t> parse_list(const std::string& s) {
  std::vector<int64_t> v;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) v.push_back(std::stoll(item));
  return v;
}

double seconds(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

double max_over_ranks(double x) {
  MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, &x, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD));
  return x;
}

double sum_over_ranks(double x) {
  MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, &x, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD));
  return x;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

struct Case {
  int64_t m, d;
};

}  // namespace

int main(int argc, char** argv) {
  parallel::MpiRuntime mpi(&argc, &argv);
  int rc = 0;
  try {
    parallel::MpiComm world(MPI_COMM_WORLD, false);
    const int P = world.size(), me = world.rank();
    std::vector<int64_t> tokens = {64, 256, 1024}, hidden = {1024, 6144};
    int64_t top_k = 8, n_experts = 256;
    int reps = 3;
    double min_time = 0.2;
    for (int i = 1; i < argc; ++i) {
      std::string a = argv[i];
      auto next = [&]() -> std::string {
        CHECK(i + 1 < argc, "bench_alltoall: ", a, " needs a value");
        return argv[++i];
      };
      if (a == "--tokens")
        tokens = parse_list(next());
      else if (a == "--hidden")
        hidden = parse_list(next());
      else if (a == "--top-k")
        top_k = std::stoll(next());
      else if (a == "--experts")
        n_experts = std::stoll(next());
      else if (a == "--reps")
        reps = std::stoi(next());
      else if (a == "--min-time")
        min_time = std::stod(next());
      else
        GLM5_FAIL("bench_alltoall: unknown option ", a);
    }
    CHECK(n_experts % P == 0, "bench_alltoall: --experts ", n_experts, " must be a multiple of the rank count ", P);
    CHECK(top_k >= 1 && top_k <= n_experts, "bench_alltoall: --top-k ", top_k, " must be in [1, ", n_experts, "]");
    CHECK(reps >= 1, "bench_alltoall: --reps must be >= 1, got ", reps);
    const int64_t per = n_experts / P;

    if (me == 0) {
      std::printf(
          "# bench_alltoall: %d ranks, top_k %lld of %lld experts (uniform), %d reps, "
          "median; GB/s = off-rank row bytes (dispatch + combine, all ranks) / time\n",
          P, (long long)top_k, (long long)n_experts, reps);
      std::printf("%5s %7s %6s %10s %9s %9s %9s %9s %9s %9s %6s\n", "ranks", "tokens", "hidden", "slot_MB", "wire_MB",
                  "moe_ms", "mpi_ms", "wire_ms", "moe_GB/s", "mpi_GB/s", "ratio");
    }

    for (int64_t d : hidden) {
      for (int64_t m : tokens) {
        // Routing: top_k distinct experts per token, uniform (partial Fisher-Yates).
        std::mt19937_64 rng(uint64_t(1000003) * uint64_t(me + 1) + uint64_t(m * 7 + d));
        std::vector<int32_t> dest(size_t(m * top_k)), tag(size_t(m * top_k));
        std::vector<int32_t> perm(static_cast<size_t>(n_experts));
        for (int64_t t = 0; t < m; ++t) {
          for (int64_t e = 0; e < n_experts; ++e) perm[size_t(e)] = int32_t(e);
          for (int64_t j = 0; j < top_k; ++j) {
            std::uniform_int_distribution<int64_t> pick(j, n_experts - 1);
            std::swap(perm[size_t(j)], perm[size_t(pick(rng))]);
            dest[size_t(t * top_k + j)] = int32_t(perm[size_t(j)] / per);
            tag[size_t(t * top_k + j)] = int32_t(perm[size_t(j)] % per);
          }
        }
        // Rows tagged by sender rank and token, so a misrouted row shows in the check below.
        std::vector<float> x(size_t(m * d));
        for (int64_t t = 0; t < m; ++t)
          for (int64_t c = 0; c < d; ++c) x[size_t(t * d + c)] = float(me * 100000 + t) + float(c % 7);

        // Per-pair row counts for the plain reference, packed the same way (by destination).
        std::vector<int64_t> send_rows(size_t(P), 0), recv_rows(size_t(P), 0);
        for (int32_t r : dest) ++send_rows[size_t(r)];
        MPI_CHECK(MPI_Alltoall(send_rows.data(), 1, MPI_INT64_T, recv_rows.data(), 1, MPI_INT64_T, MPI_COMM_WORLD));
        std::vector<int> sc(static_cast<size_t>(P)), sd(sc), rc_(sc), rd(sc);
        int64_t n_send = 0, n_recv = 0;
        double offrank = 0;
        for (int r = 0; r < P; ++r) {
          const int64_t sb = send_rows[size_t(r)] * d * 4, rb = recv_rows[size_t(r)] * d * 4;
          CHECK(n_send * d * 4 + sb <= INT32_MAX && n_recv * d * 4 + rb <= INT32_MAX, "bench_alltoall: ", m,
                " tokens x hidden ", d, " is too large for int MPI counts in the reference");
          sc[size_t(r)] = int(sb);
          sd[size_t(r)] = int(n_send * d * 4);
          rc_[size_t(r)] = int(rb);
          rd[size_t(r)] = int(n_recv * d * 4);
          n_send += send_rows[size_t(r)];
          n_recv += recv_rows[size_t(r)];
          if (r != me) offrank += double(sb) + double(rb);  // out in dispatch, back in combine
        }
        const double offrank_all = sum_over_ranks(offrank);
        std::vector<float> ref_send(size_t(n_send * d), 1.0f), ref_recv(size_t(n_recv * d));
        std::vector<float> ref_back(size_t(n_send * d));
        std::vector<char> wire_send, wire_recv;
        double wire_all = 0;
        int64_t wire_mine = 0;  // bytes this rank puts on the wire per round (no count headers)

        parallel::MoeExchange ex(world);
        auto moe_once = [&](bool identity_experts) {
          ex.dispatch(x.data(), m, d, top_k, dest.data(), tag.data());
          if (identity_experts)
            for (int64_t i = 0; i < ex.recv_count(); ++i)
              std::memcpy(ex.results() + i * d, ex.recv_row_data(i), size_t(d) * 4);
          ex.combine();
        };
        auto mpi_once = [&]() {
          MPI_CHECK(MPI_Alltoallv(ref_send.data(), sc.data(), sd.data(), MPI_BYTE, ref_recv.data(), rc_.data(),
                                  rd.data(), MPI_BYTE, MPI_COMM_WORLD));
          MPI_CHECK(MPI_Alltoallv(ref_recv.data(), rc_.data(), rd.data(), MPI_BYTE, ref_back.data(), sc.data(),
                                  sd.data(), MPI_BYTE, MPI_COMM_WORLD));
        };

        // MoeExchange's wire bytes per pair: dispatch blocks (distinct tokens + entries, packed as
        // moe_exchange.cpp packs them) and results, sent as two plain Alltoallv calls. The total is
        // checked against the exchange's own byte counter below.
        std::vector<int> wsc(static_cast<size_t>(P)), wsd(wsc), wrc(wsc), wrd(wsc), bsc(wsc), bsd(wsc), brc(wsc),
            brd(wsc);
        {
          // Distinct (token, destination) pairs and slot entries, as moe_exchange.cpp packs them.
          std::vector<int64_t> toks(static_cast<size_t>(P), 0), slots(static_cast<size_t>(P), 0);
          for (int64_t t = 0; t < m; ++t) {
            std::vector<char> seen(static_cast<size_t>(P), 0);
            for (int64_t j = 0; j < top_k; ++j) {
              const int32_t r = dest[size_t(t * top_k + j)];
              ++slots[size_t(r)];
              if (!seen[size_t(r)]) seen[size_t(r)] = 1, ++toks[size_t(r)];
            }
          }
          std::vector<int64_t> wsend(static_cast<size_t>(P)), wrecv(static_cast<size_t>(P));
          for (int r = 0; r < P; ++r)
            wsend[size_t(r)] = r == me ? 0 : (toks[size_t(r)] + (2 * slots[size_t(r)] + d - 1) / d) * d * 4;
          MPI_CHECK(MPI_Alltoall(wsend.data(), 1, MPI_INT64_T, wrecv.data(), 1, MPI_INT64_T, MPI_COMM_WORLD));
          int64_t so = 0, ro = 0, bso = 0, bro = 0;
          for (int r = 0; r < P; ++r) {
            wsc[size_t(r)] = int(wsend[size_t(r)]);
            wsd[size_t(r)] = int(so);
            wrc[size_t(r)] = int(wrecv[size_t(r)]);
            wrd[size_t(r)] = int(ro);
            so += wsend[size_t(r)];
            ro += wrecv[size_t(r)];
            // Results: one row per slot, back along the reverse direction.
            bsc[size_t(r)] = r == me ? 0 : rc_[size_t(r)];
            bsd[size_t(r)] = int(bso);
            brc[size_t(r)] = r == me ? 0 : sc[size_t(r)];
            brd[size_t(r)] = int(bro);
            bso += rc_[size_t(r)];
            bro += sc[size_t(r)];
          }
          wire_mine = so + bso - rc_[size_t(me)];
          wire_all = sum_over_ranks(double(wire_mine));
          wire_send.assign(size_t(std::max<int64_t>(so, 1)), 0);
          wire_recv.assign(size_t(std::max<int64_t>(ro, 1)), 0);
        }
        auto wire_once = [&]() {
          MPI_CHECK(MPI_Alltoallv(wire_send.data(), wsc.data(), wsd.data(), MPI_BYTE, wire_recv.data(), wrc.data(),
                                  wrd.data(), MPI_BYTE, MPI_COMM_WORLD));
          MPI_CHECK(MPI_Alltoallv(ref_recv.data(), bsc.data(), bsd.data(), MPI_BYTE, ref_back.data(), brc.data(),
                                  brd.data(), MPI_BYTE, MPI_COMM_WORLD));
        };

        // Warm-up and check: every slot comes back as its own token's row.
        const uint64_t sent_before = ex.bytes_sent();
        moe_once(true);
        // The wire reference moves what the exchange moved, apart from its 32-byte count headers.
        CHECK(ex.bytes_sent() - sent_before == uint64_t(wire_mine) + 32 * uint64_t(P - 1),
              "bench_alltoall: the wire reference (", wire_mine,
              " bytes) does not match what "
              "MoeExchange sent (",
              ex.bytes_sent() - sent_before, " bytes incl. headers)");
        mpi_once();
        wire_once();
        int bad = 0;
        for (int64_t s = 0; s < m * top_k && !bad; ++s) {
          const int32_t row = ex.slot_row()[s];
          if (row < 0 ||
              std::memcmp(ex.result_rows() + int64_t(row) * d, x.data() + (s / top_k) * d, size_t(d) * 4) != 0)
            bad = 1;
        }
        MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, &bad, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD));
        CHECK(!bad, "bench_alltoall: MoeExchange returned a wrong row (m = ", m, ", d = ", d, ")");

        // Iterations per timed block: enough for min_time, the same on every rank.
        MPI_CHECK(MPI_Barrier(MPI_COMM_WORLD));
        auto t = Clock::now();
        moe_once(false);
        const double one = max_over_ranks(seconds(t));
        const int iters = int(std::clamp(min_time / std::max(one, 1e-6), 1.0, 2000.0));

        std::vector<double> t_moe, t_wire, t_mpi;
        for (int rep = 0; rep < reps; ++rep) {
          MPI_CHECK(MPI_Barrier(MPI_COMM_WORLD));
          t = Clock::now();
          for (int i = 0; i < iters; ++i) moe_once(false);
          t_moe.push_back(max_over_ranks(seconds(t)) / iters);
          MPI_CHECK(MPI_Barrier(MPI_COMM_WORLD));
          t = Clock::now();
          for (int i = 0; i < iters; ++i) wire_once();
          t_wire.push_back(max_over_ranks(seconds(t)) / iters);
          MPI_CHECK(MPI_Barrier(MPI_COMM_WORLD));
          t = Clock::now();
          for (int i = 0; i < iters; ++i) mpi_once();
          t_mpi.push_back(max_over_ranks(seconds(t)) / iters);
        }
        const double a = median(t_moe), c = median(t_wire), b = median(t_mpi);
        if (me == 0)
          std::printf("%5d %7lld %6lld %10.2f %9.2f %9.3f %9.3f %9.3f %9.2f %9.2f %6.2f\n", P, (long long)m,
                      (long long)d, offrank_all / 1e6, wire_all / 1e6, a * 1e3, b * 1e3, c * 1e3, offrank_all / a / 1e9,
                      offrank_all / b / 1e9, b / a);
        std::fflush(stdout);
      }
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_alltoall: %s\n", e.what());
    rc = 1;
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  return rc;
}
