// Engine: scheduling on stage 0, the pipeline between stages, sampling on the last stage.
// Message flow per tick (one micro-batch step of one column):
//   stage 0 --header+hidden--> stage 1 --> ... --> stage P-1 --tokens(+logits)--> stage 0
// Every message is (int64 size, payload) on the world communicator between ranks of a column.
#include "runtime/engine.h"

#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <memory>

#include "core/check.h"

namespace glm5::runtime {

long peak_rss_kb() {
  rusage ru{};
  getrusage(RUSAGE_SELF, &ru);
  return ru.ru_maxrss;
}

namespace {

using Clock = std::chrono::steady_clock;
double since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

enum Tag : int { kStep = 11, kHidden = 12, kBack = 13, kResults = 14 };

struct Writer {
  std::vector<char> b;
  template <typename T> void put(const T& v) {
    const char* p = reinterpret_cast<const char*>(&v);
    b.insert(b.end(), p, p + sizeof(T));
  }
  template <typename T> void put_vec(const std::vector<T>& v) {
    put<int64_t>(int64_t(v.size()));
    const char* p = reinterpret_cast<const char*>(v.data());
    b.insert(b.end(), p, p + v.size() * sizeof(T));
  }
  void put_str(const std::string& s) { put_vec(std::vector<char>(s.begin(), s.end())); }
};

struct Reader {
  const char* p;
  const char* end;
  explicit Reader(const std::vector<char>& v) : p(v.data()), end(v.data() + v.size()) {}
  template <typename T> T get() {
    CHECK(p + sizeof(T) <= end, "internal: truncated engine message");
    T v;
    std::memcpy(&v, p, sizeof(T));
    p += sizeof(T);
    return v;
  }
  template <typename T> std::vector<T> get_vec() {
    int64_t n = get<int64_t>();
    CHECK(n >= 0 && p + size_t(n) * sizeof(T) <= end, "internal: truncated engine message");
    std::vector<T> v(static_cast<size_t>(n));
    if (n) std::memcpy(static_cast<void*>(v.data()), p, size_t(n) * sizeof(T));
    p += size_t(n) * sizeof(T);
    return v;
  }
  std::string get_str() { auto v = get_vec<char>(); return std::string(v.begin(), v.end()); }
};

void send_bytes(parallel::Comm& c, int dst, int tag, const std::vector<char>& b) {
  int64_t n = int64_t(b.size());
  c.send(&n, sizeof n, dst, tag);
  if (n) c.send(b.data(), b.size(), dst, tag);
}
std::vector<char> recv_bytes(parallel::Comm& c, int src, int tag) {
  int64_t n = 0;
  c.recv(&n, sizeof n, src, tag);
  std::vector<char> b(static_cast<size_t>(n));
  if (n) c.recv(b.data(), b.size(), src, tag);
  return b;
}

// Hidden states between stages travel over the host communicator; device backends stage them.
void send_hidden(parallel::Comm& c, kernels::Backend& be, const float* h, int64_t n, int dst) {
  if (n == 0) return;
  if (be.host_memory()) return c.send(h, size_t(n) * sizeof(float), dst, kHidden);
  std::vector<float> tmp(static_cast<size_t>(n));
  be.to_host(tmp.data(), h, tmp.size() * sizeof(float));
  c.send(tmp.data(), tmp.size() * sizeof(float), dst, kHidden);
}
void recv_hidden(parallel::Comm& c, kernels::Backend& be, float* h, int64_t n, int src) {
  if (n == 0) return;
  if (be.host_memory()) return c.recv(h, size_t(n) * sizeof(float), src, kHidden);
  std::vector<float> tmp(static_cast<size_t>(n));
  c.recv(tmp.data(), tmp.size() * sizeof(float), src, kHidden);
  be.to_device(h, tmp.data(), tmp.size() * sizeof(float));
}

void put_request(Writer& w, const Request& r) {
  w.put(r.index);
  w.put_vec(r.prompt);
  const SamplingParams& s = r.sampling;
  w.put(s.temperature); w.put(s.top_p); w.put(s.top_k); w.put(s.min_p);
  w.put(s.repetition_penalty); w.put(s.presence_penalty); w.put(s.frequency_penalty);
  w.put(s.seed); w.put(s.max_tokens); w.put(s.logprobs); w.put(s.ignore_eos);
  w.put<int64_t>(int64_t(s.stop.size()));
  for (auto& x : s.stop) w.put_str(x);
  w.put(r.want_prompt_logits); w.put(r.want_logits); w.put(r.extra_final_step);
  w.put_str(r.error);
}
Request get_request(Reader& rd) {
  Request r;
  r.index = rd.get<int64_t>();
  r.prompt = rd.get_vec<int32_t>();
  SamplingParams& s = r.sampling;
  s.temperature = rd.get<float>(); s.top_p = rd.get<float>(); s.top_k = rd.get<int32_t>();
  s.min_p = rd.get<float>(); s.repetition_penalty = rd.get<float>();
  s.presence_penalty = rd.get<float>(); s.frequency_penalty = rd.get<float>();
  s.seed = rd.get<uint64_t>(); s.max_tokens = rd.get<int32_t>(); s.logprobs = rd.get<int32_t>();
  s.ignore_eos = rd.get<bool>();
  int64_t ns = rd.get<int64_t>();
  for (int64_t i = 0; i < ns; ++i) s.stop.push_back(rd.get_str());
  r.want_prompt_logits = rd.get<bool>(); r.want_logits = rd.get<bool>();
  r.extra_final_step = rd.get<bool>();
  r.error = rd.get_str();
  return r;
}

void put_result(Writer& w, const Result& r) {
  w.put(r.index); w.put_vec(r.tokens); w.put_vec(r.logprobs);
  w.put<int64_t>(int64_t(r.top_logprobs.size()));
  for (auto& t : r.top_logprobs) w.put_vec(t);
  w.put_str(r.finish_reason); w.put_str(r.error);
  w.put_vec(r.prompt_logits); w.put_vec(r.decode_logits);
}
Result get_result(Reader& rd) {
  Result r;
  r.index = rd.get<int64_t>(); r.tokens = rd.get_vec<int32_t>(); r.logprobs = rd.get_vec<float>();
  int64_t n = rd.get<int64_t>();
  for (int64_t i = 0; i < n; ++i) r.top_logprobs.push_back(rd.get_vec<std::pair<int32_t, float>>());
  r.finish_reason = rd.get_str(); r.error = rd.get_str();
  r.prompt_logits = rd.get_vec<float>(); r.decode_logits = rd.get_vec<float>();
  return r;
}

// One sequence's entry in a step.
struct StepSeq {
  int64_t req = 0, start = 0, n = 0;
  bool decode = false, sample = false, logits_all = false, logits_sampled = false;
};
struct Step {
  bool stop = false;
  std::vector<StepSeq> seqs;
  std::vector<int64_t> released;  // requests whose caches can be freed (before this step)
  int64_t rows() const { int64_t m = 0; for (auto& s : seqs) m += s.n; return m; }
};
void put_step(Writer& w, const Step& s) {
  w.put(s.stop);
  w.put<int64_t>(int64_t(s.seqs.size()));
  for (auto& q : s.seqs) w.put(q);
  w.put_vec(s.released);
}
Step get_step(Reader& rd) {
  Step s;
  s.stop = rd.get<bool>();
  int64_t n = rd.get<int64_t>();
  for (int64_t i = 0; i < n; ++i) s.seqs.push_back(rd.get<StepSeq>());
  s.released = rd.get_vec<int64_t>();
  return s;
}

// What the last stage returns for one sequence of a step.
struct Back {
  int64_t req = 0;
  bool has_token = false;
  Sampled sampled;
  std::vector<float> logits;  // rows x vocab
};

}  // namespace

// The last stage's work on a step: logits of the rows that need them, then sampling.
// Shared by the one-stage path and the pipeline's last stage.
static std::vector<Back> finish_step(Model& model, const Step& step, const float* h,
                                     const std::vector<Request>& reqs,
                                     std::map<int64_t, std::vector<int32_t>>& generated) {
  kernels::Backend& be = model.backend();
  const int64_t H = model.config().hidden_size, V = model.config().vocab_size;
  // Rows that need logits, gathered contiguously.
  std::vector<std::pair<int64_t, int64_t>> rows;  // (first row in h, count) per seq
  int64_t row = 0, total = 0;
  for (auto& s : step.seqs) {
    if (s.logits_all) rows.push_back({row, s.n});
    else if (s.sample) rows.push_back({row + s.n - 1, 1});
    else rows.push_back({row, 0});
    total += rows.back().second;
    row += s.n;
  }
  std::vector<float> logits(size_t(total * V));
  if (total > 0) {
    float* hs = static_cast<float*>(be.alloc(size_t(total * H) * sizeof(float)));
    int64_t at = 0;
    for (auto& [first, cnt] : rows) {
      if (cnt) be.copy_2d({h + first * H, H, hs + at * H, H, cnt, H});
      at += cnt;
    }
    model.logits(hs, total, logits.data());
    be.free(hs);
  }
  std::vector<Back> out;
  int64_t at = 0;
  for (size_t i = 0; i < step.seqs.size(); ++i) {
    const StepSeq& s = step.seqs[i];
    const int64_t cnt = rows[i].second;
    if (s.sample || s.logits_all) {
      Back b;
      b.req = s.req;
      const float* last = logits.data() + (at + cnt - 1) * V;
      // NaN guard: a broken weight or kernel stops the job here, naming where it showed.
      for (int64_t v = 0; v < cnt * V; ++v)
        CHECK(std::isfinite(logits[size_t(at * V + v)]), "non-finite logits (NaN or inf) for request ",
              s.req, " at positions ", s.start, "..", s.start + s.n - 1, ", vocab entry ", v % V);
      if (s.sample) {
        const Request& r = reqs[size_t(s.req)];
        auto& gen = generated[s.req];
        b.has_token = true;
        b.sampled = sample(last, V, r.sampling, r.prompt, gen, int64_t(gen.size()));
        gen.push_back(b.sampled.token);
      }
      if (s.logits_all) b.logits.assign(logits.data() + at * V, logits.data() + (at + cnt) * V);
      else if (s.logits_sampled) b.logits.assign(last, last + V);
      out.push_back(std::move(b));
    }
    at += cnt;
  }
  return out;
}

Engine::Engine(Model& model, parallel::Comm& world, parallel::Comm& stage_comm,
               const parallel::Grid& grid, const EngineOptions& opt)
    : model_(model), world_(world), stage_comm_(stage_comm), grid_(grid), opt_(opt) {
  stats_.rank = world.rank();
  stats_.stage = grid.stage_of(world.rank());
  stats_.column = grid.column_of(world.rank());
  trace_ = std::getenv("GLM5_TRACE") != nullptr;
  CHECK(opt_.micro_batches >= 1, "micro_batches must be >= 1, found ", opt_.micro_batches);
  CHECK(opt_.max_batch >= 1, "max_batch must be >= 1, found ", opt_.max_batch);
  CHECK(opt_.prefill_chunk >= 1, "prefill_chunk must be >= 1, found ", opt_.prefill_chunk);
  CHECK(opt_.max_step_tokens >= opt_.max_batch, "max_step_tokens must be >= max_batch (",
        opt_.max_batch, ") so that every running sequence can decode in one step, found ",
        opt_.max_step_tokens);
}

void Engine::run(std::vector<Request> requests, const std::function<void(Result&&)>& on_result,
                 const std::function<bool(const Request&, const std::vector<int32_t>&)>& is_stop) {
  auto t0 = Clock::now();
  // Every rank gets the request table (prompts and sampling parameters) from rank 0.
  Writer w;
  if (world_.rank() == 0) {
    w.put<int64_t>(int64_t(requests.size()));
    for (auto& r : requests) put_request(w, r);
  }
  int64_t n = int64_t(w.b.size());
  world_.broadcast(&n, sizeof n, 0);
  w.b.resize(size_t(n));
  world_.broadcast(w.b.data(), w.b.size(), 0);
  Reader rd(w.b);
  std::vector<Request> reqs;
  int64_t count = rd.get<int64_t>();
  for (int64_t i = 0; i < count; ++i) {
    reqs.push_back(get_request(rd));
    reqs.back().index = i;  // engine-internal id = position; callers' ids are restored below
  }
  std::vector<int64_t> caller_index;
  for (auto& r : requests) caller_index.push_back(r.index);
  auto deliver = [&](Result&& r) {
    if (!caller_index.empty()) r.index = caller_index[size_t(r.index)];
    on_result(std::move(r));
  };
  if (stats_.stage == 0) run_stage0(reqs, deliver, is_stop);
  else run_later_stage(reqs);
  stats_.wall_s = since(t0);
  stats_.comm_s += model_.moe_comm_seconds();
  stats_.compute_s -= model_.moe_comm_seconds();
  // idle_s: time spent waiting for pipeline messages (measured where it happens).
  stats_.bytes_sent += model_.moe_bytes_sent();
  stats_.expert_tokens = model_.expert_tokens();
  stats_.peak_rss_kb = peak_rss_kb();
}

void Engine::run_stage0(std::vector<Request>& reqs, const std::function<void(Result&&)>& on_result,
                        const std::function<bool(const Request&, const std::vector<int32_t>&)>& is_stop) {
  const ModelConfig& cfg = model_.config();
  const int P = grid_.stages, E = grid_.expert_parallel, col = stats_.column;
  const int G = P == 1 ? 1 : opt_.micro_batches;
  const int64_t H = cfg.hidden_size;
  const int next = grid_.rank_of(1 % P, col), last = grid_.rank_of(P - 1, col);
  kernels::Backend& be = model_.backend();
  // Stage 0 admits for its whole column: budget by the stage that holds the most layers.
  const size_t kv_per_token =
      SeqCache::bytes_per_token(cfg, opt_.kv_layers > 0 ? opt_.kv_layers : model_.n_local_layers());

  struct Live {
    int64_t req = 0;
    int group = 0;
    int64_t pos = 0;          // tokens already in the cache
    bool finishing = false;   // the extra final step is pending
    Result result;
    std::unique_ptr<SeqCache> cache;
    double kv_bytes = 0;
  };
  std::deque<int64_t> pending;
  std::vector<Result> finished;  // results final on this rank, not yet sent to rank 0
  for (auto& r : reqs) {
    if (r.index % E != col) continue;
    Result err;
    err.index = r.index;
    err.finish_reason = "error";
    if (!r.error.empty()) err.error = r.error;
    else if (r.prompt.empty()) err.error = "prompt is empty";
    else if (int64_t(r.prompt.size()) + r.sampling.max_tokens > cfg.max_position_embeddings)
      err.error = "prompt of " + std::to_string(r.prompt.size()) + " tokens + max_tokens " +
                  std::to_string(r.sampling.max_tokens) + " exceeds the context length " +
                  std::to_string(cfg.max_position_embeddings) + " (max_position_embeddings)";
    else if (opt_.kv_budget_bytes > 0 &&
             double(r.prompt.size() + size_t(r.sampling.max_tokens) + 1) * double(kv_per_token) >
                 opt_.kv_budget_bytes)
      err.error = "request needs " + std::to_string(size_t(r.prompt.size() + size_t(r.sampling.max_tokens) + 1) * kv_per_token) +
                  " bytes of KV cache, more than the budget of " +
                  std::to_string(size_t(opt_.kv_budget_bytes)) + " bytes per rank";
    if (!err.error.empty()) finished.push_back(std::move(err));
    else pending.push_back(r.index);
  }
  std::map<int64_t, Live> live;
  std::map<int64_t, std::vector<int32_t>> generated;  // one-stage: sampling history
  std::vector<int64_t> released;
  std::vector<bool> inflight(size_t(G), false), inflight_rows(size_t(G), false);
  std::vector<int> group_size(size_t(G), 0);
  double kv_used = 0;
  int64_t done_total = 0, tokens_total = 0;
  const int64_t n_total = int64_t(reqs.size());
  auto t_start = Clock::now(), t_progress = Clock::now();
  int64_t shown_done = 0;

  // Applies what the last stage returned for one group's step.
  auto apply = [&](const std::vector<Back>& backs) {
    for (const Back& b : backs) {
      Live& L = live.at(b.req);
      const Request& r = reqs[size_t(b.req)];
      bool decode_step = L.pos > int64_t(r.prompt.size());
      if (!b.logits.empty()) {
        if (r.want_prompt_logits && !decode_step)
          L.result.prompt_logits.insert(L.result.prompt_logits.end(), b.logits.begin(), b.logits.end());
        else if (r.want_logits && decode_step)
          L.result.decode_logits.insert(L.result.decode_logits.end(), b.logits.begin(), b.logits.end());
      }
      if (!b.has_token) continue;
      bool done = false;
      if (L.finishing) {
        done = true;  // the extra step's token is not part of the answer
      } else {
        L.result.tokens.push_back(b.sampled.token);
        ++tokens_total;
        if (r.sampling.logprobs >= 0) {
          L.result.logprobs.push_back(b.sampled.logprob);
          L.result.top_logprobs.push_back(b.sampled.top);
        }
        auto& eos = cfg.eos_token_id;
        bool stop = !r.sampling.ignore_eos &&
                    std::find(eos.begin(), eos.end(), b.sampled.token) != eos.end();
        if (!stop && is_stop) stop = is_stop(r, L.result.tokens);
        if (stop || int64_t(L.result.tokens.size()) >= r.sampling.max_tokens) {
          L.result.finish_reason = stop ? "stop" : "length";
          if (r.extra_final_step) L.finishing = true;
          else done = true;
        }
      }
      if (done) {
        L.result.index = b.req;
        finished.push_back(std::move(L.result));
        kv_used -= L.kv_bytes;
        --group_size[size_t(L.group)];
        released.push_back(b.req);
        generated.erase(b.req);
        live.erase(b.req);
      }
    }
  };

  // Receives what the last stage returned for group g's step in flight.
  auto receive = [&](int g) {
    auto t = Clock::now();
    std::vector<char> msg = recv_bytes(world_, last, kBack);
    stats_.idle_s += since(t);  // waiting for the pipeline: the bubble
    Reader rd(msg);
    std::vector<Back> backs;
    int64_t nb = rd.get<int64_t>();
    for (int64_t i = 0; i < nb; ++i) {
      Back b;
      b.req = rd.get<int64_t>();
      b.has_token = rd.get<bool>();
      b.sampled.token = rd.get<int32_t>();
      b.sampled.logprob = rd.get<float>();
      b.sampled.top = rd.get_vec<std::pair<int32_t, float>>();
      b.logits = rd.get_vec<float>();
      backs.push_back(std::move(b));
    }
    apply(backs);
    inflight[size_t(g)] = inflight_rows[size_t(g)] = false;
  };

  for (int64_t tick = 0;; ++tick) {
    const int g = int(tick % G);
    if (P > 1 && inflight[size_t(g)]) receive(g);  // this group's previous step came back
    // Admit waiting requests into this group (continuous batching), keeping the micro-batches
    // even: a group takes at most its share of max_batch and of the work there is.
    const size_t work_now = live.size() + pending.size();
    const int group_cap = int(std::min<size_t>((size_t(opt_.max_batch) + G - 1) / G, (work_now + G - 1) / G));
    while (!pending.empty() && int(live.size()) < opt_.max_batch && group_size[size_t(g)] < group_cap) {
      const Request& r = reqs[size_t(pending.front())];
      double need = double(r.prompt.size() + size_t(r.sampling.max_tokens) + 1) * double(kv_per_token);
      if (opt_.kv_budget_bytes > 0 && kv_used + need > opt_.kv_budget_bytes) break;  // wait
      Live L;
      L.req = r.index;
      L.group = g;
      L.kv_bytes = need;
      L.cache = std::make_unique<SeqCache>(be, cfg, model_.n_local_layers(),
                                           int64_t(r.prompt.size()) + r.sampling.max_tokens + 1);
      kv_used += need;
      ++group_size[size_t(g)];
      live.emplace(r.index, std::move(L));
      pending.pop_front();
    }
    // Build this group's step: decode tokens first (see Model::forward), then prefill chunks while
    // the step has room (the last one cut to fit; results do not depend on the chunking).
    Step step;
    std::vector<int32_t> tokens;
    std::vector<SeqStep> batch;
    int64_t room = opt_.max_step_tokens;
    for (int pass = 0; pass < 2; ++pass) {
      for (auto& [id, L] : live) {
        if (L.group != g) continue;
        const Request& r = reqs[size_t(id)];
        const int64_t P_len = int64_t(r.prompt.size());
        const bool decode = L.pos >= P_len;
        if (decode != (pass == 0)) continue;
        StepSeq s;
        s.req = id;
        s.start = L.pos;
        if (decode) {
          s.n = 1;
          s.decode = true;
          s.sample = true;
          s.logits_sampled = r.want_logits;
          tokens.push_back(L.result.tokens.back());
        } else {
          s.n = std::min({opt_.prefill_chunk, P_len - L.pos, room});
          if (s.n <= 0) continue;  // no room left in this step: next one
          s.sample = L.pos + s.n == P_len;
          s.logits_all = r.want_prompt_logits;
          tokens.insert(tokens.end(), r.prompt.begin() + L.pos, r.prompt.begin() + L.pos + s.n);
          stats_.prompt_tokens += s.n;
        }
        L.pos += s.n;
        room -= s.n;
        step.seqs.push_back(s);
        batch.push_back({L.cache.get(), s.start, s.n, s.decode});
      }
    }
    step.released = released;
    released.clear();

    // Lockstep of the stage-0 ranks: remaining work, and results waiting to go to rank 0.
    int64_t work = int64_t(pending.size() + live.size());
    for (int i = 0; i < G; ++i) work += inflight_rows[size_t(i)] ? 1 : 0;
    Writer res;
    for (auto& r : finished) put_result(res, r);
    done_total += int64_t(finished.size());
    int64_t mine[3] = {work, int64_t(res.b.size()), int64_t(finished.size())};
    std::vector<int64_t> all(size_t(3 * E));
    auto t = Clock::now();
    stage_comm_.all_gather(mine, sizeof mine, all.data());
    if (col == 0) {
      for (auto& r : finished) on_result(std::move(r));
      for (int c = 1; c < E; ++c) {
        if (all[size_t(3 * c + 1)] == 0) continue;
        std::vector<char> b = recv_bytes(stage_comm_, c, kResults);
        Reader rd(b);
        for (int64_t i = 0; i < all[size_t(3 * c + 2)]; ++i) on_result(get_result(rd));
      }
    } else if (!res.b.empty()) {
      send_bytes(stage_comm_, 0, kResults, res.b);
    }
    stats_.comm_s += since(t);
    finished.clear();
    int64_t global_work = 0, global_done = 0;
    for (int c = 0; c < E; ++c) {
      global_work += all[size_t(3 * c)];
      global_done += all[size_t(3 * c + 2)];
    }
    if (world_.rank() == 0 && opt_.progress) {
      shown_done += global_done;
      if (since(t_progress) > 1.0 || global_work == 0) {
        double el = since(t_start), rate = double(tokens_total) / std::max(el, 1e-9);
        double eta = shown_done > 0 ? el / double(shown_done) * double(n_total - shown_done) : 0;
        std::fprintf(stderr, "\r[glm5] %lld/%lld requests, %.1f tok/s (column 0), ETA %.0f s   ",
                     (long long)shown_done, (long long)n_total, rate, eta);
        if (global_work == 0) std::fprintf(stderr, "\n");
        t_progress = Clock::now();
      }
    }
    if (global_work == 0) {
      if (P > 1) {
        for (int i = 0; i < G; ++i)  // drain the empty steps still in the pipeline
          if (inflight[size_t(i)]) receive(i);
        Step stop;
        stop.stop = true;
        Writer sw;
        put_step(sw, stop);
        send_bytes(world_, next, kStep, sw.b);
      }
      break;
    }
    ++stats_.ticks;

    // Run the step on this stage (possibly empty: the stage's MoE exchanges still pair up).
    const int64_t m = step.rows();
    stats_.max_step_rows = std::max(stats_.max_step_rows, m);
    if (trace_) std::fprintf(stderr, "[trace] rank %d tick %lld group %d rows %lld work %lld\n", world_.rank(), (long long)tick, g, (long long)m, (long long)global_work);
    auto tc = Clock::now();
    float* h = static_cast<float*>(be.alloc(size_t(std::max<int64_t>(m, 1) * H) * sizeof(float)));
    if (m > 0) model_.embed(tokens.data(), m, h);
    model_.forward(batch, h);
    stats_.compute_s += since(tc);
    if (P == 1) {
      tc = Clock::now();
      std::vector<Back> backs = finish_step(model_, step, h, reqs, generated);
      stats_.compute_s += since(tc);
      apply(backs);
    } else {
      Writer sw;
      put_step(sw, step);
      auto ts = Clock::now();
      send_bytes(world_, next, kStep, sw.b);
      send_hidden(world_, be, h, m * H, next);
      stats_.bytes_sent += sw.b.size() + size_t(m * H) * sizeof(float);
      stats_.comm_s += since(ts);
      inflight[size_t(g)] = true;
      inflight_rows[size_t(g)] = m > 0;
    }
    be.free(h);
  }
  stats_.tokens_generated = tokens_total;
}

void Engine::run_later_stage(std::vector<Request>& reqs) {
  const ModelConfig& cfg = model_.config();
  const int P = grid_.stages, col = stats_.column, stage = stats_.stage;
  const int prev = grid_.rank_of(stage - 1, col), first = grid_.rank_of(0, col);
  const int next = stage + 1 < P ? grid_.rank_of(stage + 1, col) : -1;
  const int64_t H = cfg.hidden_size;
  kernels::Backend& be = model_.backend();
  std::map<int64_t, std::unique_ptr<SeqCache>> caches;
  std::map<int64_t, std::vector<int32_t>> generated;
  for (;;) {
    auto t = Clock::now();
    std::vector<char> msg = recv_bytes(world_, prev, kStep);
    stats_.idle_s += since(t);  // waiting for the previous stage: the bubble
    t = Clock::now();
    Reader rd(msg);
    Step step = get_step(rd);
    const int64_t m = step.rows();
    stats_.max_step_rows = std::max(stats_.max_step_rows, m);
    float* h = static_cast<float*>(be.alloc(size_t(std::max<int64_t>(m, 1) * H) * sizeof(float)));
    recv_hidden(world_, be, h, m * H, prev);
    stats_.comm_s += since(t);
    if (trace_) std::fprintf(stderr, "[trace] rank %d got step rows %lld stop %d\n", world_.rank(), (long long)m, int(step.stop));
    if (step.stop) {
      if (next >= 0) send_bytes(world_, next, kStep, msg);
      be.free(h);
      break;
    }
    ++stats_.ticks;
    for (int64_t r : step.released) {
      caches.erase(r);
      generated.erase(r);
    }
    std::vector<SeqStep> batch;
    for (auto& s : step.seqs) {
      auto& c = caches[s.req];
      if (!c) {
        const Request& r = reqs[size_t(s.req)];
        c = std::make_unique<SeqCache>(be, cfg, model_.n_local_layers(),
                                       int64_t(r.prompt.size()) + r.sampling.max_tokens + 1);
      }
      batch.push_back({c.get(), s.start, s.n, s.decode});
    }
    auto tc = Clock::now();
    model_.forward(batch, h);
    stats_.compute_s += since(tc);
    if (next >= 0) {
      auto ts = Clock::now();
      send_bytes(world_, next, kStep, msg);
      send_hidden(world_, be, h, m * H, next);
      stats_.bytes_sent += msg.size() + size_t(m * H) * sizeof(float);
      stats_.comm_s += since(ts);
    } else {
      tc = Clock::now();
      std::vector<Back> backs = finish_step(model_, step, h, reqs, generated);
      stats_.compute_s += since(tc);
      for (auto& b : backs) if (b.has_token) ++stats_.tokens_generated;
      Writer bw;
      bw.put<int64_t>(int64_t(backs.size()));
      for (auto& b : backs) {
        bw.put(b.req); bw.put(b.has_token); bw.put(b.sampled.token); bw.put(b.sampled.logprob);
        bw.put_vec(b.sampled.top); bw.put_vec(b.logits);
      }
      auto ts = Clock::now();
      send_bytes(world_, first, kBack, bw.b);
      stats_.bytes_sent += bw.b.size();
      stats_.comm_s += since(ts);
    }
    be.free(h);
  }
}

}  // namespace glm5::runtime
