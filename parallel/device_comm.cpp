// StagedComm and DeviceLikeComm (device_comm.h).
#include "parallel/device_comm.h"

#include <cstdlib>
#include <vector>

#include "kernels/core/check.h"
#include "kernels/cpu/device_like.h"

namespace glm5::parallel {

namespace {

// A host Comm plus, for communicators made by split(), ownership of it.
class WrappedComm : public Comm {
 public:
  WrappedComm(Comm& host, std::unique_ptr<Comm> owned) : owned_(std::move(owned)), host_(host) {}
  int rank() const override { return host_.rank(); }
  int size() const override { return host_.size(); }
  void barrier() override { host_.barrier(); }
  [[noreturn]] void abort(int code) override {
    host_.abort(code);
    std::abort();  // not reached: host_.abort does not return
  }
  bool device_buffers() const override { return true; }

 protected:
  std::unique_ptr<Comm> owned_;
  Comm& host_;
};

// Every call copies device bytes to a host buffer, runs the host call, copies results back.
class StagedComm final : public WrappedComm {
 public:
  StagedComm(Comm& host, kernels::Backend& be, std::unique_ptr<Comm> owned = nullptr)
      : WrappedComm(host, std::move(owned)), be_(be) {}
  const char* transport() const override { return "mpi-staged"; }
  uint64_t staged_bytes() const override { return staged_; }

  void send(const void* buf, size_t bytes, int dst, int tag) override {
    host_.send(down(buf, bytes, a_), bytes, dst, tag);
  }
  void recv(void* buf, size_t bytes, int src, int tag) override {
    a_.resize(bytes);
    host_.recv(a_.data(), bytes, src, tag);
    up(buf, a_.data(), bytes);
  }
  // The host copy travels with the pending send, so the device buffer is free at once.
  std::unique_ptr<PendingSend> isend(const void* buf, size_t bytes, int dst, int tag) override {
    struct Staged final : PendingSend {
      std::vector<char> bytes;
      std::unique_ptr<PendingSend> inner;
      bool done() override { return inner->done(); }
      void wait() override { inner->wait(); }
    };
    auto s = std::make_unique<Staged>();
    down(buf, bytes, s->bytes);
    s->inner = host_.isend(s->bytes.data(), bytes, dst, tag);
    return s;
  }
  void all_to_all_v(const void* send, const size_t* send_bytes, const size_t* send_offsets, void* recv,
                    const size_t* recv_bytes, const size_t* recv_offsets) override {
    const int p = size();
    // Only the blocks named are copied: the rest of the buffers may be unused gaps.
    std::vector<size_t> so(static_cast<size_t>(p)), ro(static_cast<size_t>(p));
    size_t s_total = 0, r_total = 0;
    for (int r = 0; r < p; ++r) {
      so[size_t(r)] = s_total;
      s_total += send_bytes[r];
      ro[size_t(r)] = r_total;
      r_total += recv_bytes[r];
    }
    a_.resize(s_total);
    b_.resize(r_total);
    for (int r = 0; r < p; ++r)
      if (send_bytes[r])
        copy_down(a_.data() + so[size_t(r)], static_cast<const char*>(send) + send_offsets[r], send_bytes[r]);
    host_.all_to_all_v(a_.data(), send_bytes, so.data(), b_.data(), recv_bytes, ro.data());
    for (int r = 0; r < p; ++r)
      if (recv_bytes[r]) up(static_cast<char*>(recv) + recv_offsets[r], b_.data() + ro[size_t(r)], recv_bytes[r]);
  }
  void all_gather(const void* send, size_t bytes, void* recv) override {
    const size_t total = bytes * size_t(size());
    b_.resize(total);
    host_.all_gather(down(send, bytes, a_), bytes, b_.data());
    up(recv, b_.data(), total);
  }
  void all_reduce(void* buf, size_t count, ReduceDType dtype, ReduceOp op) override {
    const size_t es = dtype == ReduceDType::F32 || dtype == ReduceDType::I32 ? 4 : 8;
    host_.all_reduce(down(buf, count * es, a_), count, dtype, op);
    up(buf, a_.data(), count * es);
  }
  void broadcast(void* buf, size_t bytes, int root) override {
    a_.resize(bytes);
    if (rank() == root) copy_down(a_.data(), buf, bytes);
    host_.broadcast(a_.data(), bytes, root);
    if (rank() != root) up(buf, a_.data(), bytes);
  }
  std::unique_ptr<Comm> split(int color, int key) override {
    auto h = host_.split(color, key);
    Comm& ref = *h;
    return std::make_unique<StagedComm>(ref, be_, std::move(h));
  }

 private:
  char* down(const void* dev, size_t bytes, std::vector<char>& host) {
    host.resize(bytes);
    copy_down(host.data(), dev, bytes);
    return host.data();
  }
  void copy_down(void* host, const void* dev, size_t bytes) {
    if (!bytes) return;
    be_.to_host(host, dev, bytes);
    staged_ += bytes;
  }
  void up(void* dev, const void* host, size_t bytes) {
    if (!bytes) return;
    be_.to_device(dev, host, bytes);
    staged_ += bytes;
  }

  kernels::Backend& be_;
  std::vector<char> a_, b_;
  uint64_t staged_ = 0;
};

// The host communicator's calls on the host addresses behind device-like pointers (what NCCL
// does with device memory: reads and writes it in place, no staging).
class DeviceLikeComm final : public WrappedComm {
 public:
  using WrappedComm::WrappedComm;
  const char* transport() const override { return "device-like"; }
  void send(const void* buf, size_t bytes, int dst, int tag) override { host_.send(h(buf), bytes, dst, tag); }
  void recv(void* buf, size_t bytes, int src, int tag) override { host_.recv(h(buf), bytes, src, tag); }
  std::unique_ptr<PendingSend> isend(const void* buf, size_t bytes, int dst, int tag) override {
    return host_.isend(h(buf), bytes, dst, tag);
  }
  void all_to_all_v(const void* send, const size_t* send_bytes, const size_t* send_offsets, void* recv,
                    const size_t* recv_bytes, const size_t* recv_offsets) override {
    host_.all_to_all_v(h(send), send_bytes, send_offsets, h(recv), recv_bytes, recv_offsets);
  }
  void all_gather(const void* send, size_t bytes, void* recv) override { host_.all_gather(h(send), bytes, h(recv)); }
  void all_reduce(void* buf, size_t count, ReduceDType dtype, ReduceOp op) override {
    host_.all_reduce(h(buf), count, dtype, op);
  }
  void broadcast(void* buf, size_t bytes, int root) override { host_.broadcast(h(buf), bytes, root); }
  std::unique_ptr<Comm> split(int color, int key) override {
    auto c = host_.split(color, key);
    Comm& ref = *c;
    return std::make_unique<DeviceLikeComm>(ref, std::move(c));
  }

 private:
  template <class T>
  static T* h(T* p) {
    return kernels::device_like_host_address(p);
  }
};

}  // namespace

std::unique_ptr<Comm> make_staged_comm(Comm& host, kernels::Backend& backend) {
  CHECK(!backend.host_memory(), "make_staged_comm: backend ", backend.name(),
        " has host memory; use the host communicator itself");
  return std::make_unique<StagedComm>(host, backend);
}

std::unique_ptr<Comm> make_device_like_comm(Comm& host) { return std::make_unique<DeviceLikeComm>(host, nullptr); }

}  // namespace glm5::parallel
