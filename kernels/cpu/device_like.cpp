// make_device_like_backend(): the cpu backend's kernels behind a device's rules (device_like.h).
// Memory comes from a CachingAllocator over 64-byte aligned host blocks that are registered in a
// process-wide table, so transfers, ops and host communicators can tell device from host
// pointers. Every op checks that the pointers it is given are device memory: a host array passed
// to an op is the bug that would crash a GPU run, found here on any machine.
#include "cpu/device_like.h"

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>

#include "core/caching_allocator.h"

namespace glm5::kernels {

namespace {

std::atomic<int> g_live_backends{0};
thread_local int t_access = 0;

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

class DeviceLikeBackend final : public Backend {
 public:
  DeviceLikeBackend() : cpu_(make_cpu_backend()), cache_(raw_block, free_block) { ++g_live_backends; }
  ~DeviceLikeBackend() override {
    for (void* p : uploads_) cache_.free(p);
    cache_.release_cached();
    --g_live_backends;
  }

  std::string name() const override { return "cpu-devicelike"; }
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
    return p;
  }
  void free(void* p) override {
    CHECK(cache_.free(p), "backend cpu-devicelike: free() of a pointer it did not allocate");
  }
  void to_device(void* dst, const void* src, size_t bytes) override {
    if (bytes == 0) return;
    CHECK(is_device_like_memory(dst, bytes) && !is_device_like_memory(src, bytes),
          "backend cpu-devicelike: to_device needs a device destination and a host source");
    std::memcpy(dst, src, bytes);
    counters_.to_device_bytes += bytes;
    ++counters_.to_device_calls;
  }
  void to_host(void* dst, const void* src, size_t bytes) override {
    if (bytes == 0) return;
    CHECK(is_device_like_memory(src, bytes) && !is_device_like_memory(dst, bytes),
          "backend cpu-devicelike: to_host needs a device source and a host destination");
    std::memcpy(dst, src, bytes);
    counters_.to_host_bytes += bytes;
    ++counters_.to_host_calls;
  }
  const void* upload(const void* host, size_t bytes) override {
    void* p = alloc(std::max<size_t>(bytes, 1));
    if (bytes) std::memcpy(p, host, bytes);
    uploads_.push_back(p);
    return p;
  }

  void gemm(const GemmParams& p) override {
    ++counters_.op_calls;
    need(p.x, "gemm x"), need(p.y, "gemm y"), need(p.w, "gemm");
    cpu_->gemm(p);
  }
  void gemm_batch(const GemmParams* ps, size_t n) override {
    ++counters_.op_calls;
    for (size_t i = 0; i < n; ++i) need(ps[i].x, "gemm x"), need(ps[i].y, "gemm y"), need(ps[i].w, "gemm");
    cpu_->gemm_batch(ps, n);
  }
  void rms_norm(const RmsNormParams& p) override {
    ++counters_.op_calls;
    need(p.x, "rms_norm x"), need(p.weight, "rms_norm weight"), need(p.y, "rms_norm y");
    cpu_->rms_norm(p);
  }
  void layer_norm(const LayerNormParams& p) override {
    ++counters_.op_calls;
    need(p.x, "layer_norm x"), need(p.weight, "layer_norm weight"), need(p.y, "layer_norm y");
    if (p.bias) need(p.bias, "layer_norm bias");
    cpu_->layer_norm(p);
  }
  void rope(const RopeParams& p) override {
    ++counters_.op_calls;
    need(p.x, "rope x"), need(p.positions, "rope positions"), need(p.inv_freq, "rope inv_freq");
    cpu_->rope(p);
  }
  void indexer_scores(const IndexerScoresParams& p) override {
    ++counters_.op_calls;
    need(p.q, "indexer q"), need(p.weights, "indexer weights"), need(p.k, "indexer k");
    need(p.q_pos, "indexer q_pos"), need(p.scores, "indexer scores"), need(p.pages, "indexer");
    cpu_->indexer_scores(p);
  }
  void topk(const TopkParams& p) override {
    ++counters_.op_calls;
    need(p.scores, "topk scores"), need(p.indices, "topk indices");
    cpu_->topk(p);
  }
  void mla_prefill(const MlaPrefillParams& p) override {
    ++counters_.op_calls;
    need(p.q, "mla_prefill q"), need(p.kv, "mla_prefill kv"), need(p.k_pe, "mla_prefill k_pe");
    need(p.q_pos, "mla_prefill q_pos"), need(p.out, "mla_prefill out");
    if (p.topk) need(p.topk, "mla_prefill topk");
    cpu_->mla_prefill(p);
  }
  void mla_decode(const MlaDecodeParams& p) override {
    ++counters_.op_calls;
    need(p.q_lat, "mla_decode q_lat"), need(p.cache, "mla_decode cache"), need(p.q_pos, "mla_decode q_pos");
    need(p.out_lat, "mla_decode out_lat"), need(p.pages, "mla_decode");
    if (p.topk) need(p.topk, "mla_decode topk");
    cpu_->mla_decode(p);
  }
  void router(const RouterParams& p) override {
    ++counters_.op_calls;
    need(p.logits, "router logits"), need(p.expert_ids, "router expert_ids");
    need(p.expert_weights, "router expert_weights");
    if (p.bias) need(p.bias, "router bias");
    cpu_->router(p);
  }
  void swiglu(const SwigluParams& p) override {
    ++counters_.op_calls;
    need(p.gate, "swiglu gate"), need(p.up, "swiglu up"), need(p.out, "swiglu out");
    cpu_->swiglu(p);
  }
  void embedding(const EmbeddingParams& p) override {
    ++counters_.op_calls;
    need(p.table, "embedding"), need(p.ids, "embedding ids"), need(p.out, "embedding out");
    cpu_->embedding(p);
  }
  void gather_rows(const GatherRowsParams& p) override {
    ++counters_.op_calls;
    need(p.src, "gather_rows src"), need(p.rows, "gather_rows rows"), need(p.dst, "gather_rows dst");
    cpu_->gather_rows(p);
  }
  void moe_combine(const MoeCombineParams& p) override {
    ++counters_.op_calls;
    need(p.expert_out, "moe_combine expert_out"), need(p.slots, "moe_combine slots");
    need(p.weights, "moe_combine weights"), need(p.out, "moe_combine out");
    cpu_->moe_combine(p);
  }
  void add(const AddParams& p) override {
    ++counters_.op_calls;
    need(p.x, "add x"), need(p.y, "add y");
    cpu_->add(p);
  }
  void copy_2d(const Copy2dParams& p) override {
    ++counters_.op_calls;
    need(p.src, "copy_2d src"), need(p.dst, "copy_2d dst");
    cpu_->copy_2d(p);
  }
  void paged_write(const PagedWriteParams& p) override {
    ++counters_.op_calls;
    need(p.src, "paged_write src"), need(p.pos, "paged_write pos"), need(p.pool, "paged_write pool");
    need(p.pages, "paged_write");
    cpu_->paged_write(p);
  }

 private:
  // An op's operand must be device memory (a null pointer with nothing to read is the op's own
  // business: it validates its parameters).
  static void need(const void* p, const char* what) {
    CHECK(!p || is_device_like_memory(p, 1), "backend cpu-devicelike: ", what,
          " is host memory; a device backend's ops take device pointers only");
  }
  static void need(const Weight& w, const char* what) {
    CHECK(!w.data || is_device_like_memory(w.data, 1), "backend cpu-devicelike: ", what,
          " weight is host memory (not uploaded)");
    CHECK(!w.scale || is_device_like_memory(w.scale, 1), "backend cpu-devicelike: ", what,
          " weight scales are host memory (not uploaded)");
  }
  static void need(const KeyPages& k, const char* what) {
    CHECK(!k.block_table || is_device_like_memory(k.block_table, 1), "backend cpu-devicelike: ",
          what, " block table is host memory");
  }

  std::unique_ptr<Backend> cpu_;
  CachingAllocator cache_;
  std::vector<void*> uploads_;
  mutable DeviceLikeCounters counters_;
};

}  // namespace

const DeviceLikeCounters* device_like_counters(const Backend& be) {
  const auto* d = dynamic_cast<const DeviceLikeBackend*>(&be);
  return d ? &d->counters() : nullptr;
}

std::unique_ptr<Backend> make_device_like_backend() { return std::make_unique<DeviceLikeBackend>(); }

bool is_device_like_memory(const void* p, size_t bytes) {
  if (!p || g_live_backends.load(std::memory_order_relaxed) == 0) return false;
  return Registry::get().contains(p, bytes);
}

DeviceLikeAccess::DeviceLikeAccess() { ++t_access; }
DeviceLikeAccess::~DeviceLikeAccess() { --t_access; }

void check_host_pointer(const void* p, size_t bytes, const char* what) {
  if (t_access > 0 || bytes == 0) return;
  CHECK(!is_device_like_memory(p, bytes), what, " was handed device memory (", bytes,
        " bytes): host communicators take host buffers only; device payloads go over the "
        "device communicator or through staging");
}

}  // namespace glm5::kernels
