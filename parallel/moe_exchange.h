// MoE dispatch/combine over Comm::all_to_all_v, in rows and ranks only: no experts, no weights.
// dispatch() sends each (token, j) slot's row to a destination rank; the receiver sees rows ordered
// by (tag, source rank, source slot), an order that does not depend on how many ranks there are,
// so expert outputs and their sums are bitwise layout-invariant. combine() returns each result to
// the slot it came from. Host memory only (f32 rows); weighting and summing over j is the caller's.
#pragma once

#include <cstdint>
#include <vector>

#include "parallel/comm.h"

namespace glm5::parallel {

class MoeExchange {
 public:
  // stage_comm: the ranks that own the experts (one stage's columns); it must outlive this object.
  explicit MoeExchange(Comm& stage_comm);

  // Collective over stage_comm: every rank calls it, with m = 0 when it has no tokens.
  //   x         [m, d] f32, one row per token (d must be equal on all ranks)
  //   dest_rank [m * top_k]: rank (in stage_comm) that gets slot t*top_k + j, or -1 = not sent
  //   tag       [m * top_k]: ordering key at the receiver, e.g. the local expert id
  // A slot's row is sent once per slot (a token going twice to one rank travels twice).
  // Exchanges per-destination row counts first (one all_to_all_v), then rows with their tags (one
  // all_to_all_v); on a one-rank comm it makes no call. Bad arguments on any rank make every rank
  // throw, none hangs.
  void dispatch(const float* x, int64_t m, int64_t d, int64_t top_k, const int32_t* dest_rank,
                const int32_t* tag);

  // The rows this rank received, ordered by (tag ascending, source rank ascending, source slot).
  int64_t recv_count() const { return int64_t(recv_tag_.size()); }
  const float* recv_x() const { return recv_x_.data(); }        // [recv_count, d]
  const int32_t* recv_tag() const { return recv_tag_.data(); }  // [recv_count]
  const int32_t* recv_src() const { return recv_src_.data(); }  // [recv_count] source rank

  // Collective: y [recv_count, d] holds the result for each received row, in recv order. Sends
  // them back; out() is then [m * top_k, d] with row t*top_k + j the result for that slot, zero
  // for slots whose dest_rank was -1. May be called again after the same dispatch.
  void combine(const float* y);
  const float* out() const { return out_.data(); }

  int64_t d() const { return d_; }
  int64_t m() const { return m_; }
  int64_t top_k() const { return top_k_; }
  // Cumulative bytes this rank handed to other ranks (count headers, rows, tags and results);
  // rows kept on this rank are not counted.
  uint64_t bytes_sent() const { return bytes_sent_; }

 private:
  void exchange(const void* send, const std::vector<int64_t>& send_rows, size_t row_bytes,
                void* recv, const std::vector<int64_t>& recv_rows);

  Comm& comm_;
  bool dispatched_ = false;
  int64_t m_ = 0, d_ = 0, top_k_ = 0;
  uint64_t bytes_sent_ = 0;

  // Send side: slots grouped by destination rank, in slot order within a destination.
  std::vector<int64_t> send_rows_;    // [P] rows to each rank
  std::vector<int64_t> send_first_;   // [P + 1] first grouped row of each destination
  std::vector<int64_t> send_slot_;    // [n_send] slot index of each grouped row
  std::vector<int64_t> unsent_slot_;  // slots with dest_rank -1 (zero in out())
  // Wire blocks, one per peer rank: [rows, d] f32 then [rows] int32 tags. The block for this rank
  // itself is never packed: its rows are read from x and its results written to out_ directly.
  std::vector<char> send_wire_, recv_wire_;
  // Receive side, as it arrives (source-major, slot order within a source) ...
  std::vector<int64_t> recv_rows_;   // [P] rows from each rank
  std::vector<int64_t> recv_first_;  // [P + 1] first arrival row of each source
  std::vector<int32_t> raw_tag_, raw_src_;  // [n_recv]
  // ... and in (tag, source, slot) order: recv row i is arrival row order_[i].
  std::vector<int64_t> order_;
  std::vector<float> recv_x_;
  std::vector<int32_t> recv_tag_, recv_src_;
  // Combine.
  std::vector<float> back_;  // [n_recv, d] results in arrival order (own block unused)
  std::vector<float> ret_;   // [n_send, d] results in grouped order (own block unused)
  std::vector<float> out_;   // [m * top_k, d]
  // all_to_all_v scratch.
  std::vector<int64_t> hdr_send_, hdr_recv_;
  std::vector<size_t> sb_, so_, rb_, ro_;
  bool self_through_comm_ = false;  // exchange(): include this rank's own block (headers only)
};

}  // namespace glm5::parallel
