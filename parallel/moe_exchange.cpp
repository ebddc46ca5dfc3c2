// MoeExchange: counts, then rows with their tags, with Comm::all_to_all_v; results back the same
// way. The receive order (tag, source rank, source slot) comes from a stable sort by tag of the
// source-major arrival order, so it is fixed by the data alone, never by timing or rank count.
// Rows a rank sends to itself never go through the communicator; on one rank nothing does.
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
  const int p = comm_.size(), me = comm_.rank();
  sb_.resize(p);
  so_.resize(p);
  rb_.resize(p);
  ro_.resize(p);
  size_t soff = 0, roff = 0;
  for (int r = 0; r < p; ++r) {
    const size_t sb = size_t(send_rows[r]) * row_bytes, rb = size_t(recv_rows[r]) * row_bytes;
    // Rows for this rank itself are handled by the caller (the block is left out of the call).
    sb_[r] = r == me && !self_through_comm_ ? 0 : sb;
    so_[r] = soff;
    soff += sb;
    rb_[r] = r == me && !self_through_comm_ ? 0 : rb;
    ro_[r] = roff;
    roff += rb;
    if (r != me) bytes_sent_ += sb;
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

  // 1. Counts (and d, and the error flag) to every rank; one rank needs no exchange.
  recv_rows_.assign(p, 0);
  if (p == 1) {
    if (!error.empty()) GLM5_FAIL(error);
    recv_rows_[0] = send_rows_[0];
  } else {
    hdr_send_.resize(p * kHeaderWords);
    hdr_recv_.resize(p * kHeaderWords);
    for (int r = 0; r < p; ++r) {
      hdr_send_[r * kHeaderWords + 0] = send_rows_[r];
      hdr_send_[r * kHeaderWords + 1] = d;
      hdr_send_[r * kHeaderWords + 2] = error.empty() ? 0 : 1;
    }
    std::vector<int64_t> ones(p, 1);
    self_through_comm_ = true;
    exchange(hdr_send_.data(), ones, sizeof(Header), hdr_recv_.data(), ones);
    self_through_comm_ = false;
    if (!error.empty()) GLM5_FAIL(error);
    for (int r = 0; r < p; ++r) {
      const int64_t* h = &hdr_recv_[r * kHeaderWords];
      CHECK(h[2] == 0, "MoE dispatch: rank ", r,
            " of the stage passed invalid arguments (its own error names them); rank ", me,
            " stops too");
      CHECK(h[1] == d, "MoE dispatch: rank ", r, " uses rows of width d = ", h[1], " but rank ",
            me, " uses d = ", d, " (d must be equal on all ranks)");
      recv_rows_[r] = h[0];
    }
  }

  // 2. Group slots by destination (stable: slot order within a destination); remember the
  //    slots that are not sent, which combine() zeroes.
  m_ = m;
  d_ = d;
  top_k_ = top_k;
  send_first_.assign(p + 1, 0);
  for (int r = 0; r < p; ++r) send_first_[r + 1] = send_first_[r] + send_rows_[r];
  const int64_t n_send = send_first_[p];
  send_slot_.resize(n_send);
  unsent_slot_.clear();
  {
    std::vector<int64_t> pos(send_first_.begin(), send_first_.end() - 1);
    for (int64_t s = 0; s < n_slots; ++s) {
      if (dest_rank[s] >= 0)
        send_slot_[pos[dest_rank[s]]++] = s;
      else
        unsent_slot_.push_back(s);
    }
  }

  // 3. Pack the rows for other ranks, each destination's block as [rows, d] f32 then [rows]
  //    int32 tags, and exchange them in one call. The block for this rank stays out of it.
  const size_t row_bytes = size_t(d) * sizeof(float), wire_row = row_bytes + sizeof(int32_t);
  recv_first_.assign(p + 1, 0);
  for (int r = 0; r < p; ++r) recv_first_[r + 1] = recv_first_[r] + recv_rows_[r];
  const int64_t n_recv = recv_first_[p];
  if (p > 1) {
    send_wire_.resize(size_t(n_send) * wire_row);
    for (int r = 0; r < p; ++r) {
      if (r == me) continue;
      const int64_t k0 = send_first_[r], rows = send_rows_[r];
      char* block = send_wire_.data() + size_t(k0) * wire_row;
      char* tags = block + size_t(rows) * row_bytes;
#pragma omp parallel for schedule(static) if (rows * d >= kParallelCopy)
      for (int64_t k = 0; k < rows; ++k) {
        const int64_t s = send_slot_[k0 + k];
        std::memcpy(block + size_t(k) * row_bytes, x + (s / top_k) * d, row_bytes);
        std::memcpy(tags + size_t(k) * sizeof(int32_t), &tag[s], sizeof(int32_t));
      }
    }
    recv_wire_.resize(size_t(n_recv) * wire_row);
    exchange(send_wire_.data(), send_rows_, wire_row, recv_wire_.data(), recv_rows_);
  }

  // 4. Arrival is source-major with slot order inside a source; a stable sort by tag gives
  //    (tag, source, slot). Arrival row k of source r is row k - recv_first_[r] of r's block;
  //    for r == me that is this rank's own slot send_slot_[send_first_[me] + k - ...].
  raw_tag_.resize(n_recv);
  raw_src_.resize(n_recv);
  for (int r = 0; r < p; ++r) {
    const int64_t k0 = recv_first_[r], rows = recv_rows_[r];
    if (r == me) {
      for (int64_t k = 0; k < rows; ++k) raw_tag_[k0 + k] = tag[send_slot_[send_first_[me] + k]];
    } else {
      const char* tags = recv_wire_.data() + size_t(k0) * wire_row + size_t(rows) * row_bytes;
      std::memcpy(&raw_tag_[k0], tags, size_t(rows) * sizeof(int32_t));
    }
    std::fill(raw_src_.begin() + k0, raw_src_.begin() + k0 + rows, int32_t(r));
  }
  order_.resize(n_recv);
  std::iota(order_.begin(), order_.end(), int64_t(0));
  std::stable_sort(order_.begin(), order_.end(),
                   [&](int64_t a, int64_t b) { return raw_tag_[a] < raw_tag_[b]; });
  recv_x_.resize(size_t(n_recv * d));
  recv_tag_.resize(n_recv);
  recv_src_.resize(n_recv);
  const int64_t self0 = recv_first_[me], self1 = recv_first_[me + 1];
#pragma omp parallel for schedule(static) if (n_recv * d >= kParallelCopy)
  for (int64_t i = 0; i < n_recv; ++i) {
    const int64_t k = order_[i];
    const int32_t r = raw_src_[k];
    const void* row;
    if (k >= self0 && k < self1)
      row = x + (send_slot_[send_first_[me] + k - self0] / top_k) * d;
    else
      row = recv_wire_.data() + size_t(recv_first_[r]) * wire_row +
            size_t(k - recv_first_[r]) * row_bytes;
    std::memcpy(&recv_x_[i * d], row, row_bytes);
    recv_tag_[i] = raw_tag_[k];
    recv_src_[i] = r;
  }
  dispatched_ = true;
}

void MoeExchange::combine(const float* y) {
  CHECK(dispatched_, "MoE combine on rank ", comm_.rank(),
        " without a successful dispatch before it");
  const int p = comm_.size(), me = comm_.rank();
  const int64_t n_recv = recv_count(), n_send = int64_t(send_slot_.size()), d = d_;
  CHECK(n_recv == 0 || y, "MoE combine on rank ", comm_.rank(), ": null y with ", n_recv,
        " received rows");
  const size_t row_bytes = size_t(d) * sizeof(float);
  out_.resize(size_t(m_ * top_k_ * d));
  // Results for this rank's own slots go straight to out_; the others back to arrival order,
  // so each source gets its rows in the order it sent them.
  const int64_t self0 = recv_first_[me], self1 = recv_first_[me + 1];
  if (p > 1) back_.resize(size_t(n_recv * d));
#pragma omp parallel for schedule(static) if (n_recv * d >= kParallelCopy)
  for (int64_t i = 0; i < n_recv; ++i) {
    const int64_t k = order_[i];
    float* dst = (k >= self0 && k < self1) ? &out_[send_slot_[send_first_[me] + k - self0] * d]
                                           : &back_[k * d];
    std::memcpy(dst, y + i * d, row_bytes);
  }
  if (p > 1) {
    ret_.resize(size_t(n_send * d));
    exchange(back_.data(), recv_rows_, row_bytes, ret_.data(), send_rows_);
    for (int r = 0; r < p; ++r) {
      if (r == me) continue;
      const int64_t k0 = send_first_[r], k1 = send_first_[r + 1];
#pragma omp parallel for schedule(static) if ((k1 - k0) * d >= kParallelCopy)
      for (int64_t k = k0; k < k1; ++k)
        std::memcpy(&out_[send_slot_[k] * d], &ret_[k * d], row_bytes);
    }
  }
  for (int64_t s : unsent_slot_) std::fill_n(&out_[s * d], d, 0.0f);
}

}  // namespace glm5::parallel
