// The communicator interface: point-to-point, collectives and sub-groups over bytes.
// Implementations: MPI on host memory (mpi_comm.cpp) and NCCL on device memory (nccl_comm.cpp).
// Nothing here knows about models; runtime/ decides what to send and when.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

namespace glm5::parallel {

// Every point-to-point message tag of the tree, in one place, so that no two kinds of message on
// one communicator can match each other's receives.
enum Tag : int {
  // runtime/engine/, between pipeline stages: a step's plan, hidden states forward, results back
  kTagStep = 11,
  kTagHidden = 12,
  kTagBack = 13,
  kTagResults = 14,
  // launcher/batch: what the ranks send rank 0 for the run report and the trace file
  kTagReport = 21,
  kTagTrace = 22,
};

enum class ReduceDType { F32, F64, I32, I64 };

// A send in flight (Comm::isend). The buffer it reads must stay valid and unchanged until done()
// returns true or wait() returns; destroying an unfinished one waits for it.
class PendingSend {
 public:
  virtual ~PendingSend() = default;
  virtual bool done() = 0;  // drives progress; true once the buffer may be reused
  virtual void wait() = 0;
};
enum class ReduceOp { Sum, Max, Min };

class Comm {
 public:
  virtual ~Comm() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;

  virtual void send(const void* buf, size_t bytes, int dst, int tag) = 0;
  virtual void recv(void* buf, size_t bytes, int src, int tag) = 0;
  // Starts a send and returns without waiting for the receiver: a rank that only ever blocks in
  // receives and collectives cannot join a cycle of ranks blocked in sends to each other (the
  // pipeline's sends are all isends). Messages between a pair keep their order. This default
  // sends with the blocking send() (communicators without nonblocking point-to-point).
  virtual std::unique_ptr<PendingSend> isend(const void* buf, size_t bytes, int dst, int tag);
  // Every rank sends send_bytes[r] bytes at send + send_offsets[r] to rank r and receives
  // recv_bytes[r] bytes from rank r at recv + recv_offsets[r]. Sizes must agree pairwise.
  virtual void all_to_all_v(const void* send, const size_t* send_bytes, const size_t* send_offsets, void* recv,
                            const size_t* recv_bytes, const size_t* recv_offsets) = 0;
  // recv holds size() blocks of `bytes`, block r from rank r.
  virtual void all_gather(const void* send, size_t bytes, void* recv) = 0;
  virtual void all_reduce(void* buf, size_t count, ReduceDType dtype, ReduceOp op) = 0;
  virtual void broadcast(void* buf, size_t bytes, int root) = 0;
  virtual void barrier() = 0;
  // Ranks with the same color form a new communicator, ordered by key (then by old rank).
  virtual std::unique_ptr<Comm> split(int color, int key) = 0;
  // Ends the whole job (all ranks of the world) after a fatal error on this rank; never returns.
  [[noreturn]] virtual void abort(int code) = 0;

  // How its bytes travel (the run report): "mpi", "self", "nccl", "mpi-staged" (device buffers
  // copied through host memory around MPI), "device-like" (the device-like test backend's NCCL).
  virtual const char* transport() const { return "mpi"; }
  // Buffers are device memory of the rank's backend (NCCL and its stand-ins), not host memory.
  virtual bool device_buffers() const { return false; }
  // Bytes copied between device and host memory to move this communicator's payloads (staging).
  virtual uint64_t staged_bytes() const { return 0; }
};

// Header-inline so that the CUDA plugin (which implements Comm) needs no symbol from this library.
inline std::unique_ptr<PendingSend> Comm::isend(const void* buf, size_t bytes, int dst, int tag) {
  struct Sent final : PendingSend {
    bool done() override { return true; }
    void wait() override {}
  };
  send(buf, bytes, dst, tag);
  return std::make_unique<Sent>();
}

// The world over MPI (MPI must be initialised; see MpiRuntime in mpi_comm.h).
std::unique_ptr<Comm> make_mpi_world();
// A one-rank communicator with no MPI at all (single-process runs and unit tests).
std::unique_ptr<Comm> make_self_comm();

}  // namespace glm5::parallel
