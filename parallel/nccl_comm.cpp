// NcclComm: Comm on device buffers through NCCL (make_nccl_comm in nccl_comm.h). NCCL runs on the
// communicator's own stream, in one of two orderings:
// - Blocking (no work stream given): a call first waits for all work already queued on the device
//   (any stream), then polls its stream to completion while watching NCCL's async error state, so
//   a failed peer ends in an exception rather than a silent hang. Every call is complete on return.
// - Stream-ordered (a work stream given, the backend's): a call makes its stream wait for the work
//   queued so far (an event), enqueues NCCL, and makes the work stream wait for it (another
//   event); nothing blocks the host, so the host can queue the next layer meanwhile. isend returns
//   a PendingSend that queries an event, and the work stream does not wait for sends (the sender
//   frees its buffer only once done()). Async errors are checked at every call's start; a peer
//   that is gone for good is left to mpirun, which ends the whole job when a rank dies.
// Compiled into the CUDA plugin (kernels/cuda_plugin.h); parallel/nccl_loader.cpp calls it.
#include <cuda_runtime.h>
#include <mpi.h>
#include <nccl.h>

#include <cstdlib>
#include <exception>
#include <map>
#include <mutex>
#include <string>
#include <thread>

#include "kernels/core/check.h"
#include "parallel/comm.h"

namespace glm5::parallel {
namespace {

// The world rank for messages (-1 outside MPI); the plugin has its own copy of this helper.
int world_rank() {
  int init = 0, fin = 0, r = -1;
  MPI_Initialized(&init);
  MPI_Finalized(&fin);
  if (init && !fin) MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}

// NCCL_CHECK / CUDA_CHECK: throw glm5::Error naming the call, the world rank and the library's
// message (ncclGetLastError carries NCCL's detailed reason, e.g. "Duplicate GPU detected").
#define NCCL_CHECK(call)                                                                                          \
  do {                                                                                                            \
    const ncclResult_t glm5_nccl_rc_ = (call);                                                                    \
    if (glm5_nccl_rc_ != ncclSuccess)                                                                             \
      GLM5_FAIL("nccl: ", #call, " failed on rank ", world_rank(), ": ", ncclGetErrorString(glm5_nccl_rc_), " (", \
                ncclGetLastError(nullptr), ")");                                                                  \
  } while (0)

#define CUDA_CHECK(call)                                                                                        \
  do {                                                                                                          \
    const cudaError_t glm5_cuda_rc_ = (call);                                                                   \
    if (glm5_cuda_rc_ != cudaSuccess)                                                                           \
      GLM5_FAIL("cuda: ", #call, " failed on rank ", world_rank(), ": ", cudaGetErrorName(glm5_cuda_rc_), " (", \
                cudaGetErrorString(glm5_cuda_rc_), ")");                                                        \
  } while (0)

ncclDataType_t nccl_type(ReduceDType t) {
  switch (t) {
    case ReduceDType::F32: return ncclFloat32;
    case ReduceDType::F64: return ncclFloat64;
    case ReduceDType::I32: return ncclInt32;
    case ReduceDType::I64: return ncclInt64;
  }
  GLM5_FAIL("nccl all_reduce: unknown dtype ", int(t));
}

ncclRedOp_t nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum: return ncclSum;
    case ReduceOp::Max: return ncclMax;
    case ReduceOp::Min: return ncclMin;
  }
  GLM5_FAIL("nccl all_reduce: unknown op ", int(op));
}

// The stream every stream-ordered NCCL communicator of a device enqueues on: their operations then
// run in the order the host issued them, as in the blocking mode, instead of as kernels of
// several communicators running concurrently, which NCCL documents as a deadlock risk (one
// communicator's kernel can wait for a peer that is itself stuck behind another communicator's).
// The engine issues them in tick order on every rank, which is what makes that order safe.
cudaStream_t shared_comm_stream(int device) {
  static std::mutex mu;
  static std::map<int, cudaStream_t> streams;
  std::lock_guard<std::mutex> lock(mu);
  cudaStream_t& s = streams[device];
  if (!s) CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  return s;
}

class NcclComm final : public Comm {
 public:
  NcclComm(ncclComm_t comm, int device, Comm* host, cudaStream_t work)
      : comm_(comm), device_(device), host_(host), work_(work) {
    NCCL_CHECK(ncclCommUserRank(comm_, &rank_));
    NCCL_CHECK(ncclCommCount(comm_, &size_));
    CUDA_CHECK(cudaSetDevice(device_));
    if (work_)
      stream_ = shared_comm_stream(device_);  // one NCCL stream for every stream-ordered comm
    else
      CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    CUDA_CHECK(cudaMalloc(&token_, sizeof(int)));
    if (work_) {
      CUDA_CHECK(cudaEventCreateWithFlags(&work_done_, cudaEventDisableTiming));
      CUDA_CHECK(cudaEventCreateWithFlags(&comm_done_, cudaEventDisableTiming));
    }
  }

  // Unwinding from an error (or after one), operations may be pending that a failed peer will
  // never match: abort them (ncclCommAbort ends the kernels) instead of waiting for them, so the
  // rank reaches MPI_Abort rather than hanging here or in the backend's final stream sync.
  ~NcclComm() override {
    cudaSetDevice(device_);
    const bool abort = failed_ || std::uncaught_exceptions() > 0;
    if (comm_) {
      if (abort) {
        ncclCommAbort(comm_);
      } else {
        cudaStreamSynchronize(stream_);
        ncclCommDestroy(comm_);
      }
    }
    cudaFree(token_);
    if (work_done_) cudaEventDestroy(work_done_);
    if (comm_done_) cudaEventDestroy(comm_done_);
    if (stream_ && !work_) cudaStreamDestroy(stream_);  // the shared stream lives on
  }

  const char* transport() const override { return "nccl"; }
  bool device_buffers() const override { return true; }

  NcclComm(const NcclComm&) = delete;
  NcclComm& operator=(const NcclComm&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return size_; }

  // Completes only once `dst` has posted the matching recv (NCCL has no eager buffering): two
  // ranks that send to each other first deadlock. A rank cannot send to itself.
  void send(const void* buf, size_t bytes, int dst, int tag) override {
    check_peer(dst, "send", tag);
    begin();
    if (bytes) NCCL_CHECK(ncclSend(buf, bytes, ncclUint8, dst, comm_, stream_));
    finish("send");
  }

  void recv(void* buf, size_t bytes, int src, int tag) override {
    check_peer(src, "recv", tag);
    begin();
    if (bytes) NCCL_CHECK(ncclRecv(buf, bytes, ncclUint8, src, comm_, stream_));
    finish("recv");
  }

  // Stream-ordered: the send is queued behind the work so far and done() once an event after it
  // has passed; blocking: the plain send (complete on return).
  std::unique_ptr<PendingSend> isend(const void* buf, size_t bytes, int dst, int tag) override {
    if (!work_) return Comm::isend(buf, bytes, dst, tag);
    check_peer(dst, "send", tag);
    begin();
    if (bytes) NCCL_CHECK(ncclSend(buf, bytes, ncclUint8, dst, comm_, stream_));
    struct Pending final : PendingSend {
      cudaEvent_t ev = nullptr;
      int device = 0;
      ~Pending() override {
        if (!ev) return;
        cudaSetDevice(device);
        cudaEventSynchronize(ev);
        cudaEventDestroy(ev);
      }
      bool done() override {
        cudaSetDevice(device);
        const cudaError_t e = cudaEventQuery(ev);
        if (e == cudaErrorNotReady) return false;
        CUDA_CHECK(e);
        return true;
      }
      void wait() override {
        cudaSetDevice(device);
        CUDA_CHECK(cudaEventSynchronize(ev));
      }
    };
    auto p = std::make_unique<Pending>();
    p->device = device_;
    CUDA_CHECK(cudaEventCreateWithFlags(&p->ev, cudaEventDisableTiming));
    CUDA_CHECK(cudaEventRecord(p->ev, stream_));
    return p;
  }

  // One NCCL group of point-to-point transfers (zero-byte pairs skipped on both sides, which the
  // pairwise size agreement makes consistent); the block to itself is a device copy.
  void all_to_all_v(const void* send, const size_t* send_bytes, const size_t* send_offsets, void* recv,
                    const size_t* recv_bytes, const size_t* recv_offsets) override {
    CHECK(send_bytes[rank_] == recv_bytes[rank_], "nccl all_to_all_v: rank ", rank_, " sends ", send_bytes[rank_],
          " bytes to itself but expects ", recv_bytes[rank_]);
    begin();
    const char* s = static_cast<const char*>(send);
    char* r = static_cast<char*>(recv);
    if (send_bytes[rank_])
      CUDA_CHECK(cudaMemcpyAsync(r + recv_offsets[rank_], s + send_offsets[rank_], send_bytes[rank_],
                                 cudaMemcpyDeviceToDevice, stream_));
    NCCL_CHECK(ncclGroupStart());
    for (int p = 0; p < size_; ++p) {
      if (p == rank_) continue;
      if (send_bytes[p]) NCCL_CHECK(ncclSend(s + send_offsets[p], send_bytes[p], ncclUint8, p, comm_, stream_));
      if (recv_bytes[p]) NCCL_CHECK(ncclRecv(r + recv_offsets[p], recv_bytes[p], ncclUint8, p, comm_, stream_));
    }
    NCCL_CHECK(ncclGroupEnd());
    finish("all_to_all_v");
  }

  void all_gather(const void* send, size_t bytes, void* recv) override {
    begin();
    if (bytes) NCCL_CHECK(ncclAllGather(send, recv, bytes, ncclUint8, comm_, stream_));
    finish("all_gather");
  }

  void all_reduce(void* buf, size_t count, ReduceDType dtype, ReduceOp op) override {
    begin();
    if (count) NCCL_CHECK(ncclAllReduce(buf, buf, count, nccl_type(dtype), nccl_op(op), comm_, stream_));
    finish("all_reduce");
  }

  void broadcast(void* buf, size_t bytes, int root) override {
    CHECK(root >= 0 && root < size_, "nccl broadcast: root ", root, " is not in this communicator (size ", size_, ")");
    begin();
    if (bytes) NCCL_CHECK(ncclBroadcast(buf, buf, bytes, ncclUint8, root, comm_, stream_));
    finish("broadcast");
  }

  // A one-int all-reduce: returns on every rank only after all ranks have entered, in both
  // orderings (the host waits for it, watching async errors).
  void barrier() override {
    begin();
    NCCL_CHECK(ncclAllReduce(token_, token_, 1, ncclInt32, ncclSum, comm_, stream_));
    finish("barrier");
    if (work_) poll("barrier");
  }

  std::unique_ptr<Comm> split(int color, int key) override {
    CHECK(color >= 0, "nccl split: color must be >= 0, got ", color, " on rank ", rank_);
    begin();
    ncclComm_t out = nullptr;
    NCCL_CHECK(ncclCommSplit(comm_, color, key, &out, nullptr));
    CHECK(out, "nccl split: rank ", rank_, " got no communicator for color ", color);
    return std::make_unique<NcclComm>(out, device_, host_, work_);
  }

  [[noreturn]] void abort(int code) override {
    if (comm_) ncclCommAbort(comm_);  // frees peers blocked in our collectives
    comm_ = nullptr;
    host_->abort(code);
    std::abort();  // host_->abort does not return
  }

 private:
  void check_peer(int peer, const char* what, int tag) const {
    CHECK(peer >= 0 && peer < size_, "nccl ", what, ": rank ", peer, " is not in this communicator (size ", size_,
          ", this rank ", rank_, ")");
    CHECK(peer != rank_, "nccl ", what, ": rank ", rank_,
          " cannot send to or receive from itself (NCCL send/recv would never match)");
    CHECK(tag >= 0, "nccl ", what, ": tag ", tag, " < 0");
  }

  // Work already queued (on the work stream, or on any stream when there is none) produced the
  // buffers we send.
  void begin() {
    CHECK(comm_, "nccl: communicator used after abort on rank ", rank_);
    CUDA_CHECK(cudaSetDevice(device_));
    if (!work_) {
      CUDA_CHECK(cudaDeviceSynchronize());
      return;
    }
    check_async("an earlier call");
    CUDA_CHECK(cudaEventRecord(work_done_, work_));
    CUDA_CHECK(cudaStreamWaitEvent(stream_, work_done_, 0));
  }

  // Throws (and marks the communicator failed: it is aborted, not destroyed) on an NCCL async
  // error such as a peer gone or a network failure.
  void check_async(const char* what) {
    ncclResult_t async = ncclSuccess;
    NCCL_CHECK(ncclCommGetAsyncError(comm_, &async));
    if (async != ncclSuccess && async != ncclInProgress) {
      failed_ = true;
      GLM5_FAIL("nccl ", what, " failed on rank ", rank_, " of ", size_, ": ", ncclGetErrorString(async), " (",
                ncclGetLastError(comm_), ")");
    }
  }

  // Stream-ordered: later work waits for this call on the device. Blocking: polls the stream; an
  // NCCL async error (peer gone, network failure) aborts the communicator and throws here
  // instead of blocking forever.
  void finish(const char* what) {
    if (work_) {
      CUDA_CHECK(cudaEventRecord(comm_done_, stream_));
      CUDA_CHECK(cudaStreamWaitEvent(work_, comm_done_, 0));
      return;
    }
    poll(what);
  }

  // Waits on the host for this communicator's stream, throwing on an NCCL async error.
  void poll(const char* what) {
    for (;;) {
      const cudaError_t e = cudaStreamQuery(stream_);
      if (e == cudaSuccess) return;
      if (e != cudaErrorNotReady) {
        failed_ = true;
        CUDA_CHECK(e);
      }
      check_async(what);
      std::this_thread::yield();
    }
  }

  ncclComm_t comm_ = nullptr;
  int device_ = 0;
  Comm* host_ = nullptr;
  int rank_ = 0, size_ = 1;
  cudaStream_t stream_ = nullptr;
  cudaStream_t work_ = nullptr;  // the backend's stream (stream-ordered mode), or none
  cudaEvent_t work_done_ = nullptr, comm_done_ = nullptr;
  int* token_ = nullptr;  // device int for barrier()
  bool failed_ = false;
};

}  // namespace

std::unique_ptr<Comm> make_nccl_comm_impl(Comm& host_comm, int device, cudaStream_t work) {
  // Local set-up first, then agree on success over the host comm, so that a rank without a
  // usable GPU makes every rank throw instead of leaving the others in ncclCommInitRank.
  std::string error;
  ncclUniqueId id{};
  try {
    int n = 0;
    CUDA_CHECK(cudaGetDeviceCount(&n));
    CHECK(device >= 0 && device < n, "nccl: rank ", host_comm.rank(), " asked for CUDA device ", device, " but ", n,
          " are visible");
    CUDA_CHECK(cudaSetDevice(device));
    if (host_comm.rank() == 0) NCCL_CHECK(ncclGetUniqueId(&id));
  } catch (const Error& e) {
    error = e.what();
  }
  int ok = error.empty() ? 1 : 0;
  host_comm.all_reduce(&ok, 1, ReduceDType::I32, ReduceOp::Min);
  if (!ok) {
    if (!error.empty()) throw Error(error);
    GLM5_FAIL("nccl: set-up failed on another rank (rank ", host_comm.rank(), " was fine); see that rank's message");
  }
  host_comm.broadcast(&id, sizeof(id), 0);
  ncclComm_t comm = nullptr;
  NCCL_CHECK(ncclCommInitRank(&comm, host_comm.size(), id, host_comm.rank()));
  return std::make_unique<NcclComm>(comm, device, &host_comm, work);
}

}  // namespace glm5::parallel

// The plugin's entry point (see nccl_loader.cpp): ownership of the result passes to the caller.
extern "C" glm5::parallel::Comm* glm5_cuda_make_nccl_comm(glm5::parallel::Comm* host_comm, int device,
                                                          void* work_stream) {
  return glm5::parallel::make_nccl_comm_impl(*host_comm, device, static_cast<cudaStream_t>(work_stream)).release();
}
