// MpiComm (Comm over MPI on host memory), MpiRuntime, and the MPI-free one-rank SelfComm.
// Large transfers are chunked to the int counts MPI takes; nothing here is model-specific.
#include "parallel/mpi_comm.h"

#include <sched.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <map>
#include <thread>
#include <vector>

#include "kernels/cpu/device_like.h"

namespace glm5::parallel {

namespace {

size_t g_message_limit = INT_MAX;

bool mpi_active() {
  int init = 0, fin = 0;
  MPI_Initialized(&init);
  MPI_Finalized(&fin);
  return init && !fin;
}

MPI_Datatype mpi_type(ReduceDType t) {
  switch (t) {
    case ReduceDType::F32: return MPI_FLOAT;
    case ReduceDType::F64: return MPI_DOUBLE;
    case ReduceDType::I32: return MPI_INT32_T;
    case ReduceDType::I64: return MPI_INT64_T;
  }
  GLM5_FAIL("all_reduce: unknown ReduceDType ", int(t));
}

size_t type_bytes(ReduceDType t) { return (t == ReduceDType::F32 || t == ReduceDType::I32) ? 4 : 8; }

MPI_Op mpi_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum: return MPI_SUM;
    case ReduceOp::Max: return MPI_MAX;
    case ReduceOp::Min: return MPI_MIN;
  }
  GLM5_FAIL("all_reduce: unknown ReduceOp ", int(op));
}

}  // namespace

std::string mpi_error_string(int code) {
  char buf[MPI_MAX_ERROR_STRING + 1] = {0};
  int len = 0;
  if (MPI_Error_string(code, buf, &len) != MPI_SUCCESS) return "MPI error code " + std::to_string(code);
  return std::string(buf, size_t(len));
}

int mpi_world_rank() {
  if (!mpi_active()) return -1;
  int r = -1;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}

void set_mpi_message_limit(size_t bytes) {
  CHECK(bytes >= 1 && bytes <= size_t(INT_MAX), "MPI message limit must be in [1, ", INT_MAX, "] bytes, got ", bytes);
  g_message_limit = bytes;
}

size_t mpi_message_limit() { return g_message_limit; }

// ---- MpiRuntime ----

MpiRuntime::MpiRuntime(int* argc, char*** argv) {
  int init = 0, fin = 0;
  MPI_Initialized(&init);
  MPI_Finalized(&fin);
  CHECK(!fin, "MPI has already been finalised in this process; it cannot be initialised again");
  if (!init) {
    int provided = 0;
    int rc = MPI_Init_thread(argc, argv, MPI_THREAD_FUNNELED, &provided);
    CHECK(rc == MPI_SUCCESS, "MPI_Init_thread failed: ", mpi_error_string(rc));
    owns_ = true;
    if (provided < MPI_THREAD_FUNNELED) {
      MPI_Finalize();
      owns_ = false;
      GLM5_FAIL("MPI_Init_thread: asked for MPI_THREAD_FUNNELED (", MPI_THREAD_FUNNELED,
                "), the MPI library provides only level ", provided);
    }
  }
  MPI_CHECK(MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN));
}

MpiRuntime::~MpiRuntime() {
  if (owns_ && mpi_active()) MPI_Finalize();
}

int MpiRuntime::world_rank() const {
  int r = 0;
  MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &r));
  return r;
}

int MpiRuntime::world_size() const {
  int s = 0;
  MPI_CHECK(MPI_Comm_size(MPI_COMM_WORLD, &s));
  return s;
}

// ---- MpiComm ----

MpiComm::MpiComm(MPI_Comm comm, bool owned) : comm_(comm), owned_(owned) {
  CHECK(comm != MPI_COMM_NULL, "MpiComm: got MPI_COMM_NULL");
  MPI_CHECK(MPI_Comm_rank(comm_, &rank_));
  MPI_CHECK(MPI_Comm_size(comm_, &size_));
  void* attr = nullptr;
  int flag = 0;
  MPI_CHECK(MPI_Comm_get_attr(MPI_COMM_WORLD, MPI_TAG_UB, &attr, &flag));
  if (flag && attr) tag_ub_ = *static_cast<int*>(attr);
}

MpiComm::~MpiComm() {
  if (!mpi_active()) return;
  if (owned_) MPI_Comm_free(&comm_);
}

void MpiComm::check_peer(int peer, const char* what) const {
  CHECK(peer >= 0 && peer < size_, what, ": rank ", peer, " is not in this communicator (size ", size_, ", this rank ",
        rank_, ")");
}

void MpiComm::check_tag(int tag, const char* what) const {
  CHECK(tag >= 0 && tag <= tag_ub_, what, ": tag ", tag, " is outside [0, ", tag_ub_, "]");
}

namespace {

double g_watchdog_s = 300;

// What a wait is for, as the watchdog reports it. peer: rank in comm, or -1 for a collective.
struct WaitFor {
  const char* op;
  MPI_Comm comm = MPI_COMM_WORLD;
  int peer = -1;
  int tag = -1;
  size_t bytes = 0;
};

int world_rank_in(MPI_Comm comm, int r);

std::string describe(const WaitFor& w) {
  const std::string op = w.op;
  std::string s = op;
  if (w.peer >= 0)  // world ranks, as mpirun and the error messages number them
    s += (op == "send" ? " to rank " : " from rank ") + std::to_string(world_rank_in(w.comm, w.peer));
  if (w.tag >= 0) s += ", tag " + std::to_string(w.tag);
  return s + ", " + std::to_string(w.bytes) + " bytes";
}

// Sends started by isend and not yet complete on this rank (only the main thread talks to MPI).
std::map<uint64_t, WaitFor>& sends_in_flight() {
  static std::map<uint64_t, WaitFor> m;
  return m;
}

int world_rank_in(MPI_Comm comm, int r) {
  MPI_Group g = MPI_GROUP_NULL, wg = MPI_GROUP_NULL;
  int out = r;
  if (MPI_Comm_group(comm, &g) == MPI_SUCCESS && MPI_Comm_group(MPI_COMM_WORLD, &wg) == MPI_SUCCESS)
    MPI_Group_translate_ranks(g, 1, &r, wg, &out);
  if (g != MPI_GROUP_NULL) MPI_Group_free(&g);
  if (wg != MPI_GROUP_NULL) MPI_Group_free(&wg);
  return out;
}

void watchdog_report(const WaitFor& w, double waited, double grace) {
  std::string msg = "[glm5] watchdog: rank " + std::to_string(mpi_world_rank()) + " has waited " +
                    std::to_string(int(waited)) + " s with no progress for " + describe(w);
  const auto& sends = sends_in_flight();
  if (!sends.empty()) {
    msg += "; its sends in flight:";
    for (auto& [id, s] : sends) msg += " [" + describe(s) + "]";
  }
  msg += "; the job aborts in " + std::to_string(int(grace)) +
         " s unless this completes "
         "(cluster key watchdog_s; 0 turns the watchdog off)\n";
  std::fputs(msg.c_str(), stderr);
  std::fflush(stderr);
}

// Waits for one request without holding a core: MPI_Test with sched_yield in between for up to
// 50 us (an exchange between ranks that arrive together completes at polling latency, while a
// rank sharing the core gets it on every yield), then sleeps that double from 2 us up to 1 ms
// between tests (a rank waiting on the pipeline sleeps). Every call that can wait on another rank
// (point-to-point and collectives) is nonblocking + this wait, so a rank that arrives early never
// busy-polls inside MPI, taking a core from a rank at work. The watchdog (set_watchdog_seconds)
// reports and aborts a wait that never ends.
void wait_polling(MPI_Request* req, MPI_Status* st, const WaitFor& what) {
  constexpr auto kSpin = std::chrono::microseconds(50);
  int done = 0;
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0;; ++i) {
    MPI_CHECK(MPI_Test(req, &done, st));
    if (done) return;
    if (i >= 16 && std::chrono::steady_clock::now() - t0 > kSpin) break;
    sched_yield();
  }
  const double limit = g_watchdog_s, grace = std::clamp(limit / 10, 1.0, 30.0);
  bool reported = false;
  auto nap = std::chrono::microseconds(2);
  while (true) {
    std::this_thread::sleep_for(nap);
    MPI_CHECK(MPI_Test(req, &done, st));
    if (done) {
      if (reported) std::fprintf(stderr, "[glm5] watchdog: rank %d: the wait completed after all\n", mpi_world_rank());
      return;
    }
    nap = std::min(nap * 2, std::chrono::microseconds(1000));
    if (limit <= 0 || nap < std::chrono::microseconds(1000)) continue;
    const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (!reported && waited > limit) {
      watchdog_report(what, waited, grace);
      reported = true;
    } else if (reported && waited > limit + grace) {
      std::fprintf(stderr, "[glm5] watchdog: rank %d aborts the job (no progress for %.0f s)\n", mpi_world_rank(),
                   waited);
      std::fflush(stderr);
      MPI_Abort(MPI_COMM_WORLD, 3);
    }
  }
}

// Chunks of an isend, each its own MPI request; registered in sends_in_flight until complete.
class MpiPendingSend final : public PendingSend {
 public:
  MpiPendingSend(std::vector<MPI_Request> reqs, WaitFor what) : reqs_(std::move(reqs)), what_(what) {
    static uint64_t next_id = 0;
    id_ = ++next_id;
    sends_in_flight()[id_] = what_;
  }
  ~MpiPendingSend() override {
    try {
      // Not while unwinding to the job's abort: the peer may never receive.
      if (std::uncaught_exceptions() == 0) wait();
    } catch (...) {  // MPI failed: the error surfaced elsewhere (or aborts the job)
    }
    sends_in_flight().erase(id_);
  }
  bool done() override {
    if (finished_) return true;
    int flag = 0;
    MPI_CHECK(MPI_Testall(int(reqs_.size()), reqs_.data(), &flag, MPI_STATUSES_IGNORE));
    if (flag) finish();
    return finished_;
  }
  void wait() override {
    if (finished_) return;
    for (MPI_Request& r : reqs_) wait_polling(&r, MPI_STATUS_IGNORE, what_);
    finish();
  }

 private:
  void finish() {
    finished_ = true;
    sends_in_flight().erase(id_);
  }
  std::vector<MPI_Request> reqs_;
  WaitFor what_;
  uint64_t id_ = 0;
  bool finished_ = false;
};

}  // namespace

void set_watchdog_seconds(double seconds) {
  CHECK(seconds >= 0, "watchdog: expected seconds >= 0 (0 = off), found ", seconds);
  g_watchdog_s = seconds;
}
double watchdog_seconds() { return g_watchdog_s; }

void MpiComm::send(const void* buf, size_t bytes, int dst, int tag) { isend(buf, bytes, dst, tag)->wait(); }

std::unique_ptr<PendingSend> MpiComm::isend(const void* buf, size_t bytes, int dst, int tag) {
  kernels::check_host_pointer(buf, bytes, "MPI send");
  check_peer(dst, "send");
  check_tag(tag, "send");
  const char* p = static_cast<const char*>(buf);
  const size_t limit = g_message_limit;
  std::vector<MPI_Request> reqs;
  size_t off = 0;
  do {  // a zero-byte send is still one message, matching a zero-byte recv
    size_t n = std::min(bytes - off, limit);
    reqs.push_back(MPI_REQUEST_NULL);
    MPI_CHECK(MPI_Isend(p + off, int(n), MPI_BYTE, dst, tag, comm_, &reqs.back()));
    off += n;
  } while (off < bytes);
  return std::make_unique<MpiPendingSend>(std::move(reqs), WaitFor{"send", comm_, dst, tag, bytes});
}

void MpiComm::recv(void* buf, size_t bytes, int src, int tag) {
  kernels::check_host_pointer(buf, bytes, "MPI recv");
  check_peer(src, "recv");
  check_tag(tag, "recv");
  char* p = static_cast<char*>(buf);
  const size_t limit = g_message_limit;
  size_t off = 0;
  do {
    size_t n = std::min(bytes - off, limit);
    MPI_Request req = MPI_REQUEST_NULL;
    MPI_Status st;
    MPI_CHECK(MPI_Irecv(p + off, int(n), MPI_BYTE, src, tag, comm_, &req));
    wait_polling(&req, &st, WaitFor{"recv", comm_, src, tag, n});
    int got = 0;
    MPI_CHECK(MPI_Get_count(&st, MPI_BYTE, &got));
    CHECK(size_t(got) == n, "recv from rank ", src, " tag ", tag, ": expected ", n, " bytes in this message, got ", got,
          " (sizes must agree on both sides)");
    off += n;
  } while (off < bytes);
}

// One MPI_Ialltoallw on every call, so no agreement between ranks is needed: MPI matches each
// pair's data by type signature (a sequence of bytes), not by how each side describes it. A
// block within the message limit is `bytes` x MPI_BYTE at an int displacement; a larger one (or
// one at a larger offset) is one derived type: `bytes / limit` chunks of `limit` bytes plus the
// rest, placed with 64-bit MPI_Aint displacements.
void MpiComm::all_to_all_v(const void* send, const size_t* send_bytes, const size_t* send_offsets, void* recv,
                           const size_t* recv_bytes, const size_t* recv_offsets) {
  CHECK(send_bytes[rank_] == recv_bytes[rank_], "all_to_all_v: rank ", rank_, " sends ", send_bytes[rank_],
        " bytes to itself but expects ", recv_bytes[rank_]);
  for (int r = 0; r < size_; ++r) {
    kernels::check_host_pointer(static_cast<const char*>(send) + send_offsets[r], send_bytes[r], "MPI all_to_all_v");
    kernels::check_host_pointer(static_cast<char*>(recv) + recv_offsets[r], recv_bytes[r], "MPI all_to_all_v");
  }
  const size_t limit = g_message_limit;
  counts_.resize(size_);
  displs_.resize(size_);
  rcounts_.resize(size_);
  rdispls_.resize(size_);
  stypes_.assign(size_, MPI_BYTE);
  rtypes_.assign(size_, MPI_BYTE);
  std::vector<MPI_Datatype> made;
  // Describes `bytes` at `offset` as (count, displacement, type).
  auto describe = [&](size_t bytes, size_t offset, int& count, int& displ, MPI_Datatype& type) {
    if (bytes == 0 || (bytes <= limit && offset <= limit)) {
      count = int(bytes);
      displ = bytes == 0 ? 0 : int(offset);
      type = MPI_BYTE;
      return;
    }
    MPI_Datatype chunk = MPI_DATATYPE_NULL;
    MPI_CHECK(MPI_Type_contiguous(int(limit), MPI_BYTE, &chunk));
    made.push_back(chunk);
    int lens[2] = {int(bytes / limit), int(bytes % limit)};
    MPI_Aint at[2] = {MPI_Aint(offset), MPI_Aint(offset + (bytes / limit) * limit)};
    MPI_Datatype parts[2] = {chunk, MPI_BYTE};
    MPI_CHECK(MPI_Type_create_struct(2, lens, at, parts, &type));
    MPI_CHECK(MPI_Type_commit(&type));
    made.push_back(type);
    count = 1;
    displ = 0;
  };
  for (int r = 0; r < size_; ++r) {
    describe(send_bytes[r], send_offsets[r], counts_[r], displs_[r], stypes_[r]);
    describe(recv_bytes[r], recv_offsets[r], rcounts_[r], rdispls_[r], rtypes_[r]);
  }
  // Nonblocking, then the sleeping wait: a rank that arrives early does not spin a core.
  MPI_Request req = MPI_REQUEST_NULL;
  int rc = MPI_Ialltoallw(send, counts_.data(), displs_.data(), stypes_.data(), recv, rcounts_.data(), rdispls_.data(),
                          rtypes_.data(), comm_, &req);
  if (rc == MPI_SUCCESS) {
    try {
      size_t total = 0;
      for (int r = 0; r < size_; ++r) total += recv_bytes[r];
      wait_polling(&req, MPI_STATUS_IGNORE, WaitFor{"all_to_all_v (MoE exchange)", comm_, -1, -1, total});
    } catch (...) {
      for (MPI_Datatype& t : made) MPI_Type_free(&t);
      throw;
    }
  }
  for (MPI_Datatype& t : made) MPI_Type_free(&t);
  MPI_CHECK(rc);
}

void MpiComm::all_gather(const void* send, size_t bytes, void* recv) {
  if (bytes == 0) return;  // bytes agree on all ranks
  kernels::check_host_pointer(send, bytes, "MPI all_gather");
  kernels::check_host_pointer(recv, bytes * size_t(size_), "MPI all_gather");
  char* out = static_cast<char*>(recv);
  char* mine = out + size_t(rank_) * bytes;
  if (bytes * size_t(size_) <= g_message_limit) {
    const void* src = (send == mine) ? MPI_IN_PLACE : send;
    MPI_Request req = MPI_REQUEST_NULL;
    MPI_CHECK(MPI_Iallgather(src, int(bytes), MPI_BYTE, out, int(bytes), MPI_BYTE, comm_, &req));
    wait_polling(&req, MPI_STATUS_IGNORE, WaitFor{"all_gather", comm_, -1, -1, bytes * size_t(size_)});
    return;
  }
  if (send != mine) std::memmove(mine, send, bytes);
  for (int r = 0; r < size_; ++r) broadcast(out + size_t(r) * bytes, bytes, r);
}

void MpiComm::all_reduce(void* buf, size_t count, ReduceDType dtype, ReduceOp op) {
  const size_t es = type_bytes(dtype);
  kernels::check_host_pointer(buf, count * es, "MPI all_reduce");
  const size_t chunk = std::max<size_t>(1, g_message_limit / es);
  char* p = static_cast<char*>(buf);
  for (size_t off = 0; off < count; off += chunk) {
    size_t n = std::min(chunk, count - off);
    MPI_Request req = MPI_REQUEST_NULL;
    MPI_CHECK(MPI_Iallreduce(MPI_IN_PLACE, p + off * es, int(n), mpi_type(dtype), mpi_op(op), comm_, &req));
    wait_polling(&req, MPI_STATUS_IGNORE, WaitFor{"all_reduce", comm_, -1, -1, n * es});
  }
}

void MpiComm::broadcast(void* buf, size_t bytes, int root) {
  kernels::check_host_pointer(buf, bytes, "MPI broadcast");
  check_peer(root, "broadcast");
  char* p = static_cast<char*>(buf);
  const size_t limit = g_message_limit;
  for (size_t off = 0; off < bytes; off += limit) {
    MPI_Request req = MPI_REQUEST_NULL;
    MPI_CHECK(MPI_Ibcast(p + off, int(std::min(limit, bytes - off)), MPI_BYTE, root, comm_, &req));
    wait_polling(&req, MPI_STATUS_IGNORE, WaitFor{"broadcast", comm_, root, -1, bytes});
  }
}

void MpiComm::barrier() {
  MPI_Request req = MPI_REQUEST_NULL;
  MPI_CHECK(MPI_Ibarrier(comm_, &req));
  wait_polling(&req, MPI_STATUS_IGNORE, WaitFor{"barrier", comm_, -1, -1, 0});
}

std::unique_ptr<Comm> MpiComm::split(int color, int key) {
  CHECK(color >= 0, "split: color must be >= 0, got ", color, " on rank ", rank_);
  MPI_Comm out = MPI_COMM_NULL;
  MPI_CHECK(MPI_Comm_split(comm_, color, key, &out));
  return std::make_unique<MpiComm>(out, true);
}

void MpiComm::abort(int code) {
  std::fflush(stdout);
  std::fflush(stderr);
  MPI_Abort(MPI_COMM_WORLD, code);
  std::abort();  // MPI_Abort should not return
}

std::unique_ptr<Comm> make_mpi_world() {
  CHECK(mpi_active(), "make_mpi_world: MPI is not initialised (create an MpiRuntime first)");
  MPI_CHECK(MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN));
  return std::make_unique<MpiComm>(MPI_COMM_WORLD, false);
}

// ---- SelfComm: one rank, no MPI ----

namespace {

class SelfComm final : public Comm {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  void send(const void*, size_t, int dst, int tag) override {
    GLM5_FAIL("send to rank ", dst, " (tag ", tag,
              ") on the one-rank self communicator: there is no other rank to receive it");
  }
  void recv(void*, size_t, int src, int tag) override {
    GLM5_FAIL("recv from rank ", src, " (tag ", tag, ") on the one-rank self communicator: nothing can ever arrive");
  }
  void all_to_all_v(const void* send, const size_t* send_bytes, const size_t* send_offsets, void* recv,
                    const size_t* recv_bytes, const size_t* recv_offsets) override {
    CHECK(send_bytes[0] == recv_bytes[0], "all_to_all_v on the self communicator: sends ", send_bytes[0],
          " bytes but expects ", recv_bytes[0]);
    if (send_bytes[0] > 0)
      std::memmove(static_cast<char*>(recv) + recv_offsets[0], static_cast<const char*>(send) + send_offsets[0],
                   send_bytes[0]);
  }
  void all_gather(const void* send, size_t bytes, void* recv) override {
    if (bytes > 0 && send != recv) std::memmove(recv, send, bytes);
  }
  void all_reduce(void*, size_t, ReduceDType, ReduceOp) override {}
  void broadcast(void*, size_t, int root) override {
    CHECK(root == 0, "broadcast on the self communicator: root ", root, " is not rank 0");
  }
  void barrier() override {}
  std::unique_ptr<Comm> split(int color, int) override {
    CHECK(color >= 0, "split: color must be >= 0, got ", color);
    return std::make_unique<SelfComm>();
  }
  [[noreturn]] void abort(int code) override {
    std::fflush(stdout);
    std::fflush(stderr);
    std::_Exit(code == 0 ? 1 : code);
  }
};

}  // namespace

std::unique_ptr<Comm> make_self_comm() { return std::make_unique<SelfComm>(); }

}  // namespace glm5::parallel
