#pragma once

#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <vector>

#include "kernels/ops.h"
#include "parallel/comm.h"

namespace glm5::runtime {

// Messages in flight: each owns its bytes until the send completes. Sizes and payloads go as two
// messages (the receiver allocates from the size).
class Outbox {
 public:
  void send_bytes(parallel::Comm& c, int dst, int tag, std::vector<char> b) {
    auto m = std::make_unique<Msg>();
    m->size = int64_t(b.size());
    m->bytes = std::move(b);
    m->sends.push_back(c.isend(&m->size, sizeof m->size, dst, tag));
    if (m->size) m->sends.push_back(c.isend(m->bytes.data(), m->bytes.size(), dst, tag));
    push(std::move(m));
  }
  // n floats at h, in the backend's memory (no size message: the step before it gives the row
  // count), over the hidden-state communicator; h is freed once the send is complete.
  void send_hidden(parallel::Comm& c, kernels::Backend& be, float* h, int64_t n, int dst) {
    if (n == 0) return be.free(h);
    auto m = std::make_unique<Msg>();
    m->release = [&be, h] { be.free(h); };
    m->sends.push_back(c.isend(h, size_t(n) * sizeof(float), dst, parallel::kTagHidden));
    push(std::move(m));
  }
  // Waits for every send (end of the run). Not while unwinding to the job's abort: waiting could
  // hang on a peer that waits for us, and MPI may still read the buffers, so the messages are
  // leaked whole.
  void drain() {
    if (std::uncaught_exceptions() > 0) {
      for (auto& m : q_) m.release();
      q_.clear();
      return;
    }
    for (auto& m : q_)
      for (auto& s : m->sends) s->wait();
    reap();
  }
  ~Outbox() { drain(); }

 private:
  struct Msg {
    int64_t size = 0;
    std::vector<char> bytes;
    std::function<void()> release;
    std::vector<std::unique_ptr<parallel::PendingSend>> sends;
    bool done() {
      for (auto& s : sends)
        if (!s->done()) return false;
      return true;
    }
    ~Msg() {  // only for completed messages, or at the end of a run (see drain)
      for (auto& s : sends) s->wait();
      if (release) release();
    }
  };
  void push(std::unique_ptr<Msg> m) {
    q_.push_back(std::move(m));
    reap();
  }
  void reap() {  // completed messages, oldest first
    while (!q_.empty() && q_.front()->done()) q_.pop_front();
  }
  std::deque<std::unique_ptr<Msg>> q_;
};

}  // namespace glm5::runtime
