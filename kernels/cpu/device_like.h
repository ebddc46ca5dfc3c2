// The device-like CPU backend: the fast CPU kernels on memory that behaves like a GPU's as far as
// the rest of the runtime can tell. host_memory() is false, weights are copied in by upload(),
// activations move only through to_host / to_device (counted) or a device communicator, a host
// communicator handed one of its pointers throws, host code that dereferences one faults (its
// addresses are not canonical), and freed blocks are poisoned. Unlike a GPU it runs every op
// before returning, so a missing stream/event order cannot show here. So every CI build, on any machine, runs the
// data movement a CUDA rank would do (staging, device payloads, the caching allocator), with
// results bitwise those of the plain cpu backend (same kernels, same order).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "kernels/ops.h"

namespace glm5::kernels {

// What the runtime did with a device-like backend's memory.
struct DeviceLikeCounters {
  uint64_t to_host_bytes = 0, to_device_bytes = 0;  // host transfers (uploads not included)
  uint64_t to_host_calls = 0, to_device_calls = 0;
  uint64_t raw_allocs = 0;  // blocks taken from the host heap
  uint64_t op_calls = 0;    // op calls (a gemm_batch is one call)
};

// Counters of a backend made by make_device_like_backend(); nullptr for any other backend.
const DeviceLikeCounters* device_like_counters(const Backend& be);
std::unique_ptr<Backend> make_device_like_backend(Precision precision = Precision::kExact);

// True when [p, p + bytes) touches memory of a live device-like backend.
bool is_device_like_memory(const void* p, size_t bytes);
// The host address behind a device-like pointer (other pointers unchanged): its addresses have
// bit 63 set, so host code that dereferences one faults; a device communicator (the stand-in for
// NCCL) translates them before handing buffers to MPI.
const void* device_like_host_address(const void* p);
inline void* device_like_host_address(void* p) {
  return const_cast<void*>(device_like_host_address(static_cast<const void*>(p)));
}
// Throws glm5::Error naming `what` when a host-only path (an MPI call) is handed device-like
// memory. Costs a bit test (and one relaxed load while no such backend lives).
void check_host_pointer(const void* p, size_t bytes, const char* what);

}  // namespace glm5::kernels
