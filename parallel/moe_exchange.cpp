// MoeExchange: counts, then rows and tags, with Comm::all_to_all_v; results back the same way.
// The receive order (tag, source rank, source slot) comes from a stable sort by tag of the
// source-major arrival order, so it is fixed by the data alone, never by timing or rank count.
#include "parallel/moe_exchange.h"

#include <algorithm>
#include <cstring>
#include <numeric>
#include <sstream>

#include "core/check.h"

namespace glm5::parallel {

namespace {
// Rows below this many floats are copied on one thread.
constexpr int64_t kParallelCopy = int64_t(1) << 15;

// Per-destination header of the count exchange.
struct Header {
  int64_t rows;   // rows this rank sends to the receiver
  int64_t d;      // row width, must agree on all ranks
  int64_t error;  // 1: this rank's arguments were bad (it throws its own message)
};
constexpr size_t kHeaderWords = sizeof(Header) / sizeof(int64_t);
}  // namespace

MoeExchange::MoeExchange(Comm& stage_comm) : comm_(stage_comm) {}

void MoeExchange::exchange(const void* send, const std::vector<int64_t>& send_rows,
                           size_t row_bytes, void* recv, const std::vector<int64_t>& recv_rows) {
  const int p = comm_.size();
  sb_.resize(p);
  so_.resize(p);
  rb_.resize(p);
  ro_.resize(p);
  size_t soff = 0, roff = 0;
  for (int r = 0; r < p; ++r) {
    sb_[r] = size_t(send_rows[r]) * row_bytes;
    so_[r] = soff;
    soff += sb_[r];
    rb_[r] = size_t(recv_rows[r]) * row_bytes;
    ro_[r] = roff;
    roff += rb_[r];
    if (r != comm_.rank()) bytes_sent_ += sb_[r];
  }
  comm_.all_to_all_v(send, sb_.data(), so_.data(), recv, rb_.data(), ro_.data());
}

void MoeExchange::dispatch(const float* x, int64_t m, int64_t d, int64_t top_k,
                           const int32_t* dest_rank, const int32_t* tag) {
  const int p = comm_.size(), me = comm_.rank();
  dispatched_ = false;

  // Validate locally, but report through the header exchange so that all ranks throw together.
  std::string error;
  if (m < 0 || d < 1 || top_k < 1) {
    std::ostringstream os;
    os << "MoE dispatch on rank " << me << ": need m >= 0, d >= 1, top_k >= 1; got m = " << m
       << ", d = " << d << ", top_k = " << top_k;
    error = os.str();
  } else if (m > 0 && (!x || !dest_rank || !tag)) {
    error = "MoE dispatch on rank " + std::to_string(me) +
            ": null x, dest_rank or tag with m = " + std::to_string(m);
  }
  const int64_t n_slots = error.empty() ? m * top_k : 0;
  send_rows_.assign(p, 0);
  for (int64_t s = 0; s < n_slots && error.empty(); ++s) {
    int32_t r = dest_rank[s];
    if (r == -1) continue;
    if (r < 0 || r >= p) {
      std::ostringstream os;
      os << "MoE dispatch on rank " << me << ": dest_rank[" << s << "] (token " << s / top_k
         << ", j " << s % top_k << ") = " << r << ", expected -1 or a rank in [0, " << p << ")";
      error = os.str();
      break;
    }
    ++send_rows_[r];
  }
  if (!error.empty()) send_rows_.assign(p, 0);

  // 1. Counts (and d, and the error flag) to every rank.
  hdr_send_.resize(p * kHeaderWords);
  hdr_recv_.resize(p * kHeaderWords);
  for (int r = 0; r < p; ++r) {
    hdr_send_[r * kHeaderWords + 0] = send_rows_[r];
    hdr_send_[r * kHeaderWords + 1] = d;
    hdr_send_[r * kHeaderWords + 2] = error.empty() ? 0 : 1;
  }
  std::vector<int64_t> ones(p, 1);
  exchange(hdr_send_.data(), ones, sizeof(Header), hdr_recv_.data(), ones);
  if (!error.empty()) GLM5_FAIL(error);
  recv_rows_.assign(p, 0);
  for (int r = 0; r < p; ++r) {
    const int64_t* h = &hdr_recv_[r * kHeaderWords];
    CHECK(h[2] == 0, "MoE dispatch: rank ", r,
          " of the stage passed invalid arguments (its own error names them); rank ", me,
          " stops too");
    CHECK(h[1] == d, "MoE dispatch: rank ", r, " uses rows of width d = ", h[1], " but rank ", me,
          " uses d = ", d, " (d must be equal on all ranks)");
    recv_rows_[r] = h[0];
  }

  // 2. Group slots by destination (stable: slot order within a destination) and pack.
  m_ = m;
  d_ = d;
  top_k_ = top_k;
  std::vector<int64_t> pos(p, 0);
  for (int r = 1; r < p; ++r) pos[r] = pos[r - 1] + send_rows_[r - 1];
  const int64_t n_send = std::accumulate(send_rows_.begin(), send_rows_.end(), int64_t(0));
  send_slot_.resize(n_send);
  for (int64_t s = 0; s < n_slots; ++s)
    if (dest_rank[s] >= 0) send_slot_[pos[dest_rank[s]]++] = s;
  send_x_.resize(size_t(n_send * d));
  send_tag_.resize(n_send);
#pragma omp parallel for schedule(static) if (n_send * d >= kParallelCopy)
  for (int64_t k = 0; k < n_send; ++k) {
    const int64_t s = send_slot_[k];
    std::memcpy(&send_x_[k * d], x + (s / top_k) * d, size_t(d) * sizeof(float));
    send_tag_[k] = tag[s];
  }

  // 3. Rows, then tags.
  const int64_t n_recv = std::accumulate(recv_rows_.begin(), recv_rows_.end(), int64_t(0));
  raw_x_.resize(size_t(n_recv * d));
  raw_tag_.resize(n_recv);
  exchange(send_x_.data(), send_rows_, size_t(d) * sizeof(float), raw_x_.data(), recv_rows_);
  exchange(send_tag_.data(), send_rows_, sizeof(int32_t), raw_tag_.data(), recv_rows_);

  // 4. Arrival is source-major with slot order inside a source; a stable sort by tag gives
  //    (tag, source, slot).
  std::vector<int32_t> raw_src(n_recv);
  for (int64_t r = 0, i = 0; r < p; ++r)
    for (int64_t k = 0; k < recv_rows_[r]; ++k) raw_src[i++] = int32_t(r);
  order_.resize(n_recv);
  std::iota(order_.begin(), order_.end(), int64_t(0));
  std::stable_sort(order_.begin(), order_.end(),
                   [&](int64_t a, int64_t b) { return raw_tag_[a] < raw_tag_[b]; });
  recv_x_.resize(size_t(n_recv * d));
  recv_tag_.resize(n_recv);
  recv_src_.resize(n_recv);
#pragma omp parallel for schedule(static) if (n_recv * d >= kParallelCopy)
  for (int64_t i = 0; i < n_recv; ++i) {
    const int64_t k = order_[i];
    std::memcpy(&recv_x_[i * d], &raw_x_[k * d], size_t(d) * sizeof(float));
    recv_tag_[i] = raw_tag_[k];
    recv_src_[i] = raw_src[k];
  }
  dispatched_ = true;
}

void MoeExchange::combine(const float* y) {
  CHECK(dispatched_, "MoE combine on rank ", comm_.rank(),
        " without a successful dispatch before it");
  const int64_t n_recv = recv_count(), n_send = int64_t(send_slot_.size()), d = d_;
  CHECK(n_recv == 0 || y, "MoE combine on rank ", comm_.rank(), ": null y with ", n_recv,
        " received rows");
  // Back to arrival order, so each source gets its rows in the order it sent them.
  back_.resize(size_t(n_recv * d));
#pragma omp parallel for schedule(static) if (n_recv * d >= kParallelCopy)
  for (int64_t i = 0; i < n_recv; ++i)
    std::memcpy(&back_[order_[i] * d], y + i * d, size_t(d) * sizeof(float));
  ret_.resize(size_t(n_send * d));
  exchange(back_.data(), recv_rows_, size_t(d) * sizeof(float), ret_.data(), send_rows_);
  out_.assign(size_t(m_ * top_k_ * d), 0.0f);
#pragma omp parallel for schedule(static) if (n_send * d >= kParallelCopy)
  for (int64_t k = 0; k < n_send; ++k)
    std::memcpy(&out_[send_slot_[k] * d], &ret_[k * d], size_t(d) * sizeof(float));
}

}  // namespace glm5::parallel
