// The GLM-5 / DeepSeek-V3.2 forward pass, top to bottom (runtime/spec/glm5.md §3):
//   embed -> [ RMSNorm -> MLA + DSA indexer -> residual -> RMSNorm -> dense MLP | MoE -> residual ]
//   x layers -> final RMSNorm -> lm_head.
// Activations are float32 [rows, features]; a batch stacks the rows of several sequences. Every
// op is row-independent, so a sequence's numbers do not depend on its batch-mates. The MoE
// exchange (all_to_all_v inside a stage) is the only communication in here; the pipeline between
// stages lives in the engine.
#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstring>
#include <optional>

#include "parallel/device_comm.h"
#include "parallel/moe_exchange.h"
#include "runtime/model_parts.h"
#include "runtime/name_table.h"
#include "runtime/safetensors.h"

namespace glm5::runtime {

// ---------------------------------------------------------------------------------------------
// Forward

void Model::embed(const int32_t* ids, int64_t m, float* h) {
  CHECK(embed_tokens_.data, "this rank does not hold model.embed_tokens");
  for (int64_t i = 0; i < m; ++i)
    CHECK(ids[i] >= 0 && ids[i] < cfg_.vocab_size, "token id ", ids[i], " at position ", i,
          " is outside the vocabulary [0, ", cfg_.vocab_size, ")");
  Buf<int32_t> d_ids(backend_, m);
  backend_.to_device(d_ids, ids, size_t(m) * sizeof(int32_t));
  backend_.embedding({embed_tokens_, d_ids, m, h});
}

// How the rows of one step attend, built once per forward (it is the same in every layer): each
// sequence's rows at positions below min(prompt length, index_topk) take the naive form, the rest
// the weight-absorbed form. The absorbed rows' positions and block tables (one per row, padded
// to the longest) go to the backend once; their indexer calls are grouped so that no scores
// block is wider than its own sequences need: a run of single-row spans (decode rows) is one
// call with a table per row, every longer span (a prefill chunk: one sequence) a call of its own.
struct Model::Layout {
  std::vector<Span> naive, absorbed;
  struct Group {
    int64_t first = 0, rows = 0, t = 0;  // absorbed rows [first, first + rows), keys they see
    bool one_table = false;              // rows of one sequence: one block table for all
  };
  std::vector<Group> groups;
  int64_t n = 0, t = 0, max_blocks = 1;  // absorbed rows, keys the longest sees, table width
  bool direct = false;                   // the absorbed rows are the step's rows, in order
  bool sparse = false;                   // some row's causal span exceeds index_topk
  Buf<int32_t> pos, tables;              // [n], [n, max_blocks]
  // The absorbed rows' top-k [n, index_topk] (when sparse): written by a layer with an indexer,
  // read by the "shared" layers after it (IndexShare); in the caller's buffer when it gives one.
  Buf<int32_t> sel_owned;
  int32_t* sel = nullptr;
  mutable int sel_layer = -1;  // the layer that computed it (-1: none yet)
  Buf<int32_t> row_tables;     // every row of the step: its sequence's table [m, row_ld]
  int64_t row_ld = 1;

  Layout(Model& model, const std::vector<SeqStep>& batch, int32_t* topk = nullptr)
      : pos(model.backend_, 1), tables(model.backend_, 1), sel_owned(model.backend_, 1), row_tables(model.backend_, 1) {
    const int64_t TOPK = model.cfg_.index_topk;
    // The cache writes of all rows: one table per row.
    int64_t m = 0;
    for (const SeqStep& s : batch) {
      m += s.n_tokens;
      row_ld = std::max(row_ld, blocks_for(s.start_pos + s.n_tokens));
    }
    std::vector<int32_t> rt(size_t(m * row_ld), 0);
    int64_t r = 0;
    for (const SeqStep& s : batch)
      for (int64_t i = 0; i < s.n_tokens; ++i, ++r)
        std::copy(s.blocks, s.blocks + blocks_for(s.start_pos + s.n_tokens), rt.begin() + r * row_ld);
    row_tables = Buf<int32_t>(model.backend_, m * row_ld);
    model.backend_.to_device(row_tables, rt.data(), rt.size() * sizeof(int32_t));
    int64_t row = 0;
    for (const SeqStep& s : batch) {
      const int64_t end = s.start_pos + s.n_tokens;
      const int64_t cut = std::clamp(std::min(s.prompt_len, TOPK), s.start_pos, end);
      if (cut > s.start_pos) naive.push_back({s.blocks, row, s.start_pos, cut - s.start_pos});
      if (end > cut) absorbed.push_back({s.blocks, row + cut - s.start_pos, cut, end - cut});
      row += s.n_tokens;
    }
    direct = naive.empty();
    for (const Span& sp : absorbed) {
      if (sp.n > 1 || groups.empty() || groups.back().one_table)  // a chunk: its own call
        groups.push_back({n, 0, 0, sp.n > 1});
      Group& g = groups.back();
      g.rows += sp.n;
      g.t = std::max(g.t, sp.pos + sp.n);
      n += sp.n;
      t = std::max(t, sp.pos + sp.n);
      max_blocks = std::max(max_blocks, blocks_for(sp.pos + sp.n));
    }
    sparse = t > TOPK;
    CHECK(sparse == (topk_values(batch, TOPK) > 0), "internal: Layout and topk_values disagree");
    if (sparse && !topk) sel_owned = Buf<int32_t>(model.backend_, n * TOPK);
    if (sparse) sel = topk ? topk : sel_owned.p;
    std::vector<int32_t> pos_host, table_host(size_t(n * max_blocks), 0);
    for (const Span& sp : absorbed)
      for (int64_t i = 0; i < sp.n; ++i) {
        std::copy(sp.blocks, sp.blocks + blocks_for(sp.pos + sp.n),
                  table_host.begin() + int64_t(pos_host.size()) * max_blocks);
        pos_host.push_back(int32_t(sp.pos + i));
      }
    pos = Buf<int32_t>(model.backend_, n);
    tables = Buf<int32_t>(model.backend_, n * max_blocks);
    model.backend_.to_device(pos, pos_host.data(), pos_host.size() * sizeof(int32_t));
    model.backend_.to_device(tables, table_host.data(), table_host.size() * sizeof(int32_t));
  }
};

// The positions of a step's rows, in the backend's memory; m = the step's rows.
static std::vector<int32_t> row_positions(const std::vector<SeqStep>& batch) {
  std::vector<int32_t> pos;
  for (const SeqStep& s : batch) {
    CHECK(s.blocks || s.n_tokens == 0, "internal: a sequence without a block table");
    for (int64_t i = 0; i < s.n_tokens; ++i) pos.push_back(int32_t(s.start_pos + i));
  }
  return pos;
}

// The absorbed rows of a step (Layout: positions at or past min(prompt length, index_topk)) and, when
// some row's causal span exceeds index_topk (the indexer then drops keys), their top-k's values.
int64_t Model::topk_values(const std::vector<SeqStep>& batch, int64_t topk) {
  int64_t n = 0, t = 0;
  for (const SeqStep& s : batch) {
    const int64_t end = s.start_pos + s.n_tokens;
    const int64_t cut = std::clamp(std::min(s.prompt_len, topk), s.start_pos, end);
    if (end > cut) n += end - cut, t = std::max(t, end);
  }
  return t > topk ? n * topk : 0;
}

bool Model::takes_topk() const { return !cfg_.has_indexer(shard_.first_layer); }
bool Model::gives_topk() const {
  return shard_.last_layer < cfg_.num_hidden_layers && !cfg_.has_indexer(shard_.last_layer);
}

void Model::forward(const std::vector<SeqStep>& batch, float* h, int32_t* topk) {
  CHECK(kv_pool_ || batch.empty() || layers_.empty(), "internal: Model::forward without a KV pool");
  const std::vector<int32_t> pos_host = row_positions(batch);
  const int64_t m = int64_t(pos_host.size());
  Buf<int32_t> pos(backend_, m);
  backend_.to_device(pos, pos_host.data(), size_t(m) * sizeof(int32_t));
  CHECK(topk || !takes_topk() || topk_values(batch, cfg_.index_topk) == 0, "internal: layer ", shard_.first_layer,
        " shares the top-k of layer ", cfg_.indexer_donor(shard_.first_layer),
        " on an earlier stage, which did not come");
  const Layout layout(*this, batch, topk);  // how each row attends: the same in every layer
  if (topk && takes_topk()) layout.sel_layer = int(cfg_.indexer_donor(shard_.first_layer));  // it came with h
  for (size_t li = 0; li < layers_.size(); ++li) decoder_layer(*layers_[li], int(li), layout, pos, m, h);
}

// h [m, hidden] += Attention(RMSNorm(h)); h += MLP(RMSNorm(h)). li: the layer's index in the KV pool.
void Model::decoder_layer(Layer& L, int li, const Layout& layout, const int32_t* pos, int64_t m, float* h) {
  const int64_t H = cfg_.hidden_size;
  Buf<float> a(backend_, m * H), y(backend_, m * H);
  backend_.rms_norm({h, H, L.input_layernorm, a, H, m, H, float(cfg_.rms_norm_eps)});
  attention(L, li, layout, pos, a, m, h);
  backend_.rms_norm({h, H, L.post_attention_layernorm, a, H, m, H, float(cfg_.rms_norm_eps)});
  if (L.moe)
    moe(L, a, m, y);
  else
    dense_mlp(L, a, m, y);
  backend_.add({y, h, m * H});
  if (debug_) debug_("layer_output", L.index, h, DType::F32, m, H);
}

// One MTP draft step over a batch (spec §3.9), rows at the batch's positions: row i takes the
// embedding of next_ids[i] (host) and hidden[i] (the main model's normed final hidden state, or
// the previous draft step's carried state), and leaves carried[i] = shared_head.norm(z) (the state
// the next draft step takes; lm_head of it gives the draft logits: head_logits). Its KV rows go to
// the pool's last layer. Every rank of the stage calls it the same number of times (MoE).
void Model::mtp_forward(const std::vector<SeqStep>& batch, const int32_t* next_ids, const float* hidden,
                        float* carried) {
  CHECK(mtp_, "internal: Model::mtp_forward on a rank without the MTP layer");
  const int64_t H = cfg_.hidden_size;
  const std::vector<int32_t> pos_host = row_positions(batch);
  const int64_t m = int64_t(pos_host.size());
  if (m == 0 && stage_comm_.size() == 1) return;  // no exchange to pair up
  // (The layer's own phases are timed under its index, num_hidden_layers; this is its input.)
  std::optional<Profiler::Scope> span(std::in_place, prof_, "mtp_input", int(cfg_.num_hidden_layers));
  Buf<int32_t> pos(backend_, m);
  backend_.to_device(pos, pos_host.data(), size_t(m) * sizeof(int32_t));
  const Layout layout(*this, batch);
  Buf<float> e(backend_, m * H), cat(backend_, m * 2 * H), z(backend_, m * H);
  if (m > 0) embed(next_ids, m, e);
  // cat = [enorm(e) | hnorm(hidden)]  [m, 2H]: the embedding first; z = eh_proj cat
  backend_.rms_norm({e, H, mtp_->enorm, cat, 2 * H, m, H, float(cfg_.rms_norm_eps)});
  backend_.rms_norm({hidden, H, mtp_->hnorm, cat + H, 2 * H, m, H, float(cfg_.rms_norm_eps)});
  backend_.gemm({cat, 2 * H, mtp_->eh_proj, false, z, H, m, H, 2 * H});
  span.reset();
  decoder_layer(*mtp_->layer, int(layers_.size()), layout, pos, m, z);
  backend_.rms_norm({z, H, mtp_->shared_head_norm, carried, H, m, H, float(cfg_.rms_norm_eps)});
}

// Positions [0, n) of a paged pool into dst [n, width] (contiguous float32).
static void read_paged(Backend& be, const void* pool, DType dtype, int64_t width, const int32_t* blocks, int64_t n,
                       float* dst) {
  for (int64_t t = 0; t < n; t += kBlockTokens) {
    const int64_t k = std::min(kBlockTokens, n - t);
    const void* src = static_cast<const char*>(pool) +
                      size_t(int64_t(blocks[t / kBlockTokens]) * kBlockTokens * width) * dtype_size(dtype);
    be.copy_2d({src, width, dst + t * width, width, k, width, dtype, DType::F32});
  }
}

// Naive ("MHA mode") attention of rows [sp.row, sp.row + sp.n) at positions sp.pos onwards, all
// within index_topk of the start (dense): the kv_b_proj expansion of their <= index_topk keys.
void Model::naive_attention(Layer& L, int li, const Span& sp, const float* q, const int32_t* pos, float* attn) {
  const int64_t NH = cfg_.num_attention_heads, dn = cfg_.qk_nope_head_dim, dr = cfg_.qk_rope_head_dim;
  const int64_t dv = cfg_.v_head_dim, R = cfg_.kv_lora_rank, LAT = R + dr, DQ = dn + dr, DKV = dn + dv;
  const int64_t T = sp.pos + sp.n;  // keys the last row sees
  Backend& be = backend_;
  Buf<float> lat(be, T * LAT), kvx(be, T * NH * DKV);
  read_paged(be, kv_pool_->latent(li), kv_pool_->dtype(), LAT, sp.blocks, T, lat);
  be.gemm({lat, LAT, L.kv_b_proj, false, kvx, NH * DKV, T, NH * DKV, R});
  be.mla_prefill({q + sp.row * NH * DQ, kvx, lat + R, LAT, pos + sp.row, nullptr, 0, attn + sp.row * NH * dv, sp.n, T,
                  NH, dn, dr, dv, cfg_.softmax_scale()});
}

// Weight-absorbed ("MQA mode") attention of the layout's absorbed rows (any sequences, any
// positions): W_UK is absorbed into their queries (one GEMM per head over all of them), every row
// scores its sequence's cached indexer keys and keeps its top-k (when some row's causal span
// exceeds index_topk; for the others top-k keeps every causal key, which is dense attention),
// attends over its sequence's latent cache through its own block table (one call for all rows),
// and W_UV expands the results into attn [m, NH, v_head_dim] (one GEMM per head). The rows are
// gathered first unless they are all the step's rows in order.
void Model::absorbed_attention(Layer& L, int li, const Layout& lay, const float* q, const float* qi, const float* iw,
                               float* attn) {
  const int64_t NH = cfg_.num_attention_heads, dn = cfg_.qk_nope_head_dim, dr = cfg_.qk_rope_head_dim;
  const int64_t dv = cfg_.v_head_dim, R = cfg_.kv_lora_rank, LAT = R + dr, DQ = dn + dr, DKV = dn + dv;
  const int64_t IH = cfg_.index_n_heads, ID = cfg_.index_head_dim, TOPK = cfg_.index_topk;
  const int64_t n = lay.n;
  Backend& be = backend_;
  const int64_t ni = lay.direct || !L.indexer ? 1 : n;  // gathered indexer inputs (none on a shared layer)
  Buf<float> gq(be, lay.direct ? 1 : n * NH * DQ), gqi(be, ni * IH * ID);
  Buf<float> giw(be, ni * IH), gattn(be, lay.direct ? 1 : n * NH * dv);
  const float *rq = q, *rqi = qi, *riw = iw;
  float* rattn = attn;
  if (!lay.direct) {
    int64_t at = 0;
    for (const Span& sp : lay.absorbed) {
      be.copy_2d({q + sp.row * NH * DQ, NH * DQ, gq + at * NH * DQ, NH * DQ, sp.n, NH * DQ});
      if (L.indexer) {
        be.copy_2d({qi + sp.row * IH * ID, IH * ID, gqi + at * IH * ID, IH * ID, sp.n, IH * ID});
        be.copy_2d({iw + sp.row * IH, IH, giw + at * IH, IH, sp.n, IH});
      }
      at += sp.n;
    }
    rq = gq, rqi = gqi, riw = giw, rattn = gattn;
  }
  Buf<float> q_lat(be, n * NH * LAT), o_lat(be, n * NH * R);
  std::optional<Profiler::Scope> span(std::in_place, prof_, "q_absorb", L.index);
  std::vector<GemmParams> per_head(static_cast<size_t>(NH));  // one gemm per head, all heads in one batch
  for (int64_t hd = 0; hd < NH; ++hd) {
    // q_lat[:, hd, 0:R] = q_nope[:, hd] · W_UK[hd]  (W_UK[hd] = kv_b rows hd*DKV + [0, dn))
    per_head[size_t(hd)] = {
        rq + hd * DQ, NH * DQ, L.kv_b_proj.slice_rows(hd * DKV, dn), true, q_lat + hd * LAT, NH * LAT, n, R, dn};
    be.copy_2d({rq + hd * DQ + dn, NH * DQ, q_lat + hd * LAT + R, NH * LAT, n, dr});
  }
  be.gemm_batch(per_head);
  int32_t* const sel = lay.sel;
  if (lay.sparse && !L.indexer) {  // a "shared" layer: its donor's selection (spec §1.6, IndexShare)
    CHECK(lay.sel_layer >= 0 && lay.sel_layer == cfg_.indexer_donor(L.index), "internal: layer ", L.index,
          " shares the top-k of layer ", cfg_.indexer_donor(L.index), ", which did not run before it on this rank");
  } else if (lay.sparse) {
    lay.sel_layer = L.index;
    for (const Layout::Group& g : lay.groups) {
      const int32_t* table = lay.tables + g.first * lay.max_blocks;
      const kernels::KeyPages pages{table, g.one_table ? 0 : lay.max_blocks, kBlockTokens, kv_pool_->dtype(),
                                    kv_pool_->index_tiles()};
      Buf<float> scores(be, g.rows * g.t);
      span.emplace(prof_, "indexer_scores", L.index);
      be.indexer_scores({rqi + g.first * IH * ID, riw + g.first * IH, static_cast<const float*>(kv_pool_->index_k(li)),
                         lay.pos + g.first, scores, g.rows, g.t, IH, ID, g.t, pages});
      span.emplace(prof_, "topk", L.index);
      be.topk({scores, g.rows, g.t, g.t, TOPK, sel + g.first * TOPK});
    }
  }
  if (debug_ && lay.sparse) {
    int64_t at = 0;
    for (const Span& sp : lay.absorbed) {
      if (sp.pos + sp.n > TOPK) debug_("indexer_topk", L.index, sel + at * TOPK, DType::I32, sp.n, TOPK);
      at += sp.n;
    }
  }
  span.emplace(prof_, "attention", L.index);
  be.mla_decode({q_lat, static_cast<const float*>(kv_pool_->latent(li)), lay.pos, lay.sparse ? sel : nullptr, TOPK,
                 o_lat, n, lay.t, NH, R, dr, cfg_.softmax_scale(),
                 kernels::KeyPages{lay.tables, lay.max_blocks, kBlockTokens, kv_pool_->dtype()}});
  span.emplace(prof_, "v_absorb", L.index);
  for (int64_t hd = 0; hd < NH; ++hd)  // o[:, hd] = W_UV[hd] o_lat[:, hd]
    per_head[size_t(hd)] = {
        o_lat + hd * R, NH * R, L.kv_b_proj.slice_rows(hd * DKV + dn, dv), false, rattn + hd * dv, NH * dv, n, dv, R};
  be.gemm_batch(per_head);
  if (!lay.direct) {
    int64_t at = 0;
    for (const Span& sp : lay.absorbed) {
      be.copy_2d({gattn + at * NH * dv, NH * dv, attn + sp.row * NH * dv, NH * dv, sp.n, NH * dv});
      at += sp.n;
    }
  }
}

// MLA with the DSA indexer (spec §3.3-3.6). Writes this step's latent and indexer keys into the
// sequences' blocks, then attends: rows at positions below min(prompt length, index_topk) (prompt
// rows whose whole causal span is attended) through the naive form, every other row (decode,
// and prompt rows with a sparse selection) through the weight-absorbed form over the latent
// cache. Which form a row takes depends only on its position and its prompt's length, never on
// chunking, batching or preemption. Adds o_proj(attention) to h.
void Model::attention(Layer& L, int li, const Layout& lay, const int32_t* pos, const float* a, int64_t m, float* h) {
  const int64_t H = cfg_.hidden_size, NH = cfg_.num_attention_heads, QR = cfg_.q_lora_rank;
  const int64_t dn = cfg_.qk_nope_head_dim, dr = cfg_.qk_rope_head_dim, dv = cfg_.v_head_dim;
  const int64_t R = cfg_.kv_lora_rank, LAT = R + dr, DQ = dn + dr;
  const int64_t IH = cfg_.index_n_heads, ID = cfg_.index_head_dim;
  const float rope_scale = cfg_.rope_cos_sin_scale();
  const float eps_lora = 1e-6f;  // q_a_layernorm / kv_a_layernorm (HF class default)
  Backend& be = backend_;

  // c_q = RMSNorm(W_qa a)  [m, q_lora_rank]; q = W_qb c_q  [m, NH, nope | rope]
  // The projections of a, in one batch of gemms (they share the input):
  //   c_q = W_qa a [m, q_lora_rank]; kv = W_kva a [m, c_kv | k_pe];
  //   indexer ki = W_ik a [m, rope | nope]; iw = weights_proj(a) [m, IH] (pre-scaled).
  // (A "shared" layer has no indexer: no qi, ki, iw.)
  const int64_t mi = L.indexer ? m : 0;
  Buf<float> c_q(be, m * QR), q(be, m * NH * DQ), kv(be, m * LAT);
  Buf<float> qi(be, mi * IH * ID), ki(be, mi * ID), iw(be, mi * IH);
  std::optional<Profiler::Scope> span(std::in_place, prof_, "projections", L.index);
  std::vector<GemmParams> first{{a, H, L.q_a_proj, false, c_q, QR, m, QR, H},
                                {a, H, L.kv_a_proj_with_mqa, false, kv, LAT, m, LAT, H}};
  if (L.indexer) {
    first.push_back({a, H, L.wk, false, ki, ID, m, ID, H});
    first.push_back({a, H, L.weights_proj, false, iw, IH, m, IH, H});
  }
  be.gemm_batch(first);
  // c_q = RMSNorm(c_q); then from it q = W_qb c_q [m, NH, nope | rope] and the indexer's
  // qi = W_iq c_q [m, IH, rope | nope] (the indexer's rope slice comes FIRST).
  be.rms_norm({c_q, QR, L.q_a_layernorm, c_q, QR, m, QR, eps_lora});
  std::vector<GemmParams> second{{c_q, QR, L.q_b_proj, false, q, NH * DQ, m, NH * DQ, QR}};
  if (L.indexer) second.push_back({c_q, QR, L.wq_b, false, qi, IH * ID, m, IH * ID, QR});
  be.gemm_batch(second);
  be.rope({q, m, NH, NH * DQ, DQ, dn, dr, pos, inv_freq_, rope_scale, cfg_.rope_interleave});
  // c_kv = RMSNorm(c_kv); k_pe = RoPE(k_pe) (one head); ki = RoPE(LayerNorm(ki)); qi = RoPE(qi)
  be.rms_norm({kv, LAT, L.kv_a_layernorm, kv, LAT, m, R, eps_lora});
  be.rope({kv, m, 1, LAT, LAT, R, dr, pos, inv_freq_, rope_scale, cfg_.rope_interleave});
  if (L.indexer) {
    be.rope({qi, m, IH, IH * ID, ID, 0, dr, pos, inv_freq_, rope_scale, cfg_.indexer_rope_interleave});
    be.layer_norm({ki, ID, L.k_norm_weight, L.k_norm_bias, ki, ID, m, ID, 1e-6f});
    be.rope({ki, m, 1, ID, ID, 0, dr, pos, inv_freq_, rope_scale, cfg_.indexer_rope_interleave});
  }
  if (m > 0) span.emplace(prof_, "kv_write", L.index);

  // This step's keys into each sequence's blocks (one call per cache for all rows), then
  // attention in the layout's two forms.
  if (m > 0) {
    const kernels::KeyPages rows{lay.row_tables, lay.row_ld, kBlockTokens, kv_pool_->dtype()};
    kernels::KeyPages index_rows = rows;
    index_rows.tiled = kv_pool_->index_tiles();
    be.paged_write({kv, LAT, pos, kv_pool_->latent(li), m, LAT, rows});
    if (L.indexer) be.paged_write({ki, ID, pos, kv_pool_->index_k(li), m, ID, index_rows});
  }
  span.reset();
  Buf<float> attn(be, m * NH * dv);  // [m, NH, v_head_dim]
  if (lay.n > 0) absorbed_attention(L, li, lay, q, qi, iw, attn);
  if (!lay.naive.empty()) span.emplace(prof_, "attention_naive", L.index);
  for (const Span& sp : lay.naive) naive_attention(L, li, sp, q, pos, attn);
  // h += W_o attn
  span.emplace(prof_, "o_proj", L.index);
  be.gemm({attn, NH * dv, L.o_proj, false, h, H, m, H, NH * dv, /*accumulate=*/true});
}

// y = W_down (silu(W_gate x) * W_up x)
void Model::swiglu_expert(const Expert& e, const float* x, int64_t m, float* y) {
  const int64_t H = cfg_.hidden_size, I = e.gate_proj.rows;
  Buf<float> g(backend_, m * I), u(backend_, m * I);
  backend_.gemm_batch(
      std::array<GemmParams, 2>{{{x, H, e.gate_proj, false, g, I, m, I, H}, {x, H, e.up_proj, false, u, I, m, I, H}}});
  backend_.swiglu({g, u, I, g, I, m, I});
  backend_.gemm({g, I, e.down_proj, false, y, H, m, H, I});
}

// On a host backend the MLPs take a long step's rows in blocks of at most kMlpBlockRows. Their
// intermediates (the dense MLP's gate and up, [m, intermediate_size] each; the MoE exchange's slot
// rows and results, [m * top_k, hidden_size]: 670 MB for an 8192-token step of a 2048-wide model)
// are then a fraction as large, and a process pays for each fresh page of them once, on first
// touch (page faults and clearing): a 32 x 256-token batch job on speed-a peaks at 2,514 MiB
// instead of 3,235. Every op is row by row, so the bits are the same. A device backend keeps one
// pass: there each block would stream the layer's weights again, and its cache allocates once.
constexpr int64_t kMlpBlockRows = 2048;

void Model::dense_mlp(Layer& L, const float* x, int64_t m, float* y) {
  Profiler::Scope span(prof_, "dense_mlp", L.index);
  const int64_t H = cfg_.hidden_size, block = backend_.host_memory() ? kMlpBlockRows : std::max<int64_t>(m, 1);
  for (int64_t r0 = 0; r0 < m; r0 += block) swiglu_expert(L.dense, x + r0 * H, std::min(block, m - r0), y + r0 * H);
}

// MoE over rows [0, m), in blocks of kMlpBlockRows on a host backend's one-rank stage. A stage of
// several ranks keeps one exchange per layer and step (its ranks would first have to agree on a
// block count), and so does a debug dump (one call per layer and step).
void Model::moe(Layer& L, const float* x, int64_t m, float* y) {
  const int64_t H = cfg_.hidden_size;
  if (stage_comm_.size() > 1 || !backend_.host_memory() || debug_ || m <= kMlpBlockRows) return moe_rows(L, x, m, y);
  for (int64_t r0 = 0; r0 < m; r0 += kMlpBlockRows)
    moe_rows(L, x + r0 * H, std::min(kMlpBlockRows, m - r0), y + r0 * H);
}

// MoE (spec §3.8): route every row, send rows to the ranks owning their experts (all_to_all_v in
// the stage; a one-rank stage only sorts indices), run each local expert on its rows, bring
// results back and combine them in expert-id order, then add the shared expert.
void Model::moe_rows(Layer& L, const float* x, int64_t m, float* y) {
  const int64_t H = cfg_.hidden_size, E = cfg_.n_routed_experts, K = cfg_.num_experts_per_tok;
  const int64_t per = E / shard_.expert_parallel;
  Backend& be = backend_;
  Buf<float> logits(be, m * E), weights(be, m * K);
  Buf<int32_t> ids(be, m * K);
  // The router's gemm, with the shared expert's gate and up (same input) in its batch.
  const int64_t IS = cfg_.n_shared_experts > 0 ? L.shared.gate_proj.rows : 0;
  Buf<float> sg(be, m * IS), su(be, m * IS), s(be, IS > 0 ? m * H : 1);
  std::optional<Profiler::Scope> span(std::in_place, prof_, "router", L.index);  // with the shared gate / up
  std::vector<GemmParams> first{{x, H, L.gate, false, logits, E, m, E, H}};
  if (IS > 0) {
    first.push_back({x, H, L.shared.gate_proj, false, sg, IS, m, IS, H});
    first.push_back({x, H, L.shared.up_proj, false, su, IS, m, IS, H});
  }
  be.gemm_batch(first);
  be.router({logits, L.e_score_correction_bias, m, E, K, cfg_.n_group, cfg_.topk_group, cfg_.norm_topk_prob,
             float(cfg_.routed_scaling_factor), ids, weights});
  if (debug_) debug_("moe_experts", L.index, ids, DType::I32, m, K);

  // Destination rank (column of the stage) and local expert id of every (token, slot): the
  // exchange's plan, built on the host from the expert ids (the only bytes read back here).
  std::vector<int32_t> ids_host(size_t(m * K)), dest(size_t(m * K)), tag(size_t(m * K));
  be.to_host(ids_host.data(), ids, ids_host.size() * sizeof(int32_t));
  count_router_load(L.index, ids_host.data(), m);
  for (size_t i = 0; i < ids_host.size(); ++i) {
    dest[i] = int32_t(ids_host[i] / per);
    tag[i] = int32_t(ids_host[i] % per);
  }
  span.emplace(prof_, "dispatch", L.index);
  auto t0 = std::chrono::steady_clock::now();
  auto& ex = exchange_->ex;
  ex.dispatch(x, m, H, K, dest.data(), tag.data());
  moe_comm_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

  // Received slots come grouped by local expert (tag ascending); slot i's row is row
  // recv_row[i] of the table (each token once per source). The experts write their outputs in
  // slot order into the exchange's results; the shared expert's down gemm runs with theirs.
  // Table, results and the index arrays the kernels read are in the backend's memory.
  span.emplace(prof_, "experts", L.index);  // routed experts, with the shared expert's down
  std::vector<GemmParams> shared_down;
  if (IS > 0) {
    be.swiglu({sg, su, IS, sg, IS, m, IS});
    shared_down.push_back({sg, IS, L.shared.down_proj, false, s, H, m, H, IS});
  }
  routed_experts(L, ex.recv_table(), ex.recv_row_payload(), ex.recv_tag(), ex.recv_count(), ex.results(), shared_down);
  span.emplace(prof_, "combine", L.index);
  t0 = std::chrono::steady_clock::now();
  ex.combine();
  moe_comm_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

  // y = sum_j w[t, j] * result[t, j] (j in expert-id order) + shared(x)
  be.moe_combine({ex.result_rows(), ex.slot_row_payload(), weights, y, m, K, H, false});
  if (IS > 0) be.add({s, y, m * H});
}

// The router monitor: picks per expert of this layer, and rows whose K picks are not K distinct
// experts in range (a routing bug; the report says how many).
void Model::count_router_load(int layer, const int32_t* ids, int64_t m) {
  const int64_t E = cfg_.n_routed_experts, K = cfg_.num_experts_per_tok;
  auto it =
      std::find_if(router_load_.begin(), router_load_.end(), [&](const RouterLoad& r) { return r.layer == layer; });
  if (it == router_load_.end()) return;
  it->rows += m;
  std::vector<int32_t> row(static_cast<size_t>(K));
  for (int64_t i = 0; i < m; ++i) {
    std::copy(ids + i * K, ids + (i + 1) * K, row.begin());
    std::sort(row.begin(), row.end());
    const bool ok = row.front() >= 0 && row.back() < E && std::adjacent_find(row.begin(), row.end()) == row.end();
    if (!ok) ++rows_not_k_;
    for (int32_t e : row)
      if (e >= 0 && e < E) ++it->picks[size_t(e)];
  }
}

// The local experts over the received slots (grouped by local expert, tag ascending; slot i's
// input is row rrow[i] of table): out[i] = expert(rtag[i])(row). In chunks of at most
// kExpertChunkRows slots: the chunk's rows are gathered once, the gate and up gemms of every
// expert in it run as one batch, one swiglu, then the down gemms as one batch (with `also`, gemms
// to run alongside the first, e.g. the shared expert's down). Decode's 8 experts: 2 batches. Every
// gemm here goes through gemm_grouped (a backend may run a batch as one grouped launch), so each
// expert weight, and the shared expert's down, always takes the same route.
void Model::routed_experts(Layer& L, const float* table, const int32_t* rrow, const int32_t* rtag, int64_t n_recv,
                           float* out, std::vector<GemmParams> also) {
  constexpr int64_t kExpertChunkRows = 2048;
  Backend& be = backend_;
  if (n_recv == 0) {  // no routed rows here this step
    be.gemm_grouped(also);
    return;
  }
  const int64_t H = cfg_.hidden_size, I = L.experts.front().gate_proj.rows;  // moe_intermediate_size
  const int64_t rows = std::min(n_recv, kExpertChunkRows);
  Buf<float> in(be, rows * H), g(be, rows * I), u(be, rows * I);
  for (int64_t c0 = 0; c0 < n_recv; c0 += kExpertChunkRows) {
    const int64_t c1 = std::min(n_recv, c0 + kExpertChunkRows);
    std::vector<GemmParams> up, down = std::move(also);
    also.clear();
    be.gather_rows({table, rrow + c0, c1 - c0, H, in});
    for (int64_t i = c0; i < c1;) {  // runs of one expert within the chunk
      int64_t j = i;
      while (j < c1 && rtag[j] == rtag[i]) ++j;
      const Expert& e = L.experts[size_t(rtag[i])];
      const int64_t r = i - c0, n = j - i;
      expert_tokens_[size_t(rtag[i])] += n;
      up.push_back({in + r * H, H, e.gate_proj, false, g + r * I, I, n, I, H});
      up.push_back({in + r * H, H, e.up_proj, false, u + r * I, I, n, I, H});
      down.push_back({g + r * I, I, e.down_proj, false, out + i * H, H, n, H, I});
      i = j;
    }
    be.gemm_grouped(up);
    be.swiglu({g, u, I, g, I, c1 - c0, I});
    be.gemm_grouped(down);
  }
}

void Model::stage_max(int64_t* x, int n) {
  if (stage_comm_.size() > 1) stage_comm_.all_reduce(x, n, parallel::ReduceDType::I64, parallel::ReduceOp::Max);
}

void Model::final_norm(const float* h, int64_t m, float* out) {
  CHECK(shard_.head, "this rank does not hold model.norm");
  const int64_t H = cfg_.hidden_size;
  backend_.rms_norm({h, H, final_norm_, out, H, m, H, float(cfg_.rms_norm_eps)});
  if (debug_) debug_("final_hidden", -1, out, DType::F32, m, H);
}

void Model::head_logits(const float* normed, int64_t m, float* logits_host) {
  CHECK(shard_.head, "this rank does not hold lm_head");
  const int64_t H = cfg_.hidden_size, V = cfg_.vocab_size;
  Buf<float> out(backend_, m * V);
  Profiler::Scope span(prof_, "lm_head", -1);
  backend_.gemm({normed, H, lm_head_, false, out, V, m, V, H});
  backend_.to_host(logits_host, out, size_t(m * V) * sizeof(float));
}

void Model::logits(const float* h, int64_t m, float* logits_host) {
  Buf<float> n(backend_, m * cfg_.hidden_size);
  final_norm(h, m, n);
  head_logits(n, m, logits_host);
}

}  // namespace glm5::runtime
