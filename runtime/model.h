// The GLM-5 / DeepSeek-V3.2 model as one rank holds it: weights of its layer range (and of its
// share of each MoE layer's experts), and the forward pass over a batch of sequences, each
// contributing a chunk of new tokens (prefill) or one token (decode). The math is in glm5.cpp,
// top to bottom; this header is the interface the engine uses.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "kernels/ops.h"
#include "parallel/comm.h"
#include "runtime/config.h"
#include "runtime/kv_cache.h"
#include "runtime/profile.h"

namespace glm5::runtime {

class Checkpoint;
struct TensorSpec;

// What this rank holds of the model.
struct ModelShard {
  int first_layer = 0, last_layer = -1;  // [first, last); -1 = all layers
  bool embedding = true;                 // model.embed_tokens (stage 0)
  bool head = true;                      // model.norm + lm_head (last stage)
  int expert_parallel = 1, column = 0;   // routed experts [column*n/E, (column+1)*n/E)
  bool mtp = false;                      // the MTP layer (speculative decoding; with head)
};

// One sequence's part of a forward step: tokens at positions [start_pos, start_pos + n_tokens).
// Its rows in the activation matrix follow the previous sequence's rows. Its KV cache is its
// block table into the rank's KvPool (host ids, covering every position up to the step's end).
struct SeqStep {
  const int32_t* blocks = nullptr;
  int64_t start_pos = 0;
  int64_t n_tokens = 0;
  int64_t prompt_len = 0;  // rows at positions < min(prompt_len, index_topk) attend naively
};

// Intermediate values offered to a debug hook (tests diff them against reference dumps).
using DebugHook =
    std::function<void(const std::string& name, int layer, const void* data, DType dtype, int64_t rows, int64_t cols)>;

class Model {
 public:
  // stage_comm: the ranks of this pipeline stage (expert-parallel group); size 1 for no EP. With a
  // device backend (host_memory() false) the MoE payload goes over payload_comm (the same ranks,
  // device buffers: NCCL or a stand-in) while the plan stays on stage_comm; without one, a
  // communicator that stages through host memory is made over stage_comm.
  Model(const ModelConfig& cfg, Checkpoint& ckpt, kernels::Backend& backend, const ModelShard& shard,
        parallel::Comm& stage_comm, parallel::Comm* payload_comm = nullptr);
  ~Model();

  const ModelConfig& config() const { return cfg_; }
  const ModelShard& shard() const { return shard_; }
  kernels::Backend& backend() const { return backend_; }
  int n_local_layers() const { return shard_.last_layer - shard_.first_layer; }
  size_t weight_bytes() const { return weight_bytes_; }

  // h[m, hidden] = embedding rows of ids (host array).
  void embed(const int32_t* ids, int64_t m, float* h);
  // Runs this rank's layers over the batch, in place on h [sum n_tokens, hidden]. Every rank of
  // the stage must call it the same number of times (MoE exchanges), with an empty batch if idle.
  // topk (GLM-5.2's IndexShare across a pipeline hop): [topk_values(batch)] int32 in the backend's
  // memory, the step's top-k as the previous stage left it when this stage begins with a "shared"
  // layer (takes_topk), and as this stage leaves it for the next when that begins with one
  // (gives_topk); nullptr when neither.
  void forward(const std::vector<SeqStep>& batch, float* h, int32_t* topk = nullptr);
  static int64_t topk_values(const std::vector<SeqStep>& batch, int64_t index_topk);
  bool takes_topk() const;
  bool gives_topk() const;
  // logits[m, vocab] = lm_head(norm(h rows)); host output.
  void logits(const float* h, int64_t m, float* logits_host);
  // The two halves of logits(): out [m, hidden] = model.norm(h), and lm_head of normed rows.
  void final_norm(const float* h, int64_t m, float* out);
  void head_logits(const float* normed, int64_t m, float* logits_host);
  // The MTP layer (shard.mtp): see glm5.cpp. Its KV cache is the pool's layer n_local_layers().
  bool has_mtp() const { return mtp_ != nullptr; }
  void mtp_forward(const std::vector<SeqStep>& batch, const int32_t* next_ids, const float* hidden, float* carried);
  // x[0..n) = their maximum over the ranks of this rank's stage (a collective; as is if alone).
  void stage_max(int64_t* x, int n);
  // Layers this rank keeps KV rows for (its decoder layers and the MTP layer).
  int kv_layers() const { return n_local_layers() + (mtp_ ? 1 : 0); }

  void set_debug_hook(DebugHook hook) { debug_ = std::move(hook); }
  // Times the forward pass's phases per layer (runtime/profile.h); nullptr: off (the default).
  void set_profiler(Profiler* p) { prof_ = p; }
  Profiler* profiler() const { return prof_; }
  // The pool that forward() reads and writes KV rows in (owned by the caller).
  void set_kv_pool(KvPool* pool) { kv_pool_ = pool; }
  // Tokens routed to each local expert so far (load-balance report), and MoE bytes sent.
  const std::vector<int64_t>& expert_tokens() const { return expert_tokens_; }
  // The router's choices for the rows this rank routed, per MoE layer it holds: rows routed and
  // (row, expert) picks per global expert id; and the rows whose picks were not k distinct
  // valid experts (must stay 0).
  struct RouterLoad {
    int layer = 0;
    int64_t rows = 0;
    std::vector<int64_t> picks;  // [n_routed_experts]
  };
  const std::vector<RouterLoad>& router_load() const { return router_load_; }
  int64_t rows_not_k() const { return rows_not_k_; }
  size_t moe_bytes_sent() const;
  size_t moe_payload_bytes_sent() const;  // of which token rows and results
  double moe_comm_seconds() const { return moe_comm_seconds_; }

 private:
  struct Layer;
  struct Expert;
  struct Mtp;
  // How a matrix is used, which decides how the backend may hold it. kGemm: read whole every step
  // as y = x W^T only (the backend may copy it out of the mapping, in a layout of its own:
  // Backend::upload_gemm_matrix); kStreamed: read every step but also sliced or transposed (kept
  // row-major, may be copied); kLookup: a table only looked up (the embedding), which stays mapped.
  enum class Use { kGemm, kStreamed, kLookup };
  // Each takes its tensor's name and shape from the schema (runtime/name_table.h).
  kernels::Weight matrix(const TensorSpec& spec, Use use = Use::kGemm);
  const float* vector(const TensorSpec& spec, float scale = 1.0f);
  kernels::Weight matrix_f32_scaled(const TensorSpec& spec, float scale);
  kernels::Weight matrix_plain(const TensorSpec& spec, Use use);
  kernels::Weight owned_matrix(std::vector<float> values, int64_t rows, int64_t cols, DType dtype);
  struct Layout;
  std::unique_ptr<Layer> load_layer(int l);
  void load_mtp();
  void decoder_layer(Layer& L, int li, const Layout& layout, const int32_t* pos, int64_t m, float* h);
  void attention(Layer& L, int li, const Layout& lay, const int32_t* pos, const float* a, int64_t m, float* h);
  // Rows [row, row + n) of a step at positions [pos, pos + n) of one sequence.
  struct Span {
    const int32_t* blocks;
    int64_t row, pos, n;
  };
  void naive_attention(Layer& L, int li, const Span& sp, const float* q, const int32_t* pos, float* attn);
  void absorbed_attention(Layer& L, int li, const Layout& lay, const float* q, const float* qi, const float* iw,
                          float* attn);
  void dense_mlp(Layer& L, const float* x, int64_t m, float* y);
  void moe(Layer& L, const float* x, int64_t m, float* y);
  void moe_rows(Layer& L, const float* x, int64_t m, float* y);
  void swiglu_expert(const Expert& e, const float* x, int64_t m, float* y);
  void count_router_load(int layer, const int32_t* ids, int64_t m);
  void routed_experts(Layer& L, const float* table, const int32_t* rrow, const int32_t* rtag, int64_t n_recv,
                      float* out, std::vector<kernels::GemmParams> also);

  ModelConfig cfg_;
  Checkpoint& ckpt_;
  kernels::Backend& backend_;
  ModelShard shard_;
  parallel::Comm& stage_comm_;
  std::vector<std::unique_ptr<Layer>> layers_;
  std::unique_ptr<Mtp> mtp_;
  kernels::Weight embed_tokens_, lm_head_;
  const float* final_norm_ = nullptr;
  std::vector<float> inv_freq_host_;
  const float* inv_freq_ = nullptr;
  std::vector<std::vector<float>> owned_;  // host copies of converted vectors and matrices
  std::vector<std::vector<uint16_t>> owned_bf16_;
  size_t weight_bytes_ = 0;
  std::vector<int64_t> expert_tokens_;
  std::vector<RouterLoad> router_load_;  // one per MoE layer of this rank, in layer order
  int64_t rows_not_k_ = 0;
  double moe_comm_seconds_ = 0;
  struct Exchange;
  std::unique_ptr<Exchange> exchange_;
  DebugHook debug_;
  Profiler* prof_ = nullptr;
  KvPool* kv_pool_ = nullptr;
};

}  // namespace glm5::runtime
