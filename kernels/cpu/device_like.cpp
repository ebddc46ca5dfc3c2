// make_device_like_backend(): the cpu backend's kernels behind a device's rules (device_like.h).
// Memory comes from a CachingAllocator over 64-byte aligned host blocks that are registered in a
// process-wide table, so transfers, ops and host communicators can tell device from host
// pointers. Every op checks that the pointers it is given are device memory: a host array passed
// to an op is the bug that would crash a GPU run, found here on any machine, and the addresses it
// hands out fault when host code dereferences them.
#include "kernels/cpu/device_like.h"
#include "kernels/cpu/weight_arena.h"

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "kernels/core/caching_allocator.h"

namespace glm5::kernels {

namespace {

std::atomic<int> g_live_backends{0};

struct Registry {
  std::mutex mu;
  std::map<uintptr_t, uintptr_t> blocks;  // start -> end of every raw block
  static Registry& get() {
    static Registry r;
    return r;
  }
  bool contains(const void* p, size_t bytes) {
    const uintptr_t a = reinterpret_cast<uintptr_t>(p), b = a + std::max<size_t>(bytes, 1);
    std::lock_guard<std::mutex> lock(mu);
    auto it = blocks.upper_bound(a);  // first block starting after a
    if (it != blocks.begin()) {
      auto prev = std::prev(it);
      if (a < prev->second) return true;  // a inside the block before
    }
    return it != blocks.end() && it->first < b;  // the range reaches the next block
  }
};

void* raw_block(size_t bytes) {
  void* p = std::aligned_alloc(64, (bytes + 63) / 64 * 64);
  if (!p) return nullptr;
  Registry& r = Registry::get();
  std::lock_guard<std::mutex> lock(r.mu);
  r.blocks[reinterpret_cast<uintptr_t>(p)] = reinterpret_cast<uintptr_t>(p) + bytes;
  return p;
}

void free_block(void* p) {
  {
    Registry& r = Registry::get();
    std::lock_guard<std::mutex> lock(r.mu);
    r.blocks.erase(reinterpret_cast<uintptr_t>(p));
  }
  std::free(p);
}

// Device addresses are host addresses with bit 63 set: not canonical on x86-64, so host code
// that dereferences one faults at once instead of reading the "device" memory; ops, transfers
// and device communicators translate them back (device_like_host_address).
constexpr uintptr_t kDeviceBit = uintptr_t(1) << 63;
template <class T>
T* tag(T* p) {
  return p ? reinterpret_cast<T*>(reinterpret_cast<uintptr_t>(p) | kDeviceBit) : p;
}
template <class T>
T* untag(T* p) {
  return reinterpret_cast<T*>(reinterpret_cast<uintptr_t>(p) & ~kDeviceBit);
}
// Byte value written over freed blocks: NaN as float, -1 as int32, so a read after free shows.
constexpr int kPoison = 0xFF;

// It keeps indexer keys by rows (index_key_tiles() stays false, as on CUDA), so that the tests
// comparing it with the cpu backend compare the tiled layout with rows, end to end.
class DeviceLikeBackend final : public Backend {
 public:
  explicit DeviceLikeBackend(Precision precision) : cpu_(make_cpu_backend(precision)), cache_(raw_block, free_block) {
    ++g_live_backends;
  }
  ~DeviceLikeBackend() override {
    for (void* p : uploads_) cache_.free(p);
    cache_.release_cached();
    --g_live_backends;
  }

  std::string name() const override { return "cpu-devicelike"; }
  Precision precision() const override { return cpu_->precision(); }
  bool host_memory() const override { return false; }
  uint64_t raw_allocations() const override { return cache_.raw_allocs(); }
  const DeviceLikeCounters& counters() const {
    counters_.raw_allocs = cache_.raw_allocs();
    return counters_;
  }

  void* alloc(size_t bytes) override {
    if (bytes == 0) return nullptr;
    void* p = cache_.alloc(bytes);
    CHECK(p, "backend cpu-devicelike: cannot allocate ", bytes, " bytes");
    sizes_[p] = bytes;
    return tag(p);
  }
  // Freed blocks are poisoned: a kernel or a communicator still reading one (a buffer freed before
  // its send completed) gets NaNs, which the bitwise tests see.
  void free(void* p) override {
    if (!p) return;
    void* h = untag(p);
    auto it = sizes_.find(h);
    CHECK(it != sizes_.end() && cache_.free(h), "backend cpu-devicelike: free() of a pointer it did not allocate");
    std::memset(h, kPoison, it->second);
    sizes_.erase(it);
  }
  void to_device(void* dst, const void* src, size_t bytes) override {
    if (bytes == 0) return;
    CHECK(is_device_like_memory(dst, bytes) && !is_device_like_memory(src, bytes),
          "backend cpu-devicelike: to_device needs a device destination and a host source");
    std::memcpy(untag(dst), src, bytes);
    counters_.to_device_bytes += bytes;
    ++counters_.to_device_calls;
  }
  void to_host(void* dst, const void* src, size_t bytes) override {
    if (bytes == 0) return;
    CHECK(is_device_like_memory(src, bytes) && !is_device_like_memory(dst, bytes),
          "backend cpu-devicelike: to_host needs a device source and a host destination");
    std::memcpy(dst, untag(src), bytes);
    counters_.to_host_bytes += bytes;
    ++counters_.to_host_calls;
  }
  const void* upload(const void* host, size_t bytes) override {
    void* p = cache_.alloc(std::max<size_t>(bytes, 1));
    CHECK(p, "backend cpu-devicelike: cannot allocate ", bytes, " bytes for an upload");
    if (bytes) std::memcpy(p, host, bytes);
    uploads_.push_back(p);
    return tag(p);
  }

  // Precision::kFast: plain-dtype matrices laid out as the cpu backend holds them (its fast paths'
  // recipes depend on the layout), then copied in. (Exact results do not depend on the layout.)
  Weight upload_gemm_matrix(const Weight& mapped, size_t bytes) override {
    const bool plain = mapped.dtype == DType::BF16 || mapped.dtype == DType::F16 || mapped.dtype == DType::F32;
    if (precision() != Precision::kFast || !plain) return Backend::upload_gemm_matrix(mapped, bytes);
    Weight w = cpu_->upload_gemm_matrix(mapped, bytes);
    const size_t n = w.layout == WeightLayout::kRowMajor
                         ? bytes
                         : cpu::WeightArena::interleaved_bytes(dtype_size(w.dtype), w.rows, w.cols, w.layout);
    w.data = upload(w.data, n);
    return w;
  }

  // Each op: every operand must be device memory; the cpu backend runs on the host addresses.
  void gemm(const GemmParams& p) override {
    run(&Backend::gemm, p, [](GemmParams& g) { g = host(g); });
  }
  void gemm_batch(const GemmParams* ps, size_t n) override {
    ++counters_.op_calls;
    std::vector<GemmParams> h(ps, ps + n);
    for (GemmParams& g : h) g = host(g);
    cpu_->gemm_batch(h.data(), n);
  }
  void rms_norm(const RmsNormParams& p) override {
    run(&Backend::rms_norm, p, [](RmsNormParams& q) {
      q.x = dev(q.x, "rms_norm x"), q.weight = dev(q.weight, "rms_norm weight"), q.y = dev(q.y, "rms_norm y");
    });
  }
  void layer_norm(const LayerNormParams& p) override {
    run(&Backend::layer_norm, p, [](LayerNormParams& q) {
      q.x = dev(q.x, "layer_norm x"), q.weight = dev(q.weight, "layer_norm weight");
      q.bias = dev(q.bias, "layer_norm bias"), q.y = dev(q.y, "layer_norm y");
    });
  }
  void rope(const RopeParams& p) override {
    run(&Backend::rope, p, [](RopeParams& q) {
      q.x = dev(q.x, "rope x"), q.positions = dev(q.positions, "rope positions");
      q.inv_freq = dev(q.inv_freq, "rope inv_freq");
    });
  }
  void indexer_scores(const IndexerScoresParams& p) override {
    run(&Backend::indexer_scores, p, [](IndexerScoresParams& q) {
      q.q = dev(q.q, "indexer q"), q.weights = dev(q.weights, "indexer weights"), q.k = dev(q.k, "indexer k");
      q.q_pos = dev(q.q_pos, "indexer q_pos"), q.scores = dev(q.scores, "indexer scores");
      q.pages.block_table = dev(q.pages.block_table, "indexer block table");
    });
  }
  void topk(const TopkParams& p) override {
    run(&Backend::topk, p,
        [](TopkParams& q) { q.scores = dev(q.scores, "topk scores"), q.indices = dev(q.indices, "topk indices"); });
  }
  void mla_prefill(const MlaPrefillParams& p) override {
    run(&Backend::mla_prefill, p, [](MlaPrefillParams& q) {
      q.q = dev(q.q, "mla_prefill q"), q.kv = dev(q.kv, "mla_prefill kv"), q.k_pe = dev(q.k_pe, "mla_prefill k_pe");
      q.q_pos = dev(q.q_pos, "mla_prefill q_pos"), q.topk = dev(q.topk, "mla_prefill topk");
      q.out = dev(q.out, "mla_prefill out");
    });
  }
  void mla_decode(const MlaDecodeParams& p) override {
    run(&Backend::mla_decode, p, [](MlaDecodeParams& q) {
      q.q_lat = dev(q.q_lat, "mla_decode q_lat"), q.cache = dev(q.cache, "mla_decode cache");
      q.q_pos = dev(q.q_pos, "mla_decode q_pos"), q.topk = dev(q.topk, "mla_decode topk");
      q.out_lat = dev(q.out_lat, "mla_decode out_lat");
      q.pages.block_table = dev(q.pages.block_table, "mla_decode block table");
    });
  }
  void router(const RouterParams& p) override {
    run(&Backend::router, p, [](RouterParams& q) {
      q.logits = dev(q.logits, "router logits"), q.bias = dev(q.bias, "router bias");
      q.expert_ids = dev(q.expert_ids, "router expert_ids"),
      q.expert_weights = dev(q.expert_weights, "router expert_weights");
    });
  }
  void swiglu(const SwigluParams& p) override {
    run(&Backend::swiglu, p, [](SwigluParams& q) {
      q.gate = dev(q.gate, "swiglu gate"), q.up = dev(q.up, "swiglu up"), q.out = dev(q.out, "swiglu out");
    });
  }
  void embedding(const EmbeddingParams& p) override {
    run(&Backend::embedding, p, [](EmbeddingParams& q) {
      q.table = weight(q.table, "embedding"), q.ids = dev(q.ids, "embedding ids"), q.out = dev(q.out, "embedding out");
    });
  }
  void gather_rows(const GatherRowsParams& p) override {
    run(&Backend::gather_rows, p, [](GatherRowsParams& q) {
      q.src = dev(q.src, "gather_rows src"), q.rows = dev(q.rows, "gather_rows rows"),
      q.dst = dev(q.dst, "gather_rows dst");
    });
  }
  void moe_combine(const MoeCombineParams& p) override {
    run(&Backend::moe_combine, p, [](MoeCombineParams& q) {
      q.expert_out = dev(q.expert_out, "moe_combine expert_out"), q.slots = dev(q.slots, "moe_combine slots");
      q.weights = dev(q.weights, "moe_combine weights"), q.out = dev(q.out, "moe_combine out");
    });
  }
  void add(const AddParams& p) override {
    run(&Backend::add, p, [](AddParams& q) { q.x = dev(q.x, "add x"), q.y = dev(q.y, "add y"); });
  }
  void copy_2d(const Copy2dParams& p) override {
    run(&Backend::copy_2d, p,
        [](Copy2dParams& q) { q.src = dev(q.src, "copy_2d src"), q.dst = dev(q.dst, "copy_2d dst"); });
  }
  void paged_write(const PagedWriteParams& p) override {
    run(&Backend::paged_write, p, [](PagedWriteParams& q) {
      q.src = dev(q.src, "paged_write src"), q.pos = dev(q.pos, "paged_write pos"),
      q.pool = dev(q.pool, "paged_write pool");
      q.pages.block_table = dev(q.pages.block_table, "paged_write block table");
    });
  }

 private:
  // One op: counted, its operands checked and translated to host addresses by `translate`, then
  // run by the cpu backend.
  template <class P, class Translate>
  void run(void (Backend::*op)(const P&), const P& p, Translate translate) {
    ++counters_.op_calls;
    P q = p;
    translate(q);
    (cpu_.get()->*op)(q);
  }

  // An operand's host address; it must be device memory (a null pointer is the op's own business:
  // it validates its parameters).
  template <class T>
  static T* dev(T* p, const char* what) {
    CHECK(!p || is_device_like_memory(p, 1), "backend cpu-devicelike: ", what,
          " is host memory; a device backend's ops take device pointers only");
    return p ? untag(p) : p;
  }
  static Weight weight(Weight w, const char* what) {
    CHECK(!w.data || is_device_like_memory(w.data, 1), "backend cpu-devicelike: ", what,
          " weight is host memory (not uploaded)");
    CHECK(!w.scale || is_device_like_memory(w.scale, 1), "backend cpu-devicelike: ", what,
          " weight scales are host memory (not uploaded)");
    w.data = w.data ? untag(w.data) : w.data;
    w.scale = w.scale ? untag(w.scale) : w.scale;
    return w;
  }
  static GemmParams host(GemmParams g) {
    g.x = dev(g.x, "gemm x"), g.y = dev(g.y, "gemm y"), g.w = weight(g.w, "gemm");
    return g;
  }

  std::unique_ptr<Backend> cpu_;
  CachingAllocator cache_;
  std::vector<void*> uploads_;               // host addresses
  std::unordered_map<void*, size_t> sizes_;  // live alloc() blocks (host address) -> bytes asked
  mutable DeviceLikeCounters counters_;
};

}  // namespace

const DeviceLikeCounters* device_like_counters(const Backend& be) {
  const auto* d = dynamic_cast<const DeviceLikeBackend*>(&be);
  return d ? &d->counters() : nullptr;
}

std::unique_ptr<Backend> make_device_like_backend(Precision precision) {
  return std::make_unique<DeviceLikeBackend>(precision);
}

bool is_device_like_memory(const void* p, size_t bytes) {
  if (!p || !(reinterpret_cast<uintptr_t>(p) & kDeviceBit) || g_live_backends.load(std::memory_order_relaxed) == 0)
    return false;
  return Registry::get().contains(untag(p), bytes);
}

const void* device_like_host_address(const void* p) { return is_device_like_memory(p, 1) ? untag(p) : p; }

void check_host_pointer(const void* p, size_t bytes, const char* what) {
  if (bytes == 0) return;
  CHECK(!is_device_like_memory(p, bytes), what, " was handed device memory (", bytes,
        " bytes): host communicators take host buffers only; device payloads go over the "
        "device communicator or through staging");
}

}  // namespace glm5::kernels
