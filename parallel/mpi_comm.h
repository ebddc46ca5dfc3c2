// MPI on host memory: the MpiRuntime guard (init/finalize), the MPI_CHECK macro and MpiComm, the
// Comm of parallel/comm.h over an MPI communicator. make_self_comm() (declared in comm.h) is the
// one-rank communicator that makes no MPI call. Device buffers are not handled here (Open MPI on
// Debian is not CUDA-aware): the GPU path uses the NCCL communicator.
#pragma once

#include <mpi.h>

#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "kernels/core/check.h"
#include "parallel/comm.h"

namespace glm5::parallel {

// "MPI_ERR_RANK: invalid rank" for an MPI error code.
std::string mpi_error_string(int code);
// Rank in MPI_COMM_WORLD, or -1 outside MPI_Init..MPI_Finalize (error messages name the rank).
int mpi_world_rank();

// Wraps an MPI call: a return code other than MPI_SUCCESS throws glm5::Error naming the call, the
// world rank and MPI's error string. Needs MPI_ERRORS_RETURN, which MpiRuntime sets on the world
// (communicators split from it inherit it); with MPI's default handler errors abort the job.
#define MPI_CHECK(call)                                                                                             \
  do {                                                                                                              \
    int glm5_mpi_rc_ = (call);                                                                                      \
    if (glm5_mpi_rc_ != MPI_SUCCESS)                                                                                \
      ::glm5::detail::fail(__FILE__, __LINE__, #call, " failed on rank ", ::glm5::parallel::mpi_world_rank(), ": ", \
                           ::glm5::parallel::mpi_error_string(glm5_mpi_rc_));                                       \
  } while (0)

// Owns MPI for the life of the process: initialises it (MPI_THREAD_FUNNELED: OpenMP threads
// compute, only the main thread talks to MPI) unless it is already initialised, sets
// MPI_ERRORS_RETURN on MPI_COMM_WORLD, and finalises at destruction if it initialised.
// Communicators from make_mpi_world()/split() should be destroyed before it.
class MpiRuntime {
 public:
  explicit MpiRuntime(int* argc = nullptr, char*** argv = nullptr);
  ~MpiRuntime();
  MpiRuntime(const MpiRuntime&) = delete;
  MpiRuntime& operator=(const MpiRuntime&) = delete;

  int world_rank() const;
  int world_size() const;

 private:
  bool owns_ = false;
};

// Comm over an MPI communicator, all transfers as MPI_BYTE on host memory.
// - Messages larger than mpi_message_limit() (INT_MAX by default: MPI counts are int) go in
//   chunks; both sides chunk the same way since sizes agree by contract.
// - all_to_all_v is one MPI_Ialltoallw per call: blocks within the limit go as MPI_BYTE, larger
//   ones (or ones at larger offsets) as derived types with 64-bit displacements. Every rank takes
//   the same path whatever its sizes, so no agreement step is needed.
// - send, recv and all_to_all_v post nonblocking calls and poll MPI_Test with sleeps growing from
//   2 us to 1 ms, so a rank that waits (e.g. for the pipeline) does not keep a core busy.
// - all_reduce of F32/F64 Sum is MPI's reduction order: not layout-invariant, so not for
//   activations that must be bitwise reproducible across layouts.
class MpiComm final : public Comm {
 public:
  // Frees `comm` at destruction when `owned` (communicators made by split()), unless MPI has
  // already been finalised.
  MpiComm(MPI_Comm comm, bool owned);
  ~MpiComm() override;
  MpiComm(const MpiComm&) = delete;
  MpiComm& operator=(const MpiComm&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  // tag: 0..MPI_TAG_UB (at least 32767).
  void send(const void* buf, size_t bytes, int dst, int tag) override;
  void recv(void* buf, size_t bytes, int src, int tag) override;
  std::unique_ptr<PendingSend> isend(const void* buf, size_t bytes, int dst, int tag) override;
  void all_to_all_v(const void* send, const size_t* send_bytes, const size_t* send_offsets, void* recv,
                    const size_t* recv_bytes, const size_t* recv_offsets) override;
  void all_gather(const void* send, size_t bytes, void* recv) override;
  void all_reduce(void* buf, size_t count, ReduceDType dtype, ReduceOp op) override;
  void broadcast(void* buf, size_t bytes, int root) override;
  void barrier() override;
  // color >= 0 (MPI_UNDEFINED is not offered: every rank gets a communicator).
  std::unique_ptr<Comm> split(int color, int key) override;
  // MPI_Abort on MPI_COMM_WORLD: takes down every rank, not only this communicator.
  [[noreturn]] void abort(int code) override;

  MPI_Comm native() const { return comm_; }

 private:
  void check_peer(int peer, const char* what) const;
  void check_tag(int tag, const char* what) const;

  MPI_Comm comm_ = MPI_COMM_NULL;
  bool owned_ = false;
  int rank_ = 0, size_ = 1;
  int tag_ub_ = 32767;
  std::vector<int> counts_, displs_, rcounts_, rdispls_;  // MPI_Alltoallw scratch
  std::vector<MPI_Datatype> stypes_, rtypes_;
};

// The watchdog: a wait on another rank (receive, collective, send completion) that sees no
// progress for this many seconds prints what this rank waits for (operation, peer, tag, bytes,
// plus its sends still in flight) on stderr, keeps waiting a grace period (a tenth of the limit,
// at least 1 s, at most 30 s) so that the other stuck ranks print theirs too, then aborts the
// job with MPI_Abort (exit code 3). 0 turns it off. Default 300; set from the cluster config's
// `watchdog_s`. Must be equal on all ranks.
void set_watchdog_seconds(double seconds);
double watchdog_seconds();

// Largest number of bytes handed to MPI in one call (1..INT_MAX, default INT_MAX). Tests lower it
// to exercise the chunked and point-to-point paths with small buffers. Must be equal on all ranks.
void set_mpi_message_limit(size_t bytes);
size_t mpi_message_limit();

}  // namespace glm5::parallel
