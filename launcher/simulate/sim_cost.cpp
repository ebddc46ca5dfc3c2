// FLOPs, bytes and kernel calls of each forward-pass phase (see sim_cost.h). The formulas follow
// runtime/glm5.cpp: which rows take the naive form and which the weight-absorbed one, when the
// indexer runs (some row's span exceeds index_topk), what each GEMM multiplies.
#include "launcher/simulate/sim_cost.h"

#include <algorithm>
#include <cmath>

#include "parallel/grid.h"

namespace glm5::launcher {

// The GEMM rate at `rows`: the small-GEMM rate up to 16 rows, the large one from 256, geometric in
// between (a GEMM of few rows spends its FMAs on fewer accumulators per loaded weight).
static double gemm_rate(const Rates& r, double rows) {
  if (rows >= 256 || r.gemm_flops_small >= r.gemm_flops) return r.gemm_flops;
  if (rows <= 16) return r.gemm_flops_small;
  return r.gemm_flops_small * std::pow(r.gemm_flops / r.gemm_flops_small, std::log(rows / 16) / std::log(16.0));
}

// The roofline with imperfect overlap: sqrt(compute^2 + memory^2), between max (perfect overlap)
// and the sum (none); a GEMM of a few rows, where the two are close, measures near it (BENCHMARKS.md).
double Work::seconds(const Rates& r) const {
  const double compute = flops / (attention_unit ? r.attention_flops : gemm_rate(r, rows)) + scanned / r.topk_rate;
  const double memory = bytes / (attention_unit && r.attention_mem_bw > 0 ? r.attention_mem_bw : r.mem_bw);
  return std::sqrt(compute * compute + memory * memory) + calls * r.op_overhead_s;
}

StepCost::StepCost(const runtime::ModelConfig& cfg, const runtime::WeightPlan& plan, int expert_parallel,
                   std::vector<std::vector<double>> expert_share, double kv_bytes)
    : cfg_(cfg), E_(expert_parallel), kv_bytes_(kv_bytes), share_(std::move(expert_share)) {
  for (size_t i = 0; i < plan.tensors.size(); ++i) bytes_[plan.tensors[i].name] = double(plan.resident[i]);
  if (cfg.tie_word_embeddings) bytes_["lm_head.weight"] = double(plan.tied_head_bytes);
}

double StepCost::bytes(int layer, const std::string& name) const {
  const std::string full = layer < 0 ? name : "model.layers." + std::to_string(layer) + "." + name;
  auto it = bytes_.find(full);
  return it == bytes_.end() ? 0.0 : it->second;
}

double StepCost::share(int layer, int expert) const {
  if (size_t(layer) < share_.size() && !share_[size_t(layer)].empty()) return share_[size_t(layer)][size_t(expert)];
  return 1.0 / double(cfg_.n_routed_experts);
}

namespace {

// The attention work of one step's sequences: rows below min(prompt_len, index_topk) attend
// naively (kv_b expands their prefix, then dense causal attention), the rest in the absorbed form
// (indexer scores and top-k when sparse, attention over the latent cache, the q / v absorptions).
struct AttentionWork {
  Work qabs, scores, topk, att, vabs, naive_gemm, naive_att;
  double n_abs = 0;     // absorbed rows
  bool sparse = false;  // some row's causal span exceeds index_topk
};

// kv_b: kv_b_proj's resident bytes; kv_bytes: bytes per cached KV value.
AttentionWork attention_work(const runtime::ModelConfig& cfg, const std::vector<SimSeq>& seqs, double kv_b,
                             double kv_bytes) {
  const double NH = double(cfg.num_attention_heads), R = double(cfg.kv_lora_rank);
  const double dr = double(cfg.qk_rope_head_dim), dn = double(cfg.qk_nope_head_dim), dv = double(cfg.v_head_dim);
  const double IH = double(cfg.index_n_heads), ID = double(cfg.index_head_dim);
  const double LAT = R + dr, DQ = dn + dr, DKV = dn + dv;
  const int64_t TOPK = cfg.index_topk;
  AttentionWork w;
  w.naive_gemm.rows = 0;
  bool decode_group = false;
  double decode_rows = 0, decode_t = 0;
  for (const SimSeq& s : seqs) {
    const int64_t end = s.start + s.n, cut = std::clamp(std::min(s.prompt_len, TOPK), s.start, end);
    if (cut > s.start) {  // kv_b expands the whole prefix, then dense causal attention
      const double T = double(cut), rows = double(cut - s.start);
      w.naive_gemm.flops += 2 * T * NH * DKV * R;
      w.naive_gemm.bytes += kv_b + T * LAT * kv_bytes + T * NH * DKV * 4 * 2;
      w.naive_att.flops += 2 * NH * (DQ + dv) * (rows * (double(s.start) + double(cut) + 1) / 2);
      w.naive_gemm.calls += 2;
      w.naive_gemm.rows = std::max(w.naive_gemm.rows, T);
      w.naive_att.calls += 1;
    }
    if (end > cut) {
      const double rows = double(end - cut);
      w.n_abs += rows;
      if (end > TOPK) w.sparse = true;
      // Per absorbed row at position p: p + 1 indexer keys, min(p + 1, w.topk) attended keys.
      const double keys_sum = rows * (double(cut) + double(end) + 1) / 2;
      double att_keys = 0;
      for (int64_t p = cut; p < end; ++p) att_keys += double(std::min<int64_t>(p + 1, TOPK));
      w.scores.flops += 2 * keys_sum * IH * ID;  // the kernel skips keys past each row's position
      w.att.flops += 2 * att_keys * NH * (LAT + R);
      const bool one_row = s.n == 1;
      // A decode row reads its own sequence's keys; a prefill chunk's rows share them (cached).
      w.scores.bytes += (one_row ? keys_sum : double(end)) * ID * kv_bytes;
      w.att.bytes += (one_row ? att_keys : double(end)) * LAT * kv_bytes;
      // Top-k scans every column of its call's score block: a chunk's rows x its keys; the decode
      // rows share one block as wide as the longest of them (runtime/glm5.cpp, Layout groups).
      if (one_row) {
        decode_rows += 1, decode_t = std::max(decode_t, double(end));
      } else {
        w.topk.scanned += rows * double(end), w.scores.bytes += rows * double(end) * 4;
        w.scores.calls += 1, w.topk.calls += 1;
      }
      decode_group |= one_row;
    }
  }
  if (decode_group) {
    w.topk.scanned += decode_rows * decode_t, w.scores.bytes += decode_rows * decode_t * 4;
    w.scores.calls += 1, w.topk.calls += 1;
  }
  return w;
}

}  // namespace

void StepCost::attention(int l, const std::vector<SimSeq>& seqs, const Rates& r, PhaseTimes& t) const {
  const double H = double(cfg_.hidden_size), NH = double(cfg_.num_attention_heads), QR = double(cfg_.q_lora_rank);
  const double R = double(cfg_.kv_lora_rank), dr = double(cfg_.qk_rope_head_dim), dn = double(cfg_.qk_nope_head_dim);
  const double dv = double(cfg_.v_head_dim), IH = double(cfg_.index_n_heads), ID = double(cfg_.index_head_dim);
  const double LAT = R + dr, DQ = dn + dr, DKV = dn + dv;
  double m = 0;
  for (const SimSeq& s : seqs) m += double(s.n);
  if (m == 0) return;
  const double kv_b = bytes(l, "self_attn.kv_b_proj.weight");

  // A "shared" layer (IndexShare) has no indexer: its donor's top-k, no scores, no index keys.
  const bool indexer = cfg_.has_indexer(l);
  const double iid = indexer ? ID : 0, iih = indexer ? IH : 0;
  Work proj;  // q_a, kv_a, indexer wk and weights_proj of a; then q_b and wq_b of c_q; norms, ropes
  proj.flops = 2 * m * H * (QR + LAT + iid + iih) + 2 * m * QR * (NH * DQ + iih * iid);
  for (const char* w :
       {"q_a_proj", "kv_a_proj_with_mqa", "indexer.wk", "indexer.weights_proj", "q_b_proj", "indexer.wq_b"})
    proj.bytes += bytes(l, std::string("self_attn.") + w + ".weight");
  proj.bytes += m * (H + 2 * QR + NH * DQ + iih * iid + LAT) * 4;
  proj.calls = indexer ? 10 : 6;
  proj.rows = m;
  t["projections"] += proj.seconds(r);
  Work write;
  write.bytes = m * (LAT + iid) * (4 + kv_bytes_);
  write.calls = indexer ? 2 : 1;
  t["kv_write"] += write.seconds(r);

  AttentionWork w = attention_work(cfg_, seqs, kv_b, kv_bytes_);
  if (w.n_abs > 0) {
    w.qabs.flops = 2 * w.n_abs * NH * dn * R;
    w.qabs.bytes = kv_b * dn / DKV + w.n_abs * NH * (DQ + LAT) * 4;
    w.qabs.calls = 1 + NH;
    w.qabs.rows = w.n_abs;
    t["q_absorb"] += w.qabs.seconds(r);
    if (w.sparse && indexer) {
      w.scores.attention_unit = true;
      t["indexer_scores"] += w.scores.seconds(r);
      t["topk"] += w.topk.seconds(r);
    }
    w.att.attention_unit = true;
    w.att.calls = 1;
    t["attention"] += w.att.seconds(r);
    w.vabs.flops = 2 * w.n_abs * NH * R * dv;
    w.vabs.bytes = kv_b * dv / DKV + w.n_abs * NH * (R + dv) * 4;
    w.vabs.calls = 1;
    w.vabs.rows = w.n_abs;
    t["v_absorb"] += w.vabs.seconds(r);
  }
  if (w.naive_gemm.calls > 0) {
    w.naive_att.attention_unit = true;
    t["attention_naive"] += w.naive_gemm.seconds(r) + w.naive_att.seconds(r);
  }
  Work o;
  o.flops = 2 * m * H * NH * dv;
  o.bytes = bytes(l, "self_attn.o_proj.weight") + m * (NH * dv + 2 * H) * 4;
  o.calls = 1;
  o.rows = m;
  t["o_proj"] += o.seconds(r);
  Work norms;  // input / post-attention RMSNorm and residual adds
  norms.bytes = m * H * 4 * 6;
  norms.calls = 3;
  t["norms"] += norms.seconds(r);
}

void StepCost::dense_mlp(int l, int64_t rows, const Rates& r, PhaseTimes& t) const {
  if (rows == 0) return;
  const double m = double(rows), H = double(cfg_.hidden_size), I = double(cfg_.intermediate_size);
  Work w;
  w.flops = 2 * m * 3 * H * I;
  for (const char* p : {"gate_proj", "up_proj", "down_proj"}) w.bytes += bytes(l, std::string("mlp.") + p + ".weight");
  w.bytes += m * (2 * H + 3 * I) * 4;
  w.calls = 4;
  w.rows = m;
  t["dense_mlp"] += w.seconds(r);
}

void StepCost::router(int l, int64_t rows, const Rates& r, PhaseTimes& t) const {
  if (rows == 0) return;
  const double m = double(rows), H = double(cfg_.hidden_size), I = double(cfg_.moe_intermediate_size);
  const double S = double(cfg_.n_shared_experts);
  Work w;  // router logits and the shared expert (gate / up with the router, then its down)
  w.flops = 2 * m * H * (double(cfg_.n_routed_experts) + 3 * I * S);
  w.bytes = bytes(l, "mlp.gate.weight") + m * (2 * H + 3 * I * S) * 4;
  for (const char* p : {"gate_proj", "up_proj", "down_proj"})
    w.bytes += bytes(l, std::string("mlp.shared_experts.") + p + ".weight");
  w.calls = 5;
  w.rows = m;
  t["router"] += w.seconds(r);
  Work moves;  // gathering rows for the exchange, weighting and summing the results
  moves.bytes = m * double(cfg_.num_experts_per_tok) * H * 4 * 2;
  moves.calls = 2;
  t["dispatch"] += moves.seconds(r) / 2;
  t["combine"] += moves.seconds(r) / 2;
}

double StepCost::expert_picks(int l, int column, int64_t rows) const {
  const parallel::LayerRange ex = parallel::expert_range(int(cfg_.n_routed_experts), E_, column);
  double s = 0;
  for (int e = ex.first; e < ex.last; ++e) s += share(l, e);
  return double(rows) * double(cfg_.num_experts_per_tok) * s;
}

double StepCost::expert_count(int column) const {
  const parallel::LayerRange ex = parallel::expert_range(int(cfg_.n_routed_experts), E_, column);
  return double(ex.size());
}

double StepCost::active_expert_bytes(int l, int column, int64_t rows) const {
  const parallel::LayerRange ex = parallel::expert_range(int(cfg_.n_routed_experts), E_, column);
  const double k = double(cfg_.num_experts_per_tok);
  double b = 0;
  for (int e = ex.first; e < ex.last; ++e) {
    // P(expert e picked by at least one of `rows` rows), each picking it with probability k * share.
    const double p = std::min(1.0, k * share(l, e));
    const double active = 1 - std::pow(1 - p, double(rows));
    const std::string pre = "mlp.experts." + std::to_string(e) + ".";
    b += active *
         (bytes(l, pre + "gate_proj.weight") + bytes(l, pre + "up_proj.weight") + bytes(l, pre + "down_proj.weight"));
  }
  return b;
}

void StepCost::experts(int l, int column, int64_t rows, const Rates& r, PhaseTimes& t) const {
  if (rows == 0) return;
  const double H = double(cfg_.hidden_size), I = double(cfg_.moe_intermediate_size);
  const double picks = expert_picks(l, column, rows);
  Work w;  // every active expert's gate / up in one batch, then the downs
  w.flops = 2 * picks * 3 * H * I;
  w.bytes = active_expert_bytes(l, column, rows) + picks * (2 * H + 3 * I) * 4;
  w.calls = 4;
  // Rows per active expert: a routed expert's GEMMs are as small as its share of the picks.
  const double full = active_expert_bytes(l, column, 1 << 30);
  const double active = full > 0 ? active_expert_bytes(l, column, rows) / full * expert_count(column) : 1;
  w.rows = picks / std::max(active, 1.0);
  t["experts"] += w.seconds(r);
}

StepCost::ExchangeBytes StepCost::exchange_bytes(int64_t rows, double value_bytes) const {
  if (E_ == 1) return {};
  const double n = double(cfg_.n_routed_experts), k = double(cfg_.num_experts_per_tok), per = n / E_;
  // P(a given other rank owns none of a row's k distinct experts), uniform routing.
  double miss = 1;
  for (int i = 0; i < int(k); ++i) miss *= std::max(0.0, (n - per - i) / (n - i));
  const double m = double(rows), H = double(cfg_.hidden_size);
  const double dispatch = m * (E_ - 1) * (1 - miss), combine = m * k * (E_ - 1) / E_;
  return {32.0 * (E_ - 1) + 8 * combine, (dispatch + combine) * H * value_bytes};
}

void StepCost::head(int64_t sampled, const Rates& r, PhaseTimes& t) const {
  if (sampled == 0) return;
  const double s = double(sampled), H = double(cfg_.hidden_size), V = double(cfg_.vocab_size);
  Work w;
  w.flops = 2 * s * H * V;
  w.bytes = bytes(-1, "lm_head.weight") + s * (H + V) * 4;
  w.calls = 2;
  w.rows = s;
  t["lm_head"] += w.seconds(r);
  Work samp;  // softmax / argmax over the vocabulary on the host
  samp.bytes = s * V * 4 * 3;
  samp.calls = 1;
  t["sample"] += samp.seconds(r);
}

void StepCost::embed(int64_t rows, const Rates& r, PhaseTimes& t) const {
  Work w;
  w.bytes = double(rows) * double(cfg_.hidden_size) * 6;
  w.calls = 1;
  t["embed"] += w.seconds(r);
}

}  // namespace glm5::launcher
