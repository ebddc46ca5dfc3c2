// Communicators over a device backend's memory other than NCCL itself:
//   make_staged_comm: device buffers moved by a host communicator (MPI), copied to and from host
//     memory around every call (comm: mpi with a device backend). The copies happen here, in the
//     communication layer, so model and engine code never stage payloads themselves.
//   make_device_like_comm: the device-like test backend's NCCL: a host communicator allowed to
//     read and write that backend's memory directly, as NCCL reads GPU memory (comm: nccl with
//     backend cpu-devicelike), so CI runs the zero-staging path.
// Both split into communicators of the same kind; the host communicator must outlive them.
#pragma once

#include <memory>

#include "kernels/ops.h"
#include "parallel/comm.h"

namespace glm5::parallel {

std::unique_ptr<Comm> make_staged_comm(Comm& host, kernels::Backend& backend);
std::unique_ptr<Comm> make_device_like_comm(Comm& host);

}  // namespace glm5::parallel
