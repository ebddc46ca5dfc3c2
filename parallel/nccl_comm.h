// The Comm of parallel/comm.h over NCCL: every buffer is device memory on this rank's GPU (one
// rank drives one GPU). Bootstrapped over a host Comm (MPI). Tags are checked but not matched
// (NCCL orders messages per peer pair). Built only with CUDA + NCCL.
// Without a work stream every call has completed when it returns, like MpiComm. With one (the
// backend's, Backend::stream()), calls are ordered with the work queued on it through events and
// never block the host: a buffer received is ready for the backend's next op, and the host sees
// it after the backend's next to_host (which waits for the stream). All stream-ordered
// communicators of a device share one NCCL stream, so a send still waiting for its receiver holds
// back every later NCCL operation of that device (not the host): the engine stays deadlock-free
// because its hidden-state sends only go to later stages, and every host wait (a to_host, a plan
// exchange) depends only on operations the peers have already issued or on later stages.
#pragma once

#include <memory>

#include "parallel/comm.h"

namespace glm5::parallel {

// Collective over `host_comm`: rank 0 creates the NCCL id and broadcasts it over host_comm, then
// every rank joins with its host_comm rank, on CUDA device `device` (made current). If any rank
// fails its local set-up, every rank throws (no hang). `host_comm` must outlive the result and
// every communicator split from it: abort() goes through it.
std::unique_ptr<Comm> make_nccl_comm(Comm& host_comm, int device, void* work_stream = nullptr);

}  // namespace glm5::parallel
