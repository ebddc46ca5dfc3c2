// MoeExchange: counts, then token rows with their (row, tag) slot entries, with
// Comm::all_to_all_v; results back the same way. Host payload: a peer's rows and entries travel in
// one message. Device payload: the entries first over the host comm (the plan is then complete
// on the host), then the rows over the payload comm, packed and unpacked by the backend's
// gather_rows. The receive order (tag, source rank, source slot) comes from a stable sort by tag
// of the source-major arrival order, so it is fixed by the data alone, never by timing or rank
// count. Local copies: each token row sent is packed once, the rank's own tokens are copied into
// the table once (none on a one-rank comm), and results for other ranks are put in arrival order
// once; everything else is addressed by index.
#include "parallel/moe_exchange.h"

#include <algorithm>
#include <cstring>
#include <numeric>
#include <sstream>

#include "kernels/core/check.h"

namespace glm5::parallel {

namespace {
// Rows below this many floats are copied on one thread.
constexpr int64_t kParallelCopy = int64_t(1) << 15;

// Per-destination header of the count exchange.
struct Header {
  int64_t slots;  // slots this rank sends to the receiver
  int64_t toks;   // distinct token rows among them
  int64_t d;      // row width, must agree on all ranks
  int64_t error;  // 1: this rank's arguments were bad (it throws its own message)
};
constexpr size_t kHeaderWords = sizeof(Header) / sizeof(int64_t);

// Whole rows of d floats that hold n (row, tag) int32 pairs.
int64_t entry_rows(int64_t n, int64_t d) { return (2 * n + d - 1) / d; }

void copy_rows(float* dst, const float* src, int64_t d) { std::memcpy(dst, src, size_t(d) * sizeof(float)); }
}  // namespace

MoeExchange::MoeExchange(Comm& stage_comm) : comm_(stage_comm) {}

MoeExchange::MoeExchange(Comm& stage_comm, kernels::Backend& backend, Comm& payload_comm)
    : comm_(stage_comm), payload_comm_(&payload_comm), be_(&backend), device_(true) {
  CHECK(!backend.host_memory(), "MoeExchange: backend ", backend.name(), " has host memory; use the host exchange");
  CHECK(payload_comm.device_buffers() && payload_comm.size() == stage_comm.size() &&
            payload_comm.rank() == stage_comm.rank(),
        "MoeExchange: the payload communicator (", payload_comm.transport(),
        ") must take device buffers and have the stage's ranks in the same order");
  for (DeviceScratch* b : {&dev_index_, &dev_wire_, &dev_table_, &dev_results_}) b->be = &backend;
}

MoeExchange::~MoeExchange() = default;

void* MoeExchange::DeviceScratch::reserve(size_t bytes) {
  bytes = std::max<size_t>(bytes, 1);
  if (bytes > cap) {
    be->free(p);
    p = nullptr;
    cap = 0;
    p = be->alloc(bytes);
    cap = bytes;
  }
  return p;
}

MoeExchange::DeviceScratch::~DeviceScratch() {
  if (be && p) be->free(p);
}

void MoeExchange::exchange(Comm& comm, const void* send, const std::vector<int64_t>& send_rows, size_t row_bytes,
                           void* recv, const std::vector<int64_t>& recv_rows, bool include_self) {
  const int p = comm.size(), me = comm.rank();
  sb_.resize(p);
  so_.resize(p);
  rb_.resize(p);
  ro_.resize(p);
  size_t soff = 0, roff = 0;
  for (int r = 0; r < p; ++r) {
    const size_t sb = size_t(send_rows[r]) * row_bytes, rb = size_t(recv_rows[r]) * row_bytes;
    // This rank's own block keeps its place in both buffers but is left out of the call.
    sb_[r] = r == me && !include_self ? 0 : sb;
    so_[r] = soff;
    soff += sb;
    rb_[r] = r == me && !include_self ? 0 : rb;
    ro_[r] = roff;
    roff += rb;
    if (r != me) bytes_sent_ += sb;
  }
  comm.all_to_all_v(send, sb_.data(), so_.data(), recv, rb_.data(), ro_.data());
}

void MoeExchange::dispatch(const float* x, int64_t m, int64_t d, int64_t top_k, const int32_t* dest_rank,
                           const int32_t* tag) {
  dispatched_ = false;
  // Validated locally, but reported through the count exchange so that all ranks throw together.
  const std::string error = count_sends(x, m, d, top_k, dest_rank, tag);
  const std::vector<int64_t> recv_toks = exchange_counts(d, error);
  m_ = m;
  d_ = d;
  top_k_ = top_k;
  group_sends(m * top_k, top_k, dest_rank, tag);

  recv_first_.assign(comm_.size() + 1, 0);
  for (int r = 0; r < comm_.size(); ++r) recv_first_[r + 1] = recv_first_[r] + recv_slots_[r];
  n_recv_ = recv_first_[comm_.size()];
  n_ret_ = comm_.size() > 1 ? send_first_[comm_.size()] : 0;

  // 3-4. Host payload: the rows and the entries together to the table. Device payload: the
  //      entries alone now over the host comm (the rows move once the plan is complete). On one
  //      rank x itself is the table.
  if (device_)
    exchange_entries(x, recv_toks);
  else
    move_rows_host(x, recv_toks);
  place_slots(recv_toks);
  if (device_)
    move_rows_device(x);
  else
    results_.reserve(size_t(std::max<int64_t>(n_recv_ + n_ret_, 1) * d));
  dispatched_ = true;
}

// Checks the arguments and counts the slots and distinct tokens this rank sends to each rank
// (send_slots_, send_toks_; all zero on an error). Returns the error, empty when none.
std::string MoeExchange::count_sends(const float* x, int64_t m, int64_t d, int64_t top_k, const int32_t* dest_rank,
                                     const int32_t* tag) {
  const int p = comm_.size(), me = comm_.rank();
  std::string error;
  if (m < 0 || d < 1 || top_k < 1) {
    std::ostringstream os;
    os << "MoE dispatch on rank " << me << ": need m >= 0, d >= 1, top_k >= 1; got m = " << m << ", d = " << d
       << ", top_k = " << top_k;
    error = os.str();
  } else if (m > 0 && (!x || !dest_rank || !tag)) {
    error = "MoE dispatch on rank " + std::to_string(me) + ": null x, dest_rank or tag with m = " + std::to_string(m);
  }
  const int64_t n_slots = error.empty() ? m * top_k : 0;
  send_slots_.assign(p, 0);
  send_toks_.assign(p, 0);
  std::vector<int64_t> last_tok(p, -1);
  for (int64_t s = 0; s < n_slots && error.empty(); ++s) {
    const int32_t r = dest_rank[s];
    if (r == -1) continue;
    if (r < 0 || r >= p) {
      std::ostringstream os;
      os << "MoE dispatch on rank " << me << ": dest_rank[" << s << "] (token " << s / top_k << ", j " << s % top_k
         << ") = " << r << ", expected -1 or a rank in [0, " << p << ")";
      error = os.str();
      break;
    }
    ++send_slots_[r];
    if (last_tok[r] != s / top_k) {
      last_tok[r] = s / top_k;
      ++send_toks_[r];
    }
  }
  if (error.empty() && m * top_k >= (int64_t(1) << 31)) {
    error = "MoE dispatch on rank " + std::to_string(me) + ": " + std::to_string(m * top_k) +
            " slots, more than the 2^31 - 1 that int32 slot indices can address";
  }
  if (!error.empty()) {
    send_slots_.assign(p, 0);
    send_toks_.assign(p, 0);
  }
  return error;
}

// 1. Counts (and d, and the error flag) to every rank; one rank needs no exchange. Throws when
//    any rank's arguments were bad. Fills recv_slots_; returns the distinct tokens from each rank.
std::vector<int64_t> MoeExchange::exchange_counts(int64_t d, const std::string& error) {
  const int p = comm_.size(), me = comm_.rank();
  recv_slots_.assign(p, 0);
  std::vector<int64_t> recv_toks(p, 0);
  if (p == 1) {
    if (!error.empty()) GLM5_FAIL(error);
    recv_slots_[0] = send_slots_[0];
    recv_toks[0] = send_toks_[0];
    return recv_toks;
  }
  hdr_send_.resize(p * kHeaderWords);
  hdr_recv_.resize(p * kHeaderWords);
  for (int r = 0; r < p; ++r) {
    const Header h{send_slots_[r], send_toks_[r], d, error.empty() ? 0 : 1};
    std::memcpy(&hdr_send_[r * kHeaderWords], &h, sizeof(h));
  }
  std::vector<int64_t> ones(p, 1);
  exchange(comm_, hdr_send_.data(), ones, sizeof(Header), hdr_recv_.data(), ones, true);
  if (!error.empty()) GLM5_FAIL(error);
  for (int r = 0; r < p; ++r) {
    Header h;
    std::memcpy(&h, &hdr_recv_[r * kHeaderWords], sizeof(h));
    CHECK(h.error == 0, "MoE dispatch: rank ", r,
          " of the stage passed invalid arguments (its own error names them); rank ", me, " stops too");
    CHECK(h.d == d, "MoE dispatch: rank ", r, " uses rows of width d = ", h.d, " but rank ", me, " uses d = ", d,
          " (d must be equal on all ranks)");
    recv_slots_[r] = h.slots;
    recv_toks[r] = h.toks;
  }
  return recv_toks;
}

// 2. Groups slots by destination (slot order within one) and gives each destination's distinct
//    tokens a row in its block (token order); a slot's entry is (that row, its tag).
void MoeExchange::group_sends(int64_t n_slots, int64_t top_k, const int32_t* dest_rank, const int32_t* tag) {
  const int p = comm_.size();
  send_first_.assign(p + 1, 0);
  send_tok_first_.assign(p + 1, 0);
  for (int r = 0; r < p; ++r) {
    send_first_[r + 1] = send_first_[r] + send_slots_[r];
    send_tok_first_[r + 1] = send_tok_first_[r] + send_toks_[r];
  }
  const int64_t n_send = send_first_[p];
  send_slot_.resize(n_send);
  send_entry_.resize(2 * n_send);
  send_tok_.resize(send_tok_first_[p]);
  std::vector<int64_t> pos(send_first_.begin(), send_first_.end() - 1);
  std::vector<int64_t> tpos(send_tok_first_.begin(), send_tok_first_.end() - 1);
  std::vector<int64_t> last_tok(p, -1);
  for (int64_t s = 0; s < n_slots; ++s) {
    const int32_t r = dest_rank[s];
    if (r < 0) continue;
    const int64_t t = s / top_k;
    if (last_tok[r] != t) {
      last_tok[r] = t;
      send_tok_[tpos[r]++] = int32_t(t);
    }
    const int64_t g = pos[r]++;
    send_slot_[g] = s;
    send_entry_[2 * g] = int32_t(tpos[r] - 1 - send_tok_first_[r]);
    send_entry_[2 * g + 1] = tag[s];
  }
}

// 5. Arrival order is source-major, slot order within a source; a stable sort by tag gives
//    (tag, source, slot): recv_tag_, recv_src_, recv_row_.
// 6. Where each of this rank's slots will find its result (slot_row_): its own slots in the
//    caller's rows, the others in the returns region (grouped by destination).
void MoeExchange::place_slots(const std::vector<int64_t>& recv_toks) {
  const int p = comm_.size(), me = comm_.rank();
  raw_tag_.resize(n_recv_);
  raw_row_.resize(n_recv_);
  for (int r = 0; r < p; ++r) {
    const int64_t k0 = recv_first_[r], n = recv_slots_[r];
    if (r == me) {
      const int32_t* e = send_entry_.data() + 2 * send_first_[me];
      const int32_t* toks = send_tok_.data() + send_tok_first_[me];
      for (int64_t k = 0; k < n; ++k) {
        raw_row_[k0 + k] = p == 1 ? toks[e[2 * k]] : int32_t(block_first_[me] + e[2 * k]);
        raw_tag_[k0 + k] = e[2 * k + 1];
      }
      continue;
    }
    int32_t e[2];
    // Host path: the entries follow the block's token rows in the table; device path: they
    // came over the host comm on their own.
    const char* entries = device_ ? reinterpret_cast<const char*>(recv_entry_.data() + 2 * k0)
                                  : reinterpret_cast<const char*>(table_ + (block_first_[r] + recv_toks[r]) * d_);
    for (int64_t k = 0; k < n; ++k) {
      std::memcpy(e, entries + size_t(k) * sizeof(e), sizeof(e));
      CHECK(e[0] >= 0 && e[0] < recv_toks[r], "MoE dispatch on rank ", me, ": slot entry ", k, " from rank ", r,
            " names token row ", e[0], " of ", recv_toks[r]);
      raw_row_[k0 + k] = int32_t(block_first_[r] + e[0]);
      raw_tag_[k0 + k] = e[1];
    }
  }
  order_.resize(n_recv_);
  std::iota(order_.begin(), order_.end(), int64_t(0));
  std::stable_sort(order_.begin(), order_.end(), [&](int64_t a, int64_t b) { return raw_tag_[a] < raw_tag_[b]; });
  recv_tag_.resize(n_recv_);
  recv_src_.resize(n_recv_);
  recv_row_.resize(n_recv_);
  std::vector<int64_t> sorted_pos(n_recv_);
  for (int64_t i = 0; i < n_recv_; ++i) {
    const int64_t k = order_[i];
    recv_tag_[i] = raw_tag_[k];
    recv_row_[i] = raw_row_[k];
    recv_src_[i] = int32_t(std::upper_bound(recv_first_.begin(), recv_first_.end(), k) - recv_first_.begin() - 1);
    sorted_pos[k] = i;
  }
  slot_row_.assign(m_ * top_k_, -1);
  for (int r = 0; r < p; ++r)
    for (int64_t g = send_first_[r]; g < send_first_[r + 1]; ++g)
      slot_row_[send_slot_[g]] = int32_t(r == me ? sorted_pos[recv_first_[me] + g - send_first_[me]] : n_recv_ + g);
}

// Table and result rows are addressed by int32 indices (recv_row, slot_row).
void MoeExchange::check_row_indices(int64_t table_rows) const {
  CHECK(table_rows < (int64_t(1) << 31) && n_recv_ + n_ret_ < (int64_t(1) << 31), "MoE dispatch on rank ", comm_.rank(),
        ": ", table_rows, " table rows and ", n_recv_ + n_ret_,
        " result rows, more than int32 row indices can address");
}

// Host payload: one block per peer holds its token rows, then its (row, tag) entries padded to
// whole rows; this rank's own tokens are copied into its own block of the table.
void MoeExchange::move_rows_host(const float* x, const std::vector<int64_t>& recv_toks) {
  const int p = comm_.size(), me = comm_.rank();
  const int64_t d = d_;
  send_block_rows_.assign(p, 0);
  recv_block_rows_.assign(p, 0);
  block_first_.assign(p, 0);
  int64_t rows = 0;
  for (int r = 0; r < p; ++r) {
    if (r != me) send_block_rows_[r] = send_toks_[r] + entry_rows(send_slots_[r], d);
    recv_block_rows_[r] = r == me ? recv_toks[r] : recv_toks[r] + entry_rows(recv_slots_[r], d);
    block_first_[r] = rows;
    rows += recv_block_rows_[r];
  }
  check_row_indices(rows);
  if (p == 1) {
    table_ = x;
    table_rows_ = m_;
    return;
  }
  const size_t row_bytes = size_t(d) * sizeof(float);
  int64_t send_total = 0;
  for (int r = 0; r < p; ++r) send_total += send_block_rows_[r];
  float* wire = send_wire_.reserve(size_t(std::max<int64_t>(send_total, 1) * d));
  float* table = recv_wire_.reserve(size_t(std::max<int64_t>(rows, 1) * d));
  int64_t off = 0;
  for (int r = 0; r < p; ++r) {
    if (r == me) continue;
    float* block = wire + off * d;
    const int32_t* toks = send_tok_.data() + send_tok_first_[r];
    const int64_t n_tok = send_toks_[r];
#pragma omp parallel for schedule(static) if (n_tok * d >= kParallelCopy)
    for (int64_t u = 0; u < n_tok; ++u) copy_rows(block + u * d, x + int64_t(toks[u]) * d, d);
    payload_bytes_sent_ += uint64_t(n_tok) * row_bytes;
    char* entries = reinterpret_cast<char*>(block + n_tok * d);
    const size_t entry_bytes = size_t(send_slots_[r]) * 2 * sizeof(int32_t);
    if (entry_bytes) std::memcpy(entries, send_entry_.data() + 2 * send_first_[r], entry_bytes);
    std::memset(entries + entry_bytes, 0, size_t(entry_rows(send_slots_[r], d)) * row_bytes - entry_bytes);
    off += send_block_rows_[r];
  }
  exchange(comm_, wire, send_block_rows_, row_bytes, table, recv_block_rows_);
  const int32_t* toks = send_tok_.data() + send_tok_first_[me];
  const int64_t n_tok = send_toks_[me];
  float* own = table + block_first_[me] * d;
#pragma omp parallel for schedule(static) if (n_tok * d >= kParallelCopy)
  for (int64_t u = 0; u < n_tok; ++u) copy_rows(own + u * d, x + int64_t(toks[u]) * d, d);
  table_ = table;
  table_rows_ = rows;
}

// Device payload, plan half: the table's layout (each source's distinct tokens, no entry rows)
// and the slot entries over the host comm.
void MoeExchange::exchange_entries(const float* x, const std::vector<int64_t>& recv_toks) {
  const int p = comm_.size(), me = comm_.rank();
  block_first_.assign(p, 0);
  recv_block_rows_.assign(p, 0);
  send_block_rows_.assign(p, 0);
  int64_t rows = 0;
  for (int r = 0; r < p; ++r) {
    recv_block_rows_[r] = recv_toks[r];
    if (r != me) send_block_rows_[r] = send_toks_[r];
    block_first_[r] = rows;
    rows += recv_toks[r];
  }
  check_row_indices(rows);
  table_rows_ = p == 1 ? m_ : rows;
  table_ = p == 1 ? x : nullptr;  // set by move_rows_device otherwise
  if (p == 1) return;
  recv_entry_.resize(size_t(2 * n_recv_));
  exchange(comm_, send_entry_.data(), send_slots_, 2 * sizeof(int32_t), recv_entry_.data(), recv_slots_);
}

// Device payload, payload half, once the plan is complete: every index array the backend's
// kernels read goes down in one transfer, [pack | own | recv_row | slot_row | back]: pack = the
// peers' tokens in destination order (the send wire), own = this rank's tokens (its block of the
// table), back = the result row of each arrival slot from another rank, in arrival order (the
// combine wire). Then the rows are gathered and moved over the payload comm.
void MoeExchange::move_rows_device(const float* x) {
  const int p = comm_.size(), me = comm_.rank();
  const int64_t d = d_;
  std::vector<int32_t>& h = dev_index_host_;
  h.clear();
  if (p > 1)
    for (int r = 0; r < p; ++r)
      if (r != me)
        h.insert(h.end(), send_tok_.begin() + send_tok_first_[r], send_tok_.begin() + send_tok_first_[r + 1]);
  n_pack_ = int64_t(h.size());
  if (p > 1) h.insert(h.end(), send_tok_.begin() + send_tok_first_[me], send_tok_.begin() + send_tok_first_[me + 1]);
  n_own_ = int64_t(h.size()) - n_pack_;
  h.insert(h.end(), recv_row_.begin(), recv_row_.end());
  h.insert(h.end(), slot_row_.begin(), slot_row_.end());
  n_back_ = 0;
  if (p > 1) {
    std::vector<int32_t>& pos = back_pos_;  // arrival slot -> its row in the results
    pos.assign(size_t(n_recv_), -1);
    for (int64_t i = 0; i < n_recv_; ++i) pos[size_t(order_[i])] = int32_t(i);
    for (int r = 0; r < p; ++r)
      if (r != me)
        for (int64_t k = recv_first_[r]; k < recv_first_[r + 1]; ++k, ++n_back_) h.push_back(pos[size_t(k)]);
  }
  // Every buffer is reserved before anything moves (a reserve() that grows drops its old block).
  int32_t* idx = static_cast<int32_t*>(dev_index_.reserve(h.size() * sizeof(int32_t)));
  dev_results_.reserve(size_t(std::max<int64_t>(n_recv_ + n_ret_, 1) * d) * sizeof(float));
  float* wire = nullptr;
  float* table = nullptr;
  if (p > 1) {
    // One wire for the rows out and, at combine, the results back (the first is consumed by the
    // time the second is gathered: both are ordered on the backend's stream).
    const int64_t wire_rows = std::max<int64_t>({n_pack_, n_back_, 1});
    wire = static_cast<float*>(dev_wire_.reserve(size_t(wire_rows * d) * sizeof(float)));
    table = static_cast<float*>(dev_table_.reserve(size_t(std::max<int64_t>(table_rows_, 1) * d) * sizeof(float)));
  }
  be_->to_device(idx, h.data(), h.size() * sizeof(int32_t));
  dev_pack_ = idx;
  dev_own_ = idx + n_pack_;
  dev_recv_row_ = dev_own_ + n_own_;
  dev_slot_row_ = dev_recv_row_ + n_recv_;
  dev_back_idx_ = dev_slot_row_ + m_ * top_k_;
  if (p == 1) return;  // table_ is x
  if (n_pack_) be_->gather_rows({x, dev_pack_, n_pack_, d, wire});
  if (n_own_) be_->gather_rows({x, dev_own_, n_own_, d, table + block_first_[me] * d});
  const uint64_t before = bytes_sent_;
  exchange(*payload_comm_, wire, send_block_rows_, size_t(d) * sizeof(float), table, recv_block_rows_);
  payload_bytes_sent_ += bytes_sent_ - before;
  table_ = table;
}

void MoeExchange::combine() {
  CHECK(dispatched_, "MoE combine on rank ", comm_.rank(), " without a successful dispatch before it");
  const int p = comm_.size(), me = comm_.rank();
  if (p == 1) return;  // every result is already where slot_row() points
  const int64_t d = d_;
  const size_t row_bytes = size_t(d) * sizeof(float);
  const uint64_t before = bytes_sent_;
  if (device_) {
    // Results for other ranks, gathered into arrival order without this rank's own source.
    back_rows_ = recv_slots_;
    back_rows_[me] = 0;
    std::vector<int64_t>& back_rows = back_rows_;
    float* back = dev_wire_.as<float>();
    float* res = dev_results_.as<float>();
    if (n_back_) be_->gather_rows({res, dev_back_idx_, n_back_, d, back});
    exchange(*payload_comm_, back, back_rows, row_bytes, res + n_recv_ * d, send_slots_);
  } else {
    // Results for other ranks go back to arrival order (each source's slots, in its slot order).
    float* back = back_.reserve(size_t(std::max<int64_t>(n_recv_, 1) * d));
    const float* res = results_.data();
#pragma omp parallel for schedule(static) if (n_recv_ * d >= kParallelCopy)
    for (int64_t i = 0; i < n_recv_; ++i)
      if (recv_src_[i] != me) copy_rows(back + order_[i] * d, res + i * d, d);
    exchange(comm_, back, recv_slots_, row_bytes, results_.data() + n_recv_ * d, send_slots_);
  }
  payload_bytes_sent_ += bytes_sent_ - before;
}

}  // namespace glm5::parallel
