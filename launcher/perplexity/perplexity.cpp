// `glm5 perplexity` (see perplexity.h).
#include "launcher/perplexity/perplexity.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "kernels/core/check.h"
#include "launcher/cli/commands.h"
#include "runtime/sampler.h"
#include "runtime/tokenizer/tokenizer.h"

namespace glm5::launcher {

using json = nlohmann::json;

std::vector<Window> plan_windows(int64_t n, int64_t ctx, int64_t stride) {
  std::vector<Window> w;
  const int64_t score = std::min(stride, ctx - ctx / 2 - 1);  // llama-perplexity: ctx - first - 1
  for (int64_t start = 0; start + ctx <= n; start += stride) w.push_back({start, ctx, ctx - score});
  return w;
}

double log_softmax_at(const float* row, int64_t vocab, int32_t token) {
  return double(runtime::token_logprob(row, vocab, token, 0).logprob);
}

double NllStats::perplexity() const { return std::exp(mean()); }

double NllStats::perplexity_stderr() const {
  if (n < 2) return 0.0;
  const double m = mean(), var = std::max(0.0, sum_sq / double(n) - m * m);
  return perplexity() * std::sqrt(var / double(n - 1));
}

double kl_divergence(const float* base, const float* cur, int64_t vocab) {
  double kl = 0;
  for (int64_t v = 0; v < vocab; ++v) {
    const double p = std::exp(double(base[v]));
    if (p > 0) kl += p * (double(base[v]) - double(cur[v]));
  }
  return std::max(0.0, kl);
}

namespace {

// The full log-softmax of one logits row, in double, stored as float.
void log_softmax_row(const float* row, int64_t vocab, float* out) {
  const double mx = *std::max_element(row, row + vocab);
  double z = 0;
  for (int64_t v = 0; v < vocab; ++v) z += std::exp(double(row[v]) - mx);
  const double norm = mx + std::log(z);
  for (int64_t v = 0; v < vocab; ++v) out[v] = float(double(row[v]) - norm);
}

// A safetensors file of token_ids I32 [N] and logprobs F32 [N, V], written row by row at fixed
// offsets (results arrive in any order) or read back the same way.
class LogprobFile {
 public:
  static LogprobFile create(const std::string& path, int64_t n, int64_t vocab, const json& meta) {
    json h;
    h["__metadata__"] = meta;
    h["token_ids"] = {{"dtype", "I32"}, {"shape", {n}}, {"data_offsets", {0, 4 * n}}};
    h["logprobs"] = {{"dtype", "F32"}, {"shape", {n, vocab}}, {"data_offsets", {4 * n, 4 * n + 4 * n * vocab}}};
    std::string text = h.dump();
    text.append((8 - text.size() % 8) % 8, ' ');
    LogprobFile f(path + ".tmp", O_RDWR | O_CREAT | O_TRUNC, n, vocab, 8 + int64_t(text.size()));
    f.final_ = path;
    const uint64_t len = text.size();
    f.write_at(0, &len, 8);
    f.write_at(8, text.data(), text.size());
    CHECK(::ftruncate(f.fd_, f.base_ + 4 * n + 4 * n * vocab) == 0, path,
          ": cannot size the file: ", std::strerror(errno));
    return f;
  }
  static LogprobFile open(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    CHECK(in, "--kl-base: cannot open ", path);
    uint64_t len = 0;
    in.read(reinterpret_cast<char*>(&len), 8);
    CHECK(in && len < (1u << 26), "--kl-base ", path,
          ": not a safetensors file written by glm5 perplexity --save-logits");
    std::string text(len, '\0');
    in.read(text.data(), std::streamsize(len));
    const json h = json::parse(text, nullptr, false);
    CHECK(!h.is_discarded() && h.contains("logprobs") && h.contains("token_ids") &&
              h["logprobs"]["shape"].size() == 2 && h["logprobs"]["dtype"] == "F32",
          "--kl-base ", path, ": expected tensors token_ids I32 [N] and logprobs F32 [N, vocab]");
    LogprobFile f(path, O_RDONLY, h["logprobs"]["shape"][0].get<int64_t>(), h["logprobs"]["shape"][1].get<int64_t>(),
                  8 + int64_t(len));
    f.meta_ = h.value("__metadata__", json::object());
    return f;
  }
  LogprobFile(LogprobFile&& o) noexcept
      : path_(o.path_), final_(o.final_), fd_(o.fd_), n_(o.n_), vocab_(o.vocab_), base_(o.base_), meta_(o.meta_) {
    o.fd_ = -1;
  }
  ~LogprobFile() {
    if (fd_ >= 0) ::close(fd_);
  }
  int64_t rows() const { return n_; }
  int64_t vocab() const { return vocab_; }
  const json& meta() const { return meta_; }
  void write_row(int64_t i, int32_t token, const float* logprobs) {
    write_at(base_ + 4 * i, &token, 4);
    write_at(base_ + 4 * n_ + 4 * i * vocab_, logprobs, size_t(4 * vocab_));
  }
  void read_row(int64_t i, int32_t* token, float* logprobs) const {
    read_at(base_ + 4 * i, token, 4);
    read_at(base_ + 4 * n_ + 4 * i * vocab_, logprobs, size_t(4 * vocab_));
  }
  // Written whole: flushed, closed and renamed from F.tmp to F.
  void close_checked() {
    CHECK(::fsync(fd_) == 0 && ::close(fd_) == 0, path_, ": write failed: ", std::strerror(errno));
    fd_ = -1;
    CHECK(::rename(path_.c_str(), final_.c_str()) == 0, final_, ": cannot rename from ", path_, ": ",
          std::strerror(errno));
  }

 private:
  LogprobFile(const std::string& path, int flags, int64_t n, int64_t vocab, int64_t base)
      : path_(path), fd_(::open(path.c_str(), flags, 0644)), n_(n), vocab_(vocab), base_(base) {
    CHECK(fd_ >= 0, path, ": cannot open: ", std::strerror(errno));
  }
  void write_at(int64_t off, const void* p, size_t bytes) {
    CHECK(::pwrite(fd_, p, bytes, off) == ssize_t(bytes), path_, ": write failed: ", std::strerror(errno));
  }
  void read_at(int64_t off, void* p, size_t bytes) const {
    CHECK(::pread(fd_, p, bytes, off) == ssize_t(bytes), path_, ": truncated or unreadable at byte ", off);
  }
  std::string path_, final_;  // final_: the name a created file gets once complete
  int fd_ = -1;
  int64_t n_ = 0, vocab_ = 0, base_ = 0;
  json meta_;
};

std::vector<int32_t> read_text_tokens(const PerplexityArgs& a) {
  std::ifstream in(a.file, std::ios::binary);
  CHECK(in, "--file: cannot open ", a.file);
  std::stringstream ss;
  ss << in.rdbuf();
  const runtime::Tokenizer tok = runtime::Tokenizer::load(a.model);
  return tok.encode(ss.str(), /*parse_special=*/false);
}

// Per window: the scored tokens' NLL and, with --kl-base, KL divergence and top-1 agreement.
struct WindowScore {
  std::vector<double> nll, kld;
  std::vector<char> same_top;
  bool done = false;
};

struct Scorer {
  const std::vector<int32_t>& tokens;
  const std::vector<Window>& windows;
  int64_t vocab;
  LogprobFile* save = nullptr;
  const LogprobFile* base = nullptr;
  std::vector<int64_t> row_of;  // first scored row of each window in the logprob files
  std::vector<WindowScore> scores;

  // Without a logprob file the last stage sends each prompt token's logprob (Request::prompt_logprobs,
  // the sampler's token_logprob); with one, the full logits rows (the same function scores them).
  void score(size_t w, const runtime::Result& r) {
    const Window& win = windows[w];
    WindowScore& s = scores[w];
    if (!save && !base) {
      CHECK(int64_t(r.prompt_logprobs.size()) == win.len - 1, "internal: window ", w, " returned ",
            r.prompt_logprobs.size(), " prompt logprobs");
      for (int64_t p = win.first; p < win.len; ++p) s.nll.push_back(-double(r.prompt_logprobs[size_t(p - 1)].logprob));
      s.done = true;
      return;
    }
    const std::vector<float>& logits = r.prompt_logits;
    CHECK(int64_t(logits.size()) == win.len * vocab, "internal: window ", w, " returned ", logits.size(), " logits");
    std::vector<float> lp(static_cast<size_t>(vocab)), blp(base ? static_cast<size_t>(vocab) : 0);
    for (int64_t p = win.first; p < win.len; ++p) {
      const float* row = logits.data() + (p - 1) * vocab;
      const int32_t target = tokens[size_t(win.start + p)];
      s.nll.push_back(-log_softmax_at(row, vocab, target));
      log_softmax_row(row, vocab, lp.data());
      const int64_t i = row_of[w] + (p - win.first);
      if (save) save->write_row(i, target, lp.data());
      if (base) {
        int32_t bt = 0;
        base->read_row(i, &bt, blp.data());
        CHECK(bt == target, "--kl-base: scored token ", i, " is ", bt, " in the base run and ", target,
              " here: the text or the window plan differs");
        s.kld.push_back(kl_divergence(blp.data(), lp.data(), vocab));
        s.same_top.push_back(std::max_element(blp.begin(), blp.end()) - blp.begin() ==
                             std::max_element(lp.begin(), lp.end()) - lp.begin());
      }
    }
    s.done = true;
  }
};

double percentile(std::vector<double> v, double q) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  const double pos = q * double(v.size() - 1);
  const size_t lo = size_t(std::floor(pos)), hi = std::min(v.size() - 1, lo + 1);
  return v[lo] + (v[hi] - v[lo]) * (pos - double(lo));
}

json summarise(const Scorer& sc, const PerplexityArgs& a, int64_t n_tokens) {
  NllStats nll, kl;
  std::vector<double> all_kl;
  int64_t same = 0;
  for (const WindowScore& s : sc.scores) {  // window order: the same sums on every layout
    for (double x : s.nll) nll.add(x);
    for (double x : s.kld) kl.add(x), all_kl.push_back(x);
    for (char c : s.same_top) same += c;
  }
  json out = {{"file", a.file},
              {"ctx", a.ctx},
              {"stride", a.stride},
              {"text_tokens", n_tokens},
              {"windows", sc.windows.size()},
              {"tokens_scored", nll.n},
              {"nll_mean", nll.mean()},
              {"perplexity", nll.perplexity()},
              {"perplexity_stderr", nll.perplexity_stderr()}};
  if (sc.base) {
    const double var = kl.n > 1 ? std::max(0.0, kl.sum_sq / double(kl.n) - kl.mean() * kl.mean()) : 0.0;
    out["kld_mean"] = kl.mean();
    out["kld_stderr"] = kl.n > 1 ? std::sqrt(var / double(kl.n - 1)) : 0.0;
    out["kld_median"] = percentile(all_kl, 0.5);
    out["kld_p99"] = percentile(all_kl, 0.99);
    out["kld_max"] = all_kl.empty() ? 0.0 : *std::max_element(all_kl.begin(), all_kl.end());
    out["top1_agreement"] = kl.n ? double(same) / double(kl.n) : 0.0;
  }
  return out;
}

void print_table(const json& r) {
  std::printf("file %s: %lld tokens, %lld windows of %lld (stride %lld), %lld tokens scored\n",
              r["file"].get<std::string>().c_str(), (long long)r["text_tokens"], (long long)r["windows"].get<int64_t>(),
              (long long)r["ctx"], (long long)r["stride"], (long long)r["tokens_scored"]);
  std::printf("perplexity %.6f +/- %.6f  (mean NLL %.6f nats/token)\n", r["perplexity"].get<double>(),
              r["perplexity_stderr"].get<double>(), r["nll_mean"].get<double>());
  if (r.contains("kld_mean"))
    std::printf("KL divergence vs base: mean %.6g +/- %.2g, median %.6g, p99 %.6g, max %.6g; top-1 agreement %.4f %%\n",
                r["kld_mean"].get<double>(), r["kld_stderr"].get<double>(), r["kld_median"].get<double>(),
                r["kld_p99"].get<double>(), r["kld_max"].get<double>(), 100.0 * r["top1_agreement"].get<double>());
}

}  // namespace

int run_perplexity(const PerplexityArgs& args, std::unique_ptr<parallel::Comm> world) {
  PerplexityArgs a = args;
  if (a.stride == 0) a.stride = a.ctx;
  CHECK(a.ctx >= 4, "--ctx: expected at least 4 tokens, found ", a.ctx);
  CHECK(a.chunks >= 0, "--chunks: expected >= 0, found ", a.chunks);
  CHECK(a.stride >= 1 && a.stride <= a.ctx, "--stride: expected 1..--ctx (", a.ctx, "), found ", a.stride);
  auto job = make_job(a.model, a.cluster, std::move(world), /*progress=*/true, a.overrides);
  CHECK(a.ctx <= job->config.max_position_embeddings, "--ctx ", a.ctx, " exceeds max_position_embeddings ",
        job->config.max_position_embeddings, " of ", job->config.source);
  const bool root = job->rank() == 0;
  std::vector<int32_t> tokens;
  std::vector<Window> windows;
  std::vector<runtime::Request> reqs;
  if (root) {
    tokens = read_text_tokens(a);
    windows = plan_windows(int64_t(tokens.size()), a.ctx, a.stride);
    if (a.chunks > 0 && int64_t(windows.size()) > a.chunks) windows.resize(size_t(a.chunks));
    CHECK(!windows.empty(), "--file ", a.file, ": ", tokens.size(), " tokens, fewer than one window of --ctx ", a.ctx);
    for (size_t w = 0; w < windows.size(); ++w) {
      runtime::Request r;
      r.index = int64_t(w);
      r.prompt.assign(tokens.begin() + windows[w].start, tokens.begin() + windows[w].start + windows[w].len);
      r.sampling.max_tokens = 1;
      r.sampling.temperature = 0;
      r.sampling.ignore_eos = true;
      if (a.save_logits.empty() && a.kl_base.empty())
        r.prompt_logprobs = 0;
      else
        r.want_prompt_logits = true;
      reqs.push_back(std::move(r));
    }
  }
  const int64_t V = job->config.vocab_size;
  Scorer sc{
      .tokens = tokens, .windows = windows, .vocab = V, .save = nullptr, .base = nullptr, .row_of = {}, .scores = {}};
  sc.scores.resize(windows.size());
  int64_t n_rows = 0;
  for (const Window& w : windows) sc.row_of.push_back(n_rows), n_rows += w.len - w.first;
  std::unique_ptr<LogprobFile> save, base;
  if (root && !a.save_logits.empty()) {
    const json meta = {{"producer", "glm5 perplexity --save-logits"},
                       {"file", a.file},
                       {"ctx", std::to_string(a.ctx)},
                       {"stride", std::to_string(a.stride)}};
    save = std::make_unique<LogprobFile>(LogprobFile::create(a.save_logits, n_rows, V, meta));
    sc.save = save.get();
  }
  if (root && !a.kl_base.empty()) {
    base = std::make_unique<LogprobFile>(LogprobFile::open(a.kl_base));
    CHECK(base->rows() == n_rows && base->vocab() == V, "--kl-base ", a.kl_base, ": ", base->rows(), " rows of ",
          base->vocab(), " logprobs, expected ", n_rows, " of ", V, " (same text, --ctx and --stride as the base run)");
    for (const auto& [key, mine] : {std::pair{"ctx", a.ctx}, std::pair{"stride", a.stride}})
      CHECK(base->meta().value(key, std::to_string(mine)) == std::to_string(mine), "--kl-base ", a.kl_base,
            ": the base run used --", key, " ", base->meta().value(key, std::string()), ", this run ", mine);
    sc.base = base.get();
  }
  job->start_watchdog();
  job->engine->run(reqs, [&](runtime::Result&& r) {
    CHECK(r.error.empty(), "window ", r.index, ": ", r.error);
    sc.score(size_t(r.index), r);
  });
  if (!root) return 0;
  for (size_t w = 0; w < sc.scores.size(); ++w) CHECK(sc.scores[w].done, "internal: no result for window ", w);
  if (save) save->close_checked();
  const json r = summarise(sc, a, int64_t(tokens.size()));
  if (a.json)
    std::cout << r.dump() << std::endl;
  else
    print_table(r);
  return 0;
}

}  // namespace glm5::launcher
