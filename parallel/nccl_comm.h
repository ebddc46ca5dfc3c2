// The Comm of parallel/comm.h over NCCL: every buffer is device memory on this rank's GPU (one
// rank drives one GPU). Bootstrapped over a host Comm (MPI). Every call has completed when it
// returns, like MpiComm; tags are checked but not matched (NCCL orders messages per peer pair),
// and no stream appears in the interface. Built only with CUDA + NCCL.
#pragma once

#include <memory>

#include "parallel/comm.h"

namespace glm5::parallel {

// Collective over `host_comm`: rank 0 creates the NCCL id and broadcasts it over host_comm, then
// every rank joins with its host_comm rank, on CUDA device `device` (made current). If any rank
// fails its local set-up, every rank throws (no hang). `host_comm` must outlive the result and
// every communicator split from it: abort() goes through it.
std::unique_ptr<Comm> make_nccl_comm(Comm& host_comm, int device);

}  // namespace glm5::parallel
