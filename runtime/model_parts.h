// What the model's two files share (glm5.cpp: the forward pass; model_load.cpp: loading): the
// layer structs behind Model's pointers and the backend scratch buffer.
#pragma once

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "parallel/device_comm.h"
#include "parallel/moe_exchange.h"
#include "runtime/model.h"

namespace glm5::runtime {

using kernels::Backend;
using kernels::GemmParams;
using kernels::Weight;

// Scratch memory in the backend's address space, freed at scope exit.
template <typename T>
struct Buf {
  Backend* be = nullptr;
  T* p = nullptr;
  Buf(Backend& b, int64_t n) : be(&b), p(static_cast<T*>(b.alloc(size_t(std::max<int64_t>(n, 1)) * sizeof(T)))) {}
  ~Buf() { be->free(p); }
  Buf(const Buf&) = delete;
  Buf& operator=(const Buf&) = delete;
  Buf& operator=(Buf&& o) noexcept {
    std::swap(be, o.be);
    std::swap(p, o.p);
    return *this;
  }
  operator T*() const { return p; }
};

inline std::string layer_name(int l, const char* rest) { return "model.layers." + std::to_string(l) + "." + rest; }

struct Model::Expert {
  Weight gate_proj, up_proj, down_proj;  // [inter, hidden], [inter, hidden], [hidden, inter]
};

struct Model::Layer {
  int index = 0;
  const float *input_layernorm = nullptr, *post_attention_layernorm = nullptr;
  // MLA
  Weight q_a_proj, q_b_proj, kv_a_proj_with_mqa, kv_b_proj, o_proj;
  const float *q_a_layernorm = nullptr, *kv_a_layernorm = nullptr;
  // DSA indexer (none on a "shared" layer: it attends to the top-k its donor layer computed)
  bool indexer = true;
  Weight wq_b, wk, weights_proj;  // weights_proj pre-scaled by index_n_heads^-0.5 * index_head_dim^-0.5
  const float *k_norm_weight = nullptr, *k_norm_bias = nullptr;
  // MLP
  bool moe = false;
  Expert dense;  // dense layers
  Weight gate;   // router [n_routed_experts, hidden]
  const float* e_score_correction_bias = nullptr;
  std::vector<Expert> experts;  // this rank's routed experts, in id order
  Expert shared;                // shared experts (intermediate moe_inter * n_shared)
};

struct Model::Mtp {
  const float *enorm = nullptr, *hnorm = nullptr, *shared_head_norm = nullptr;
  Weight eh_proj;  // [hidden, 2 * hidden]: [embedding | hidden state] -> hidden
  std::unique_ptr<Layer> layer;
};

// The MoE exchange: on host memory over the stage's communicator, or, for a device backend, the
// plan over it and the payload over `payload` (a device communicator; by default one that stages
// through the host, made here).
struct Model::Exchange {
  explicit Exchange(parallel::Comm& c) : ex(c) {}
  Exchange(parallel::Comm& c, Backend& be, parallel::Comm* payload)
      : staged(payload ? nullptr : parallel::make_staged_comm(c, be)), ex(c, be, payload ? *payload : *staged) {}
  std::unique_ptr<parallel::Comm> staged;
  parallel::MoeExchange ex;
};

}  // namespace glm5::runtime
