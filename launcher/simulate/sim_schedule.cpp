// The tick-by-tick replay of the engine (see sim_schedule.h).
#include "launcher/simulate/sim_schedule.h"

#include <algorithm>
#include <cmath>
#include <memory>
#include <sstream>

#include "kernels/core/check.h"
#include "runtime/engine/distributor.h"
#include "runtime/kv_cache.h"
#include "runtime/scheduler.h"

namespace glm5::launcher {

Workload parse_workload(const std::string& text) {
  Workload w;
  bool seen[4] = {};
  std::stringstream ss(text);
  for (std::string item; std::getline(ss, item, ',');) {
    const size_t eq = item.find('=');
    const std::string key = item.substr(0, eq), value = eq == std::string::npos ? "" : item.substr(eq + 1);
    int64_t* field = key == "prompts"  ? &w.prompts
                     : key == "in"     ? &w.in
                     : key == "out"    ? &w.out
                     : key == "prefix" ? &w.prefix
                                       : nullptr;
    CHECK(field, "--workload: unknown field '", key, "' in '", text, "': expected prompts=N,in=T,out=T[,prefix=T]");
    size_t used = 0;
    long long x = -1;
    try {
      x = std::stoll(value, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    CHECK(used == value.size() && !value.empty() && x >= 0, "--workload: field '", key,
          "': expected a whole number >= 0, found '", value, "'");
    *field = x;
    seen[key == "prompts" ? 0 : key == "in" ? 1 : key == "out" ? 2 : 3] = true;
  }
  CHECK(seen[0] && seen[1] && seen[2], "--workload '", text,
        "': prompts, in and out are required (e.g. prompts=64,in=2048,out=512)");
  CHECK(w.prompts >= 1 && w.in >= 1 && w.out >= 1, "--workload '", text, "': prompts, in and out must be >= 1");
  CHECK(w.prefix <= w.in, "--workload '", text, "': prefix (", w.prefix, ") must be <= in (", w.in, ")");
  return w;
}

std::vector<double> parse_acceptance(const std::string& text, int k) {
  std::vector<double> a;
  std::stringstream ss(text);
  for (std::string item; std::getline(ss, item, ',');) {
    size_t used = 0;
    double x = -1;
    try {
      x = std::stod(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    CHECK(used == item.size() && !item.empty() && x >= 0 && x <= 1 && (a.empty() || x <= a.back()),
          "--acceptance: expected fractions in [0, 1], each at most the one before (drafts 1..j all accepted), found '",
          item, "' in '", text, "'");
    a.push_back(x);
  }
  CHECK(int(a.size()) >= k, "--acceptance '", text, "': ", a.size(), " values for speculative_tokens ", k,
        " (one per draft position)");
  return a;
}

std::vector<int> host_of_ranks(const ClusterConfig& cc, const Hardware& hw) {
  const int W = cc.world_size();
  std::vector<int> host(size_t(W), 0);
  if (!cc.hosts.empty()) {
    int h = 0, used = 0;
    for (int r = 0; r < W; ++r) {
      while (used >= cc.hosts[size_t(h)].slots && h + 1 < int(cc.hosts.size())) h++, used = 0;
      host[size_t(r)] = h;
      ++used;
    }
  } else if (hw.gpu()) {
    for (int r = 0; r < W; ++r) host[size_t(r)] = r / hw.devices_per_node;
  }
  return host;
}

namespace {

// The prompt of request i: the workload's shared prefix (the same tokens for every request), then
// tokens of its own, so that prefix sharing finds exactly the prefix. Any ids below the vocabulary:
// the cost of a step does not depend on them.
std::vector<int32_t> prompt_of(const Workload& w, int64_t i, int64_t vocab) {
  std::vector<int32_t> p(size_t(w.in));
  for (int64_t t = 0; t < w.in; ++t) {
    uint64_t z = uint64_t(t < w.prefix ? -1 : i) * 0x9e3779b97f4a7c15ull + uint64_t(t);
    z = (z ^ (z >> 31)) * 0xbf58476d1ce4e5b9ull;
    p[size_t(t)] = int32_t(1 + (z ^ (z >> 29)) % uint64_t(std::max<int64_t>(1, vocab - 1)));
  }
  return p;
}

// The KV blocks of each column's pool, as the engine sizes it (runtime/engine/engine.cpp): the
// cluster's kv_budget_gb over kv_bytes_per_token. Without a budget the engine takes max_batch full
// contexts, capped by the memory of the host it runs on; here, room for max_batch sequences of the
// workload.
int64_t column_kv_blocks(const SimSetup& s) {
  const ClusterConfig& cc = *s.cluster;
  const int64_t k = cc.speculative_tokens;
  if (cc.kv_budget_gb <= 0) return cc.max_batch * (runtime::blocks_for(s.work.in + s.work.out + k + 1) + 1);
  return runtime::KvPool::blocks_for_budget(*s.cfg, kv_bytes_per_token(cc, *s.cfg, s.stages), cc.kv_budget_gb * 1e9,
                                            int(cc.max_batch));
}

class Replay {
 public:
  Replay(const SimSetup& s, std::vector<double> util)
      : s_(s), util_(std::move(util)), dist_(s.cluster->expert_parallel, s.cluster->prefix_sharing) {
    const ClusterConfig& cc = *s.cluster;
    P_ = cc.stages, E_ = cc.expert_parallel, G_ = P_ == 1 ? 1 : cc.micro_batches;
    host_ = host_of_ranks(cc, *s.hw);
    for (int r = 0; r < P_ * E_; ++r) rates_.push_back(rates_of(r));
    runtime::SchedulerOptions so;
    so.policy() = cc.policy();
    so.micro_batches = G_;
    so.kv_blocks = column_kv_blocks(s);
    for (int c = 0; c < E_; ++c) cols_.push_back(std::make_unique<runtime::Scheduler>(*s.cfg, so, nullptr));
    handed_at_.assign(size_t(s.work.prompts), -1);
    first_at_.assign(size_t(s.work.prompts), -1);
    blocks_of_.assign(size_t(s.work.prompts), 0);
  }

  Prediction run();

 private:
  Rates rates_of(int rank) const;
  double link_bw(int a, int b) const {
    return host_[size_t(a)] == host_[size_t(b)] ? s_.hw->intra_node_bw : s_.hw->inter_node_bw;
  }
  double link_latency(int a, int b) const {
    return host_[size_t(a)] == host_[size_t(b)] ? s_.hw->intra_node_latency_s : s_.hw->inter_node_latency_s;
  }
  void hand_out(double now);
  int64_t accepted_drafts(int64_t drafts);
  std::vector<SimSeq> build(runtime::Scheduler& c, int g);
  void apply(runtime::Scheduler& c, const std::vector<SimSeq>& step, double now);
  double stage_time(int stage, const std::vector<std::vector<SimSeq>>& steps, StagePrediction& out);
  // One tick's steps, one per column, and the figures the timing needs.
  struct Tick {
    std::vector<std::vector<SimSeq>> steps;  // [E]
    int64_t m_max = 0, rows = 0, decode_tokens = 0, absorbed_max = 0;
    bool decode_only = true;
  };
  Tick build_tick(int g);
  double down_the_column(const Tick& t, Prediction& pred, std::vector<double>& stage_free, double& now);
  void summarise(Prediction& pred, double end, double decode_s, int64_t decode_tokens) const;
  double mtp_time(const std::vector<std::vector<SimSeq>>& steps, StagePrediction& out);

  const SimSetup& s_;
  std::vector<double> util_;
  int P_ = 1, E_ = 1, G_ = 1;
  std::vector<int> host_;
  std::vector<Rates> rates_;
  std::vector<std::unique_ptr<runtime::Scheduler>> cols_;  // each column's scheduler, as the engine's
  runtime::Distributor dist_;                              // world rank 0's
  std::vector<double> handed_at_, first_at_;               // per request: handed out, first token back
  std::vector<int64_t> blocks_of_;                         // per request: KV blocks the stages hold for it
  int64_t handed_ = 0, finished_ = 0, generated_ = 0;
  double exchange_bytes_ = 0, exchange_plan_bytes_ = 0, hop_bytes_ = 0;
  int64_t exchanges_ = 0, hops_ = 0;
  uint64_t draw_ = 0;  // the acceptance draws' state (deterministic)
};

// Drafts accepted of `drafts`: draft j is accepted after j - 1 with probability a_j / a_{j-1} of
// the acceptance model, drawn from a fixed sequence (splitmix64), so a replay is reproducible.
int64_t Replay::accepted_drafts(int64_t drafts) {
  int64_t j = 0;
  for (double before = 1; j < drafts; ++j) {
    uint64_t z = (draw_ += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    const double u = double((z ^ (z >> 31)) >> 11) * 0x1.0p-53;
    const double a = s_.acceptance[size_t(j)];
    if (before <= 0 || u >= a / before) break;
    before = a;
  }
  return j;
}

// A busy rank's rates: its threads (cores / ranks on its host, as the launcher sets OpenMP), the
// cores and bandwidth it shares with the other ranks of its host that are busy at the same time.
Rates Replay::rates_of(int rank) const {
  const Hardware& hw = *s_.hw;
  // gemm_flops is precision fast's rate; exact takes exact_gemm_cost times as long.
  const double mode = s_.cluster->precision == "exact" ? hw.exact_gemm_cost : 1.0;
  const double big = hw.gemm_flops / mode;
  const double small = (hw.gemm_flops_small > 0 ? hw.gemm_flops_small : hw.gemm_flops) / mode;  // optional key
  Rates r;
  r.op_overhead_s = hw.op_overhead_s;
  if (hw.gpu()) {
    r.gemm_flops = big * hw.gemm_efficiency;
    r.gemm_flops_small = small * hw.gemm_efficiency;
    r.attention_flops = hw.attention_flops * hw.attention_efficiency;
    r.topk_rate = hw.topk_rate;
    r.mem_bw = hw.mem_bw * hw.mem_bw_efficiency;
    r.attention_mem_bw = hw.mem_bw * hw.attention_mem_eff();
    return r;
  }
  int on_host = 0;
  double others = 0;  // expected busy ranks of this host besides this one
  for (size_t q = 0; q < host_.size(); ++q)
    if (host_[q] == host_[size_t(rank)]) {
      ++on_host;
      if (int(q) != rank) others += util_[q];
    }
  const double threads = std::max(1, hw.cores / on_host);
  const double busy_threads = threads * (1 + others);
  const double share = std::min(1.0, double(hw.cores) / busy_threads);
  r.gemm_flops = threads * share * big * hw.gemm_efficiency;
  r.gemm_flops_small = threads * share * small * hw.gemm_efficiency;
  r.attention_flops = threads * share * hw.attention_flops * hw.attention_efficiency;
  r.topk_rate = threads * share * hw.topk_rate;
  r.mem_bw = std::min(threads * share * hw.mem_bw_core, hw.mem_bw * threads / busy_threads) * hw.mem_bw_efficiency;
  r.attention_mem_bw = r.mem_bw / hw.mem_bw_efficiency * hw.attention_mem_eff();
  return r;
}

// World rank 0 hands requests out between ticks (runtime/engine/engine.cpp hand_out), to the
// column the distributor picks, while a column has a free slot.
void Replay::hand_out(double now) {
  std::vector<int64_t> load, slots;
  int64_t room = 0;
  for (const auto& c : cols_) load.push_back(c->load()), slots.push_back(c->free_slots()), room += slots.back();
  for (; handed_ < s_.work.prompts && room > 0; --room) {
    runtime::Request r;
    r.index = handed_;
    r.prompt = prompt_of(s_.work, handed_, s_.cfg->vocab_size);
    r.sampling.max_tokens = s_.work.out;
    r.sampling.ignore_eos = true;
    const std::string why = cols_[0]->refuse_reason(r);
    CHECK(why.empty(), "simulate: the workload's requests cannot run on this layout: ", why);
    const int c = dist_.pick(r, load, slots);
    handed_at_[size_t(handed_++)] = now;
    cols_[size_t(c)]->add(std::move(r));
  }
}

// The column's next step for group g (admission, then decode rows and prefill chunks: the
// scheduler's own), as the cost model sees it; a verify step's accepted drafts are drawn here.
std::vector<SimSeq> Replay::build(runtime::Scheduler& c, int g) {
  std::vector<int32_t> tokens;
  const runtime::Step step = c.next_step(g, tokens);
  std::vector<SimSeq> out;
  for (int64_t r : step.released) blocks_of_[size_t(r)] = 0;
  for (const runtime::Request& r : step.added) blocks_of_[size_t(r.index)] = 0;  // new, or back after a preemption
  for (const runtime::StepSeq& q : step.seqs) {
    blocks_of_[size_t(q.req)] += q.new_blocks;
    SimSeq e;
    e.req = q.req;
    e.prompt_len = s_.work.in;
    e.start = q.start;
    e.n = q.n;
    e.sample = q.sample;
    e.drafts = q.drafts;
    e.accepted = accepted_drafts(q.drafts);
    e.decode = q.decode;
    e.mtp = q.mtp;
    // The drafts the last stage makes (runtime/engine/last_stage.cpp draft()): the first, then one
    // per chained step while the chain's position is inside the sequence's KV blocks.
    if (q.sample && q.draft) {
      const int64_t known = q.decode ? 1 + e.accepted : q.n, cap = blocks_of_[size_t(q.req)] * runtime::kBlockTokens;
      e.chain = std::min<int64_t>(s_.cluster->speculative_tokens, 1 + std::max<int64_t>(0, cap - (q.start + known)));
    }
    out.push_back(e);
  }
  return out;
}

// The step's sampled tokens come back to the column's scheduler as the last stage would return
// them: 1 + the accepted drafts, and the MTP layer's drafts for the next step. Requests that
// reached `out` tokens finish.
void Replay::apply(runtime::Scheduler& c, const std::vector<SimSeq>& step, double now) {
  std::vector<runtime::Back> backs;
  for (const SimSeq& e : step) {
    if (!e.sample) continue;
    runtime::Back b;
    b.req = e.req;
    runtime::Sampled token;
    token.token = 1;  // any id: ignore_eos, no stop strings
    b.tokens.assign(size_t(1 + e.accepted), token);
    b.drafts.assign(size_t(e.chain), 1);
    if (first_at_[size_t(e.req)] < 0) first_at_[size_t(e.req)] = now;
    backs.push_back(std::move(b));
  }
  c.apply(backs);
  for (const runtime::Result& r : c.take_finished()) {
    generated_ += int64_t(r.tokens.size());
    ++finished_;
  }
}

// Seconds stage `stage` spends on one tick's steps (one per column): per layer the slowest
// column's attention block, then (MoE layers) the exchange and the busiest rank's experts.
double Replay::stage_time(int stage, const std::vector<std::vector<SimSeq>>& steps, StagePrediction& out) {
  const runtime::ModelConfig& cfg = *s_.cfg;
  const StepCost& cost = *s_.cost;
  const parallel::LayerRange lr = s_.stages[size_t(stage)];
  std::vector<int64_t> rows(size_t(E_), 0), sampled(size_t(E_), 0);
  int64_t total = 0;
  for (int c = 0; c < E_; ++c) {
    for (const SimSeq& e : steps[size_t(c)]) rows[size_t(c)] += e.n, sampled[size_t(c)] += e.sample ? 1 + e.drafts : 0;
    total += rows[size_t(c)];
  }
  // The slowest column's phases of one segment. A column whose step and rates equal the previous
  // column's costs the same (uniform workloads on wide layouts: computed once).
  auto slowest = [&](auto&& part, bool memo = true) {
    PhaseTimes best;
    double best_s = -1;
    for (int c = 0; c < E_; ++c) {
      const Rates& r = rates_[size_t(stage * E_ + c)];
      if (memo && c > 0 && steps[size_t(c)] == steps[size_t(c - 1)] && r == rates_[size_t(stage * E_ + c - 1)])
        continue;
      PhaseTimes t;
      part(c, r, t);
      double sum = 0;
      for (auto& [k, v] : t) sum += v;
      if (sum > best_s) best_s = sum, best = t;
    }
    for (auto& [k, v] : best) out.phases[k] += v;
    return std::max(0.0, best_s);
  };
  double T = 0;
  if (stage == 0) T += slowest([&](int c, const Rates& r, PhaseTimes& t) { cost.embed(rows[size_t(c)], r, t); });
  for (int l = lr.first; l < lr.last; ++l) {
    const bool moe = cfg.is_moe_layer(l);
    const double block = slowest([&](int c, const Rates& r, PhaseTimes& t) {
      cost.attention(l, steps[size_t(c)], r, t);
      if (moe)
        cost.router(l, rows[size_t(c)], r, t);
      else
        cost.dense_mlp(l, rows[size_t(c)], r, t);
    });
    if (!moe) {
      T += block;
      continue;
    }
    // The exchange: counts, then rows out, results back (on GPUs the slot entries go on their own
    // before the rows: one more message). A rank's bytes go to the stage's other ranks evenly,
    // over NVLink / shared memory to those on its host, the network to the rest.
    double ex = 0;
    if (E_ > 1) {
      for (int c = 0; c < E_; ++c) {
        const int a = stage * E_ + c;
        int local = 0;
        for (int d = 0; d < E_; ++d) local += d != c && host_[size_t(stage * E_ + d)] == host_[size_t(a)];
        const double remote = double(E_ - 1 - local) / double(E_ - 1);
        const StepCost::ExchangeBytes eb = cost.exchange_bytes(rows[size_t(c)], s_.exchange_value_bytes);
        const double bytes = eb.total(), messages = s_.hw->gpu() ? 4 : 3;
        const double t = messages * (remote > 0 ? s_.hw->inter_node_latency_s : s_.hw->intra_node_latency_s) +
                         std::max(bytes * (1 - remote) / s_.hw->intra_node_bw, bytes * remote / s_.hw->inter_node_bw);
        ex = std::max(ex, t);
        exchange_bytes_ += bytes;
        exchange_plan_bytes_ += eb.plan;
      }
      ++exchanges_;
      out.phases["moe_exchange"] += ex;
      out.comm_s += ex;
    }
    const double experts =
        slowest([&](int c, const Rates& r, PhaseTimes& t) { cost.experts(l, c, total, r, t); }, cost.uniform());
    // With overlap (two micro-batches alternating, as DeepSeek's decode does) the exchange hides
    // behind the other micro-batch's compute; the engine itself runs them in sequence.
    T += s_.overlap ? std::max(block + experts, ex) : block + ex + experts;
  }
  if (stage == P_ - 1) T += slowest([&](int c, const Rates& r, PhaseTimes& t) { cost.head(sampled[size_t(c)], r, t); });
  if (stage == P_ - 1 && s_.cluster->speculative_tokens > 0) T += mtp_time(steps, out);
  return T;
}

// The MTP layer on the last stage (runtime/engine/last_stage.cpp draft()): one pass over the step's rows whose
// next token is known (prompt rows; a decode entry's accepted rows), then k - 1 chained passes of
// one row per drafting sequence, and lm_head once per draft. Its cost is the last decoder
// layer's (GLM-5's MTP layer has its shapes) for those rows.
double Replay::mtp_time(const std::vector<std::vector<SimSeq>>& steps, StagePrediction& out) {
  const runtime::ModelConfig& cfg = *s_.cfg;
  const int l = int(cfg.num_hidden_layers) - 1, k = s_.cluster->speculative_tokens;
  const int last = P_ - 1;
  double T = 0;
  for (int pass = 0; pass < k; ++pass) {
    std::vector<std::vector<SimSeq>> rows(static_cast<size_t>(E_));
    std::vector<int64_t> m(size_t(E_), 0), drafting(size_t(E_), 0);
    int64_t total = 0;
    for (int c = 0; c < E_; ++c)
      for (const SimSeq& e : steps[size_t(c)]) {
        // Pass 0 over the rows whose next token is known; pass p > 0 is the chained step to draft p + 1.
        if (!e.mtp || (pass > 0 && pass >= e.chain)) continue;  // a plainly decoding step: no MTP
        const int64_t known = e.decode ? 1 + e.accepted : e.n;
        SimSeq r = e;
        r.n = pass == 0 ? known : 1;
        r.start = pass == 0 ? e.start : e.start + known + pass - 1;
        rows[size_t(c)].push_back(r);
        m[size_t(c)] += r.n;
        drafting[size_t(c)] += pass < e.chain;  // lm_head for its draft pass + 1
        total += r.n;
      }
    PhaseTimes phases;
    for (int c = 0; c < E_; ++c) {
      const Rates& r = rates_[size_t(last * E_ + c)];
      PhaseTimes t;
      s_.cost->attention(l, rows[size_t(c)], r, t);
      if (cfg.is_moe_layer(l)) {
        s_.cost->router(l, m[size_t(c)], r, t);
        s_.cost->experts(l, c, total, r, t);
      } else {
        s_.cost->dense_mlp(l, m[size_t(c)], r, t);
      }
      s_.cost->head(drafting[size_t(c)], r, t);
      double sum = 0, best = 0;
      for (auto& [key, v] : t) sum += v;
      for (auto& [key, v] : phases) best += v;
      if (sum > best) phases = t;
    }
    for (auto& [key, v] : phases) {
      out.phases["mtp_" + key] += v;
      T += v;
    }
  }
  return T;
}

// Every column's step for group g, with the largest step's rows (the hop's size), the rows with a
// top-k, and the decode tokens they carry.
Replay::Tick Replay::build_tick(int g) {
  const runtime::ModelConfig& cfg = *s_.cfg;
  Tick t;
  t.steps.resize(size_t(E_));
  for (int c = 0; c < E_; ++c) {
    t.steps[size_t(c)] = build(*cols_[size_t(c)], g);
    int64_t m = 0;
    int64_t absorbed = 0;  // rows past min(prompt, index_topk): the ones with a top-k
    for (const SimSeq& e : t.steps[size_t(c)]) {
      absorbed += std::max<int64_t>(0, e.start + e.n - std::max(e.start, std::min(e.prompt_len, cfg.index_topk)));
      m += e.n;
      t.decode_only &= e.decode;
      t.decode_tokens += e.decode ? 1 + e.accepted : 0;
    }
    t.m_max = std::max(t.m_max, m);
    t.absorbed_max = std::max(t.absorbed_max, absorbed);
    t.rows += m;
  }
  return t;
}

// Down the column: stage s starts when the step has arrived and it is done with the last one.
// Returns when the step's last stage is done; `now` becomes the time stage 0 is free to build
// the next tick (once it has sent this one).
double Replay::down_the_column(const Tick& t, Prediction& pred, std::vector<double>& stage_free, double& now) {
  const runtime::ModelConfig& cfg = *s_.cfg;
  double arrive = now;
  for (int s = 0; s < P_; ++s) {
    StagePrediction& sp = pred.stages[size_t(s)];
    const double start = std::max(arrive, stage_free[size_t(s)]);
    const double T = stage_time(s, t.steps, sp);
    sp.busy_s += T;
    stage_free[size_t(s)] = start + T;
    arrive = start + T;
    if (s + 1 < P_) {
      const int a = s * E_, b = (s + 1) * E_;
      double bytes = double(t.m_max) * double(cfg.hidden_size) * 4 + 256;
      // A next stage that begins with a "shared" layer (IndexShare) gets the top-k of its rows too.
      if (!cfg.has_indexer(s_.stages[size_t(s + 1)].first))
        bytes += double(t.absorbed_max) * double(cfg.index_topk) * 4;
      const double hop = link_latency(a, b) + bytes / link_bw(a, b);
      sp.comm_s += hop;
      hop_bytes_ += bytes;
      ++hops_;
      arrive += hop;
    }
    if (s == 0) now = start + T;
  }
  return arrive;
}

Prediction Replay::run() {
  Prediction pred;
  pred.stages.resize(size_t(P_));
  for (int s = 0; s < P_; ++s)
    pred.stages[size_t(s)].first_layer = s_.stages[size_t(s)].first,
    pred.stages[size_t(s)].last_layer = s_.stages[size_t(s)].last;
  std::vector<double> stage_free(size_t(P_), 0), back_at(size_t(G_), 0);
  std::vector<bool> inflight(size_t(G_), false);
  std::vector<Tick> pending(static_cast<size_t>(G_));  // per group in flight: its tick (applied when it returns)
  double now = 0, end = 0, last_tick = 0, decode_s = 0;
  int64_t decode_tokens = 0;
  const double tick_sync = E_ > 1 ? 3 * link_latency(0, 1 % (P_ * E_)) : 0;  // all_gather + broadcasts
  for (int64_t tick = 0;; ++tick) {
    const int g = int(tick % G_);
    if (P_ > 1 && inflight[size_t(g)]) {
      now = std::max(now, back_at[size_t(g)]);
      Tick& back = pending[size_t(g)];
      for (int c = 0; c < E_; ++c) apply(*cols_[size_t(c)], back.steps[size_t(c)], now);
      inflight[size_t(g)] = false;
      end = std::max(end, now);
    }
    if (finished_ == s_.work.prompts) break;
    CHECK(tick < 100'000'000,
          "simulate: the workload needs more than 10^8 engine steps to replay; simulate a "
          "smaller one (fewer prompts) and scale: throughput does not depend on the count once the "
          "columns are full");
    hand_out(now);
    now += tick_sync;
    ++pred.ticks;
    Tick t = build_tick(g);
    const double arrive = down_the_column(t, pred, stage_free, now);
    // Steady-state decode: the spacing of stage 0's decode-only ticks and the tokens they carry.
    if (t.decode_only && t.rows > 0) decode_s += now - last_tick, decode_tokens += t.decode_tokens;
    last_tick = now;
    if (P_ == 1) {
      for (int c = 0; c < E_; ++c) apply(*cols_[size_t(c)], t.steps[size_t(c)], now);
      end = now;
    } else {
      back_at[size_t(g)] = arrive + link_latency((P_ - 1) * E_, 0);
      inflight[size_t(g)] = true;
      pending[size_t(g)] = std::move(t);
    }
  }
  summarise(pred, end, decode_s, decode_tokens);
  return pred;
}

void Replay::summarise(Prediction& pred, double end, double decode_s, int64_t decode_tokens) const {
  const Workload& w = s_.work;
  pred.makespan_s = end;
  pred.generated = generated_;
  for (const auto& c : cols_) pred.preemptions += c->preemptions();
  pred.generated_per_s = double(generated_) / std::max(end, 1e-12);
  pred.tokens_per_s = double(w.prompts * (w.in + w.out)) / std::max(end, 1e-12);
  double ttft_sum = 0;
  for (size_t i = 0; i < first_at_.size(); ++i) ttft_sum += first_at_[i] - handed_at_[i];
  pred.mean_ttft_s = ttft_sum / double(w.prompts);
  pred.decode_per_s = decode_s > 0 ? double(decode_tokens) / decode_s : 0;
  pred.exchange_bytes_per_layer = exchanges_ ? exchange_bytes_ / double(exchanges_ * E_) : 0;
  pred.exchange_plan_bytes_per_layer = exchanges_ ? exchange_plan_bytes_ / double(exchanges_ * E_) : 0;
  pred.pipeline_bytes_per_step = hops_ ? hop_bytes_ / double(hops_) : 0;
  for (int r = 0; r < P_ * E_; ++r)
    pred.rank_utilisation.push_back(std::min(1.0, pred.stages[size_t(r / E_)].busy_s / std::max(end, 1e-12)));
}

}  // namespace

Prediction simulate_run(const SimSetup& s) {
  CHECK(s.cfg && s.cluster && s.hw && s.cost && int(s.stages.size()) == s.cluster->stages,
        "simulate: incomplete setup (internal)");
  // Fixed point of the host-sharing estimate: start with every rank busy, then use the
  // utilisation the previous pass predicted.
  std::vector<double> util(size_t(s.cluster->world_size()), 1.0);
  Prediction p;
  for (int pass = 0; pass < 4; ++pass) {
    p = Replay(s, util).run();
    util = p.rank_utilisation;
  }
  return p;
}

}  // namespace glm5::launcher
