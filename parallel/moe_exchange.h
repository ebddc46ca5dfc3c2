// MoE dispatch/combine over Comm::all_to_all_v, in rows and ranks only: no experts, no weights.
// dispatch() sends each token's row once to every rank that owns one of its chosen experts,
// with a (row, tag) entry per slot; the receiver sees slots ordered by (tag, source rank, source
// slot), an order that does not depend on how many ranks there are, so expert outputs and their
// sums are bitwise layout-invariant. combine() returns each slot's result to its source.
// Nothing is copied into expert order here: slots point at rows by index (the caller gathers
// them for its GEMMs, as a fused-MoE kernel would) and the caller's weighted sum reads the
// results by index. Weighting and summing over slots is the caller's.
//
// Plan and payload: the plan (per-destination counts, each slot's (row, tag) entry, the receive
// order, where results land) is built on the host from the expert choices and travels as small
// messages over the stage's host communicator. The payload (token rows out, results back) is
// either host memory moved with the plan (host backends: one message per peer carries a block's
// rows and entries) or, for a device backend, device memory packed and unpacked by the backend's
// gather_rows and moved by a device communicator (NCCL, or staging through the host); then no
// payload byte passes through this class's host memory.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <memory>
#include <new>
#include <string>
#include <vector>

#include "kernels/ops.h"
#include "parallel/comm.h"

namespace glm5::parallel {

// A growable host buffer that is never initialised: pages are touched only where written.
template <class T>
class Scratch {
 public:
  T* reserve(size_t n) {
    if (n > cap_) {
      p_.reset(static_cast<T*>(std::malloc(n * sizeof(T))));
      if (!p_) throw std::bad_alloc();
      cap_ = n;
    }
    return p_.get();
  }
  T* data() const { return p_.get(); }

 private:
  struct Free {
    void operator()(T* p) const { std::free(p); }
  };
  std::unique_ptr<T, Free> p_;
  size_t cap_ = 0;
};

class MoeExchange {
 public:
  // stage_comm: the ranks that own the experts (one stage's columns); it must outlive this object.
  explicit MoeExchange(Comm& stage_comm);
  // Payload in `backend`'s memory (host_memory() false), moved over `payload_comm` (the same ranks
  // as stage_comm, in the same order, device_buffers() true). Both must outlive this object.
  MoeExchange(Comm& stage_comm, kernels::Backend& backend, Comm& payload_comm);
  ~MoeExchange();

  // Collective over stage_comm: every rank calls it, with m = 0 when it has no tokens.
  //   x         [m, d] f32 in payload memory, one row per token (d equal on all ranks); on a one-rank comm
  //             recv_table() is x itself, so x must then stay valid while the table is read
  //   dest_rank [m * top_k]: rank (in stage_comm) that gets slot t*top_k + j, or -1 = not sent
  //   tag       [m * top_k]: ordering key at the receiver, e.g. the local expert id
  // Exchanges per-destination counts first (one all_to_all_v), then each destination's rows with
  // one (row, tag) entry per slot (one all_to_all_v on the host path; entries then rows, two, on
  // the device path); on a one-rank comm it makes no call. Bad arguments on any rank make every
  // rank throw, none hangs.
  void dispatch(const float* x, int64_t m, int64_t d, int64_t top_k, const int32_t* dest_rank, const int32_t* tag);

  // The slots this rank received, ordered by (tag ascending, source rank ascending, source slot).
  int64_t recv_count() const { return n_recv_; }
  const int32_t* recv_tag() const { return recv_tag_.data(); }  // [recv_count]
  const int32_t* recv_src() const { return recv_src_.data(); }  // [recv_count] source rank
  // Slot i's row is recv_table() + recv_row()[i] * d: each token arrives once per source however
  // many of its slots came (the table also holds this rank's own tokens for its local slots).
  // The table, results() and result_rows() are payload memory; recv_row() and slot_row() are
  // host arrays, and *_payload() the same arrays in payload memory (for the backend's kernels).
  const float* recv_table() const { return table_; }  // [recv_table_rows, d]
  int64_t recv_table_rows() const { return table_rows_; }
  const int32_t* recv_row() const { return recv_row_.data(); }  // [recv_count]
  const int32_t* recv_row_payload() const { return device_ ? dev_recv_row_ : recv_row_.data(); }
  const float* recv_row_data(int64_t i) const { return table_ + int64_t(recv_row_[i]) * d_; }

  // After dispatch: [recv_count, d] rows where the caller writes the result for slot i; then
  // combine() (collective) sends them back. May be called again after the same dispatch.
  float* results() { return device_ ? dev_results_.as<float>() : results_.data(); }
  void combine();
  // After combine: the result for the caller's slot s = t*top_k + j is row slot_row()[s] of
  // result_rows(), or -1 when its dest_rank was -1 (the layout of ops.h's MoeCombineParams).
  const float* result_rows() const { return device_ ? dev_results_.as<float>() : results_.data(); }
  int64_t result_row_count() const { return n_recv_ + n_ret_; }
  const int32_t* slot_row() const { return slot_row_.data(); }  // [m * top_k]
  const int32_t* slot_row_payload() const { return device_ ? dev_slot_row_ : slot_row_.data(); }

  int64_t d() const { return d_; }
  int64_t m() const { return m_; }
  int64_t top_k() const { return top_k_; }
  // Cumulative bytes this rank handed to other ranks (count headers, rows, slot entries and
  // results); rows kept on this rank are not counted. payload_bytes_sent(): rows and results only.
  uint64_t bytes_sent() const { return bytes_sent_; }
  uint64_t payload_bytes_sent() const { return payload_bytes_sent_; }

 private:
  // Grow-only scratch in the backend's memory.
  struct DeviceScratch {
    kernels::Backend* be = nullptr;
    void* p = nullptr;
    size_t cap = 0;
    void* reserve(size_t bytes);
    template <class T>
    T* as() const {
      return static_cast<T*>(p);
    }
    ~DeviceScratch();
  };
  void exchange(Comm& comm, const void* send, const std::vector<int64_t>& send_rows, size_t row_bytes, void* recv,
                const std::vector<int64_t>& recv_rows, bool include_self = false);
  std::string count_sends(const float* x, int64_t m, int64_t d, int64_t top_k, const int32_t* dest_rank,
                          const int32_t* tag);
  std::vector<int64_t> exchange_counts(int64_t d, const std::string& error);
  void group_sends(int64_t n_slots, int64_t top_k, const int32_t* dest_rank, const int32_t* tag);
  void place_slots(const std::vector<int64_t>& recv_toks);
  void move_rows_host(const float* x, const std::vector<int64_t>& recv_toks);
  void exchange_entries(const float* x, const std::vector<int64_t>& recv_toks);
  void check_row_indices(int64_t table_rows) const;
  void move_rows_device(const float* x);

  Comm& comm_;
  Comm* payload_comm_ = nullptr;
  kernels::Backend* be_ = nullptr;
  bool device_ = false;
  bool dispatched_ = false;
  int64_t m_ = 0, d_ = 0, top_k_ = 0;
  uint64_t bytes_sent_ = 0;

  // Send side. Slots grouped by destination rank, in slot order within a destination ...
  std::vector<int64_t> send_slots_;  // [P] slots to each rank
  std::vector<int64_t> send_first_;  // [P + 1] first grouped slot of each destination
  std::vector<int64_t> send_slot_;   // [n_send] slot index of each grouped slot
  // ... and each destination's distinct tokens, in token order.
  std::vector<int64_t> send_toks_;       // [P] distinct tokens to each rank
  std::vector<int64_t> send_tok_first_;  // [P + 1]
  std::vector<int32_t> send_tok_;        // token index of each grouped token row
  std::vector<int32_t> send_entry_;      // [n_send] (token row within its block, tag) pairs x2
  // Wire blocks, one per peer rank, in whole rows of d floats: the block's token rows, then its
  // (row, tag) int32 pairs padded to whole rows. The block for this rank is never sent.
  std::vector<int64_t> send_block_rows_, recv_block_rows_;  // [P]
  Scratch<float> send_wire_;
  // Receive side: the table is the received wire blocks in source order, with this rank's own
  // tokens copied into its own block; slots arrive source-major, slot order within a source.
  Scratch<float> recv_wire_;
  const float* table_ = nullptr;
  int64_t table_rows_ = 0;
  std::vector<int64_t> recv_slots_;         // [P] slots from each rank
  std::vector<int64_t> recv_first_;         // [P + 1] first arrival slot of each source
  std::vector<int64_t> block_first_;        // [P] first table row of each source's block
  std::vector<int32_t> raw_tag_, raw_row_;  // [n_recv] in arrival order
  std::vector<int64_t> order_;              // recv slot i is arrival slot order_[i]
  int64_t n_recv_ = 0, n_ret_ = 0;          // n_ret_: rows of the returns region
  std::vector<int32_t> recv_tag_, recv_src_, recv_row_;
  // Combine: results_ = [n_recv rows written by the caller | n_send rows coming back, grouped by
  // destination (this rank's own block unused)]; back_ = results for other ranks in arrival order.
  Scratch<float> results_, back_;
  std::vector<int32_t> slot_row_;
  uint64_t payload_bytes_sent_ = 0;
  // Device payload: slot entries arrive over the host comm; once the plan is complete, token rows
  // are packed from x by index and results go back by index (see move_rows_device).
  std::vector<int32_t> recv_entry_;  // [n_recv * 2] (row, tag) per arrival slot
  std::vector<int32_t> dev_index_host_, back_pos_;
  std::vector<int64_t> back_rows_;
  int64_t n_pack_ = 0, n_own_ = 0, n_back_ = 0;
  DeviceScratch dev_index_, dev_wire_, dev_table_, dev_results_;
  const int32_t *dev_pack_ = nullptr, *dev_own_ = nullptr, *dev_recv_row_ = nullptr, *dev_slot_row_ = nullptr,
                *dev_back_idx_ = nullptr;
  // all_to_all_v scratch.
  std::vector<int64_t> hdr_send_, hdr_recv_;
  std::vector<size_t> sb_, so_, rb_, ro_;
};

}  // namespace glm5::parallel
