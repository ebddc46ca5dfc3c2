// Batch jobs over the engine, plus the tokenize and launch subcommands.
#include "launcher/batch/batch_job.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <deque>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <limits>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <thread>

#include "kernels/core/check.h"
#include "kernels/cpu/device_like.h"
#include "launcher/cli/commands.h"
#include "launcher/cluster/cluster_config.h"
#include "launcher/report/moe_monitor.h"
#include "launcher/serve/serve_signals.h"
#include "runtime/chat.h"
#include "runtime/profile.h"
#include "runtime/tokenizer/tokenizer.h"

namespace glm5::launcher {

using json = nlohmann::json;

std::vector<std::string> finished_keys(const std::string& path) {
  std::vector<std::string> keys;
  std::ifstream f(path);
  std::string line;
  while (std::getline(f, line)) {
    try {  // a line cut short by a kill is ignored (its request runs again)
      json j = json::parse(line);
      // A repeated custom_id is answered by its line: the id itself belongs to its first line.
      const bool duplicate =
          j.contains("error") && j["error"].is_object() && j["error"].value("code", "") == "duplicate_custom_id";
      if (j.contains("custom_id") && j["custom_id"].is_string() && !duplicate)
        keys.push_back("id:" + j["custom_id"].get<std::string>());
      else if (j.contains("line"))
        keys.push_back("line:" + std::to_string(j["line"].get<int64_t>()));
    } catch (...) {}
  }
  return keys;
}

namespace {

// A killed run may leave a record cut short at the end of the output: cut it off (its request
// runs again) so that the appended records start on a line of their own and the file stays JSONL.
// A whole record that only lacks its newline gets the newline.
void end_with_whole_record(const std::string& path) {
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec)) return;
  const uintmax_t size = std::filesystem::file_size(path, ec);
  if (ec || size == 0) return;
  std::ifstream f(path, std::ios::binary);
  CHECK(f, "cannot read --output ", path);
  // Find the start of the last line, reading backwards in blocks.
  uintmax_t end = size, start = 0;
  std::string tail;
  char c = 0;
  f.seekg(std::streamoff(size - 1));
  f.get(c);
  if (c == '\n') return;
  while (end > 0) {
    const uintmax_t n = std::min<uintmax_t>(end, 1 << 16);
    std::string block(size_t(n), '\0');
    f.seekg(std::streamoff(end - n));
    f.read(block.data(), std::streamsize(n));
    const size_t nl = block.rfind('\n');
    if (nl != std::string::npos) {
      start = end - n + nl + 1;
      tail = block.substr(nl + 1) + tail;
      break;
    }
    tail = block + tail;
    end -= n;
  }
  f.close();
  bool whole = false;
  try {
    json j = json::parse(tail);
    whole = j.is_object() && j.contains("line");
  } catch (const json::exception&) {}
  if (whole) {
    std::ofstream f(path, std::ios::app);
    f << '\n';
    f.close();
    CHECK(f, "cannot write --output ", path, ": ", std::strerror(errno));
  } else {
    std::fprintf(stderr, "[glm5] batch: %s ends in a partial record (%llu bytes), cut off; it runs again\n",
                 path.c_str(), (unsigned long long)(size - start));
    std::filesystem::resize_file(path, start, ec);
    CHECK(!ec, "cannot cut the partial last record off --output ", path, ": ", ec.message());
  }
}

}  // namespace

namespace {

// A set of 64-bit key hashes (open addressing, load <= 1/2): the ids seen in the input and those
// already answered in the output, at 16 bytes per key instead of a string set's ~80, so that a
// million-line job's bookkeeping stays a few MB. Two different keys share a hash with
// probability ~n^2 / 2^65 (3e-8 for a million keys).
class KeySet {
 public:
  // True when the key was not in the set before.
  bool insert(const std::string& key) { return insert_hash(hash(key)); }
  bool contains(const std::string& key) const {
    if (slots_.empty()) return false;
    const uint64_t h = hash(key);
    for (size_t i = h & (slots_.size() - 1);; i = (i + 1) & (slots_.size() - 1)) {
      if (slots_[i] == h) return true;
      if (slots_[i] == 0) return false;
    }
  }
  size_t size() const { return count_; }

 private:
  static uint64_t hash(const std::string& key) {
    uint64_t h = 1469598103934665603ull;  // FNV-1a, then a finaliser; 0 marks an empty slot
    for (unsigned char c : key) h = (h ^ c) * 1099511628211ull;
    h ^= h >> 33;
    h *= 0xff51afd7ed558ccdull;
    h ^= h >> 33;
    return h ? h : 1;
  }
  bool insert_hash(uint64_t h) {
    if (2 * (count_ + 1) > slots_.size()) grow();
    for (size_t i = h & (slots_.size() - 1);; i = (i + 1) & (slots_.size() - 1)) {
      if (slots_[i] == h) return false;
      if (slots_[i] == 0) {
        slots_[i] = h;
        ++count_;
        return true;
      }
    }
  }
  void grow() {
    std::vector<uint64_t> old(std::max<size_t>(64, slots_.size() * 2), 0);
    old.swap(slots_);
    count_ = 0;
    for (uint64_t h : old)
      if (h) insert_hash(h);
  }
  std::vector<uint64_t> slots_;
  size_t count_ = 0;
};

// The output JSONL, appended one whole record per write(2), every call checked. A failed or
// short write (disk full, I/O error) is cut off again, so the file keeps only whole records, and
// the job stops with one message naming the file; rerunning the same command answers the rest.
class OutputFile {
 public:
  explicit OutputFile(const std::string& path) : path_(path) {
    fd_ = ::open(path.c_str(), O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
    CHECK(fd_ >= 0, "cannot open --output ", path, " for appending: ", std::strerror(errno));
  }
  ~OutputFile() {
    if (fd_ >= 0) ::close(fd_);
  }
  void write_record(std::string rec) {
    rec += '\n';
    const off_t before = ::lseek(fd_, 0, SEEK_END);
    size_t done = 0;
    while (done < rec.size()) {
      const ssize_t n = ::write(fd_, rec.data() + done, rec.size() - done);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) fail(before, n < 0 ? errno : ENOSPC);
      done += size_t(n);
    }
    ++written_;
  }
  int64_t written() const { return written_; }
  // Flushes to the device and closes, checked (a full disk can show only here on some filesystems).
  void close() {
    if (fd_ < 0) return;
    const int rc = ::fsync(fd_);
    const int err = errno;
    const int crc = ::close(fd_);
    fd_ = -1;
    CHECK(rc == 0 || err == EINVAL || err == EROFS, "cannot write --output ", path_, ": ", std::strerror(err));
    CHECK(crc == 0, "cannot write --output ", path_, ": ", std::strerror(errno));
  }

 private:
  [[noreturn]] void fail(off_t before, int err) {
    if (before >= 0 && ::ftruncate(fd_, before) != 0) {
      // The partial record stays; the next run cuts it off (end_with_whole_record).
    }
    GLM5_FAIL("cannot write --output ", path_, ": ", std::strerror(err), " (", written_,
              " records written in this run; the file holds only whole records: rerun the same command "
              "to answer the rest)");
  }
  std::string path_;
  int fd_ = -1;
  int64_t written_ = 0;
};

// Non-blank lines of a file, counted without holding it (progress line).
int64_t count_lines(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::vector<char> buf(1 << 16);
  int64_t n = 0;
  bool blank = true;
  while (f.read(buf.data(), std::streamsize(buf.size())) || f.gcount() > 0) {
    for (std::streamsize i = 0; i < f.gcount(); ++i) {
      const char c = buf[size_t(i)];
      if (c == '\n') {
        n += blank ? 0 : 1;
        blank = true;
      } else if (c != ' ' && c != '\t' && c != '\r') {
        blank = false;
      }
    }
  }
  return n + (blank ? 0 : 1);
}

// Reads, keys and parses (tokenizes) the input on its own thread, ahead of the engine, into a
// bounded queue of lines: rank 0's tick, which every stage-0 rank waits on, does not wait for JSON
// parsing or tokenization while lines are ready. Blank lines and lines a previous run answered are
// skipped here (answered ones before tokenizing them); duplicates of an earlier custom_id get
// their error here. Only this thread touches the input and the id sets.
class LineReader {
 public:
  LineReader(const std::string& path, const runtime::ModelConfig& mc, const runtime::Tokenizer* tok, KeySet done,
             size_t capacity)
      : in_(path), mc_(mc), tok_(tok), done_(std::move(done)), capacity_(capacity) {
    CHECK(in_, "cannot open --input ", path);
    thread_ = std::thread([this] { run(); });
  }
  ~LineReader() {
    {
      std::lock_guard<std::mutex> lk(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  // The next line (runnable, or an error record to write), or nullopt when none is ready yet.
  std::optional<BatchLine> pop() {
    std::lock_guard<std::mutex> lk(mu_);
    if (err_) std::rethrow_exception(err_);
    if (q_.empty()) return std::nullopt;
    BatchLine b = std::move(q_.front());
    q_.pop_front();
    cv_.notify_all();
    return b;
  }
  // Waits (at most `most`) until the queue is full, the input is read or the reader failed. A job
  // whose first window of lines is ready by then starts with all of it, so its schedule (what is
  // admitted when, preemptions) does not depend on the reader thread's timing.
  void wait_ready(std::chrono::milliseconds most) {
    std::unique_lock<std::mutex> lk(mu_);
    cv_.wait_for(lk, most, [&] { return eof_ || err_ || q_.size() >= capacity_; });
  }
  // The whole input is read and every line taken.
  bool finished() {
    std::lock_guard<std::mutex> lk(mu_);
    if (err_) std::rethrow_exception(err_);
    return eof_ && q_.empty();
  }
  int64_t skipped() const { return skipped_.load(); }

 private:
  void run() {
    try {
      std::string text;
      int64_t line_no = 0;
      while (std::getline(in_, text)) {
        ++line_no;
        if (text.find_first_not_of(" \t\r") == std::string::npos) continue;  // blank line
        std::optional<BatchLine> b = read(text, line_no);
        if (!b) {
          ++skipped_;
          continue;
        }
        std::unique_lock<std::mutex> lk(mu_);
        cv_.wait(lk, [&] { return stop_ || q_.size() < capacity_; });
        if (stop_) return;
        q_.push_back(std::move(*b));
        lk.unlock();
        cv_.notify_all();  // wait_ready
      }
    } catch (...) {
      std::lock_guard<std::mutex> lk(mu_);
      err_ = std::current_exception();
    }
    {
      std::lock_guard<std::mutex> lk(mu_);
      eof_ = true;
    }
    cv_.notify_all();
  }

  // The parsed line, or nullopt when a previous run answered it.
  std::optional<BatchLine> read(const std::string& text, int64_t line_no) {
    bool duplicate = false, keyed = false;
    if (done_.size() > 0) {  // a resumed job: skip answered lines before tokenizing them
      keyed = true;
      if (done_.contains(line_key(text, line_no, duplicate))) return std::nullopt;
    }
    BatchLine b = parse_batch_line(text, line_no, mc_, tok_);
    if (!keyed) duplicate = !b.custom_id.empty() && !seen_.insert(b.key);
    if (duplicate) {
      // The first line owns the id; this one gets an error record, keyed by its line number
      // (see finished_keys), so a rerun neither skips the first line nor answers this one twice.
      b.key = "line:" + std::to_string(line_no);
      b.error_code = "duplicate_custom_id";
      b.error = "line " + std::to_string(line_no) + ": custom_id '" + b.custom_id + "' appears earlier in the input";
    }
    if (done_.contains(b.key)) return std::nullopt;
    return b;
  }

  // The line's key as parse_batch_line + read give it (custom_id, or the line number for a line
  // without one or repeating an earlier one), from its JSON alone; records the id as seen.
  std::string line_key(const std::string& text, int64_t line_no, bool& duplicate) {
    try {
      const json j = parse_client_json(text);  // as parse_batch_line: a too deep line is keyed by line
      if (j.is_object() && j.contains("custom_id") && j["custom_id"].is_string() &&
          !j["custom_id"].get<std::string>().empty()) {
        const std::string id = "id:" + j["custom_id"].get<std::string>();
        if (seen_.insert(id)) return id;
        duplicate = true;
      }
    } catch (const json::exception&) {  // malformed: parse_batch_line's error record, by line
    } catch (const JsonTooDeep&) {}
    return "line:" + std::to_string(line_no);
  }

  std::ifstream in_;
  const runtime::ModelConfig& mc_;
  const runtime::Tokenizer* tok_;
  KeySet done_, seen_;
  const size_t capacity_;
  std::atomic<int64_t> skipped_{0};
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<BatchLine> q_;
  bool eof_ = false, stop_ = false;
  std::exception_ptr err_;
  std::thread thread_;  // last: started once everything above exists
};

// The engine's request source over the input: lines from the LineReader as the columns have room
// (only the lines in flight are held), each line's n choices as requests, error records written
// at once, and one record per line when its last choice finishes. A stop request (a signal, see
// run_batch) ends it at a record boundary: from the next tick on no line is taken, the lines in
// flight are cancelled and get no record (a rerun answers them), and a line whose choices all
// finished normally still gets its record.
class BatchSource final : public runtime::RequestSource {
 public:
  BatchSource(const BatchArgs& a, const runtime::ModelConfig& mc, const runtime::Tokenizer* tok, OutputFile& out,
              int64_t seq_no, KeySet done, size_t window, const std::atomic<int>* stop)
      : reader_(a.input, mc, tok, std::move(done), window), tok_(tok), out_(out), seq_no_(seq_no), stop_(stop) {}

  std::optional<runtime::Request> next() override {
    if (stopping_) return std::nullopt;
    while (expand_.empty()) {
      std::optional<BatchLine> b = reader_.pop();
      if (!b) return std::nullopt;
      if (!b->error.empty()) {  // error records go out at once
        out_.write_record(batch_record(*b, {}, tok_, seq_no_++));
        ++errors_;
        continue;
      }
      hold(std::move(*b));
    }
    runtime::Request r = std::move(expand_.front());
    expand_.pop_front();
    return r;
  }
  bool exhausted() override { return stopping_ || (expand_.empty() && reader_.finished()); }
  // Before the first tick: the reader's first window, or 1 s of it (LineReader::wait_ready).
  void wait_ready() { reader_.wait_ready(std::chrono::seconds(1)); }
  int64_t size_hint() const override { return total_lines_ < 0 ? -1 : total_lines_ - skipped(); }
  // First in each tick: the stop request is taken here, once, for the whole tick.
  void on_status(const runtime::EngineStatus&) override {
    if (!stopping_ && stop_ && stop_->load() != 0) stopping_ = true;
  }
  // Once stopping: every request in flight (indexes the engine never got are ignored by it).
  std::vector<int64_t> take_cancelled() override {
    if (!stopping_ || cancel_sent_) return {};
    cancel_sent_ = true;
    expand_.clear();
    std::vector<int64_t> all;
    for (auto& [index, where] : choice_of_) all.push_back(index);
    return all;
  }

  // Takes the result of one choice; the record is written when the line's last choice is in.
  void write(runtime::Result&& r) {
    auto c = choice_of_.find(r.index);
    CHECK(c != choice_of_.end(), "internal: a result for request ", r.index, ", which is not in flight");
    auto [line, j] = c->second;
    choice_of_.erase(c);
    Held& h = held_.at(line);
    if (stopping_ && r.finish_reason == "cancelled") h.cut = true;  // only a stop cancels in a batch
    h.results[size_t(j)] = std::move(r);
    if (--h.missing > 0) return;
    if (h.cut)
      ++cut_;
    else
      out_.write_record(batch_record(h.line, h.results, tok_, seq_no_++));
    held_.erase(line);
  }
  void set_total_lines(int64_t n) { total_lines_ = n; }
  int64_t to_run() const { return to_run_; }
  int64_t skipped() const { return reader_.skipped() + errors_; }
  // Stopped before the end: lines are left to answer (a stop in the run's last tick leaves none).
  bool stopped_early() { return stopping_ && (cut_ > 0 || !held_.empty() || !expand_.empty() || !reader_.finished()); }

 private:
  // A runnable line: its choices (n per prompt, choice_requests) become requests.
  void hold(BatchLine b) {
    std::vector<runtime::Request> choices = choice_requests(b);
    for (size_t j = 0; j < choices.size(); ++j) {
      runtime::Request& r = choices[j];
      r.index = next_index_++;
      choice_of_[r.index] = {b.line, int64_t(j)};
      expand_.push_back(std::move(r));
    }
    Held h;
    h.results.resize(choices.size());
    h.missing = int64_t(choices.size());
    const int64_t line = b.line;
    h.line = std::move(b);
    held_.emplace(line, std::move(h));
    ++to_run_;
  }

  LineReader reader_;
  const runtime::Tokenizer* tok_;
  OutputFile& out_;
  int64_t seq_no_ = 0, next_index_ = 0, to_run_ = 0, errors_ = 0;
  int64_t total_lines_ = -1;
  int64_t cut_ = 0;               // lines whose choices the stop cancelled
  const std::atomic<int>* stop_;  // the signal that asks to stop (0: none yet)
  bool stopping_ = false, cancel_sent_ = false;
  struct Held {  // a line in flight: its choices' results as they come
    BatchLine line;
    std::vector<runtime::Result> results;
    int64_t missing = 0;
    bool cut = false;  // a choice was cancelled by the stop: no record
  };
  std::map<int64_t, Held> held_;                              // by line number
  std::map<int64_t, std::pair<int64_t, int64_t>> choice_of_;  // request index -> (line, choice)
  std::deque<runtime::Request> expand_;                       // choices of the line just taken
};

// Gathers every rank's counters on rank 0: the report file and one line per rank on stderr.
// The report's MoE section: routing health over all ranks (launcher/report/moe_monitor.h), its warnings
// on stderr.
void add_moe_health(Job& job, json& out, const json& ranks, double imbalance_warn) {
  const MoeHealth h = moe_health(ranks, int(job.config.n_routed_experts), int(job.config.num_experts_per_tok),
                                 job.cluster.expert_parallel, imbalance_warn);
  if (h.layers.empty()) return;
  out["moe"] = to_json(h);
  for (const std::string& w : h.warnings) std::fprintf(stderr, "[glm5] warning: %s\n", w.c_str());
}

// The trace file (collective: every rank sends its events as text): each rank's events on its own
// track, named after its place in the grid; rank 0 writes the pieces as they arrive.
void write_trace(Job& job, const std::string& path, const runtime::Profiler& prof, const json& ranks) {
  const std::string mine = prof.trace_text(job.rank());
  const int n = job.world->size();
  std::vector<int64_t> sizes(static_cast<size_t>(n));
  int64_t my = int64_t(mine.size());
  job.world->all_gather(&my, sizeof my, sizes.data());
  if (job.rank() != 0) return job.world->send(mine.data(), mine.size(), 0, parallel::kTagTrace);
  std::ofstream f(path);
  f << "{\"displayTimeUnit\":\"ms\",\"traceEvents\":[";
  bool first = true;
  const auto emit = [&](const std::string& events) {  // comma-joined events
    if (events.empty()) return;
    if (!first) f << ',';
    f << events;
    first = false;
  };
  for (const json& r : ranks) {
    const int rank = r.at("rank").get<int>();
    emit(json({{"name", "process_name"},
               {"ph", "M"},
               {"pid", rank},
               {"args",
                {{"name", "rank " + std::to_string(rank) + " (stage " + std::to_string(r.at("stage").get<int>()) +
                              ", column " + std::to_string(r.at("column").get<int>()) + ")"}}}})
             .dump());
  }
  emit(mine);
  for (int r = 1; r < n; ++r) {
    std::string b(size_t(sizes[size_t(r)]), '\0');
    job.world->recv(b.data(), b.size(), r, parallel::kTagTrace);
    emit(b);
  }
  f << "]}\n";
  f.close();
  CHECK(f, "cannot write --trace ", path);
}

// How this rank's bytes travel: control messages, MoE payload, hidden states between stages, and
// what went through host memory on the way (staging; all host transfers of a device-like backend).
// "none" where nothing moves (one column: no MoE exchange; one stage: no hops).
json transport(const Job& job) {
  const parallel::Comm& moe = job.moe_payload ? *job.moe_payload : *job.stage_comm;
  const parallel::Comm& hidden = job.engine->hidden_comm();
  json t = {{"control", job.world->transport()},
            {"moe", job.cluster.expert_parallel > 1 ? moe.transport() : "none"},
            {"hidden", job.cluster.stages > 1 ? hidden.transport() : "none"},
            {"staged_bytes", moe.staged_bytes() + hidden.staged_bytes()},
            {"moe_bytes_sent", job.model->moe_bytes_sent()},
            {"moe_payload_bytes_sent", job.model->moe_payload_bytes_sent()}};
  if (const auto* c = kernels::device_like_counters(*job.backend))
    t["host_transfers"] = {
        {"to_host_bytes", c->to_host_bytes}, {"to_device_bytes", c->to_device_bytes}, {"raw_allocs", c->raw_allocs}};
  return t;
}

// Gathers every rank's counters on rank 0 (collective): the report file, the metrics file, one line
// per rank on stderr, then the trace file.
// This rank's part of the report: its engine's counters, routing, memory and (with --profile)
// phase totals.
json rank_report(Job& job, const BatchArgs& a, const runtime::Profiler* prof) {
  const auto& st = job.engine->stats();
  json router = json::array();
  for (const auto& l : job.model->router_load())
    router.push_back({{"layer", l.layer}, {"rows", l.rows}, {"picks", l.picks}});
  json mine = to_json(st);
  mine.update({{"weight_bytes", job.model->weight_bytes()},
               {"router", router},
               {"rows_not_k", job.model->rows_not_k()},
               {"backend", job.backend->name()},
               {"transport", transport(job)},
               {"tokens_per_s", st.wall_s > 0 ? double(st.tokens_generated) / st.wall_s : 0.0}});
  if (prof) mine["profile"] = prof->totals();
  if (prof && !a.trace.empty()) mine["trace_dropped"] = prof->dropped_events();
  return mine;
}

// The per-rank lines on rank 0's stderr: memory, speculative decoding, a truncated trace.
void print_rank_lines(const json& ranks) {
  for (const json& r : ranks) {
    std::fprintf(stderr, "[glm5] rank %d (stage %d, column %d): peak RSS %.1f MiB, weights %.1f MiB\n",
                 r["rank"].get<int>(), r["stage"].get<int>(), r["column"].get<int>(),
                 r["peak_rss_kb"].get<double>() / 1024.0, r["weight_bytes"].get<double>() / 1048576.0);
    if (r.value("spec_verify_steps", int64_t(0)) > 0) {
      std::string at;
      for (const json& x : r["spec_accepted_at"]) at += (at.empty() ? "" : ", ") + std::to_string(x.get<int64_t>());
      std::fprintf(stderr,
                   "[glm5] rank %d: speculative decoding: %lld verify steps, %lld drafts, %lld accepted (per position: "
                   "%s), mean acceptance length %.2f\n",
                   r["rank"].get<int>(), (long long)r["spec_verify_steps"].get<int64_t>(),
                   (long long)r["spec_draft_tokens"].get<int64_t>(),
                   (long long)r["spec_accepted_tokens"].get<int64_t>(), at.c_str(),
                   r["spec_mean_acceptance_length"].get<double>());
    }
    if (r.value("trace_dropped", int64_t(0)) > 0)
      std::fprintf(stderr,
                   "[glm5] warning: rank %d: the trace kept its first phase calls only (%lld later ones dropped)\n",
                   r["rank"].get<int>(), (long long)r["trace_dropped"].get<int64_t>());
  }
}

// --report (the JSON) and --metrics (Prometheus text) on rank 0.
void write_report_files(const BatchArgs& a, const json& full) {
  if (!a.report.empty()) {
    std::ofstream rep(a.report);
    rep << full.dump(1) << '\n';
    rep.close();
    CHECK(rep, "cannot write --report ", a.report);
  }
  if (!a.metrics.empty()) {
    std::ofstream met(a.metrics);
    met << prometheus_text(full);
    met.close();
    CHECK(met, "cannot write --metrics ", a.metrics);
  }
}

// The run report (collective): every rank sends rank 0 its part; rank 0 adds the MoE health,
// writes the files and prints the per-rank lines; then the trace, last, so that the report is
// written whatever happens to it.
void write_report(Job& job, const BatchArgs& a, const runtime::Profiler* prof) {
  json mine = rank_report(job, a, prof);
  std::string s = mine.dump();
  const int n = job.world->size();
  std::vector<int64_t> sizes(static_cast<size_t>(n));
  int64_t my = int64_t(s.size());
  job.world->all_gather(&my, sizeof my, sizes.data());
  if (job.rank() != 0) {
    job.world->send(s.data(), s.size(), 0, parallel::kTagReport);
    if (prof && !a.trace.empty()) write_trace(job, a.trace, *prof, json());
    return;
  }
  json ranks = json::array({std::move(mine)});
  for (int r = 1; r < n; ++r) {
    std::string b(size_t(sizes[size_t(r)]), '\0');
    job.world->recv(b.data(), b.size(), r, parallel::kTagReport);
    ranks.push_back(json::parse(b));
  }
  json full = {{"world_size", n}, {"ranks", ranks}};
  add_moe_health(job, full, ranks, a.imbalance_warn);
  write_report_files(a, full);
  print_rank_lines(ranks);
  if (prof && !a.trace.empty()) write_trace(job, a.trace, *prof, ranks);
}

}  // namespace

int run_batch(const BatchArgs& a, std::unique_ptr<parallel::Comm> world) {
  // Rank 0 decides when the job stops (as serve): a signal to every rank must not end the others.
  if (world->rank() != 0) StopSignals::ignore();
  auto job = make_job(a.model, a.cluster, std::move(world), true, a.overrides);
  const std::unique_ptr<runtime::Tokenizer> tok = runtime::Tokenizer::load_if_present(a.model);
  job->engine->set_tokenizer(tok.get());
  std::unique_ptr<runtime::Profiler> prof;
  if (a.profile || !a.trace.empty()) {
    prof = std::make_unique<runtime::Profiler>(*job->backend, !a.trace.empty());
    job->model->set_profiler(prof.get());
  }
  struct Unset {  // the model outlives the profiler's scope here
    runtime::Model& m;
    ~Unset() { m.set_profiler(nullptr); }
  } unset{*job->model};
  if (job->rank() != 0) {
    job->start_watchdog();
    if (prof) prof->restart();  // every rank's clock starts at the same barrier
    job->engine->run(nullptr, [](runtime::Result&&) {});
    write_report(*job, a, prof.get());
    return 0;
  }
  CHECK(std::ifstream(a.input), "cannot open --input ", a.input);
  end_with_whole_record(a.output);
  KeySet done;
  for (auto& k : finished_keys(a.output)) done.insert(k);
  const size_t answered = done.size();
  OutputFile out(a.output);
  // The reader runs ahead by up to 4 x max_batch lines per column (what the columns may take).
  const size_t window = size_t(4 * job->cluster.max_batch * job->cluster.expert_parallel);
  // A stop request (SIGTERM, SIGINT, SIGUSR1, Open MPI's kill sequence) ends the run at a record
  // boundary: what it says is set before the flag, once.
  std::atomic<int> stop{0};
  std::string stop_what;
  StopSignals signals([&](const StopEvent& e) {
    if (stop.load() != 0) return;
    stop_what = e.what();
    stop.store(e.sig);
  });
  BatchSource src(a, job->config, tok.get(), out, int64_t(answered), std::move(done), window, &stop);
  const int64_t lines = count_lines(a.input);
  src.set_total_lines(lines);
  std::fprintf(stderr, "[glm5] batch: %lld lines in %s (%zu already answered) on %d rank(s)\n",
               (long long)src.size_hint(), a.input.c_str(), answered, job->world->size());
  src.wait_ready();
  job->start_watchdog();
  if (prof) prof->restart();
  job->engine->run(&src, [&](runtime::Result&& r) { src.write(std::move(r)); });
  out.close();
  if (src.stopped_early()) {
    std::fprintf(stderr,
                 "glm5: stopped by %s after %lld of %lld records (%lld in this run); the output holds "
                 "whole records only: rerun the same command to finish\n",
                 stop_what.c_str(), (long long)(int64_t(answered) + out.written()), (long long)lines,
                 (long long)out.written());
    std::fflush(stderr);
    write_report(*job, a, prof.get());
    return kExitStopped;
  }
  std::fprintf(stderr, "[glm5] batch: ran %lld requests; %lld lines were already answered or got an error record\n",
               (long long)src.to_run(), (long long)src.skipped());
  write_report(*job, a, prof.get());
  return 0;
}

int run_tokenize(const std::string& path, bool decode, bool literal_special) {
  runtime::Tokenizer tok = runtime::Tokenizer::load(path);
  std::string line;
  int64_t n = 0;
  while (std::getline(std::cin, line)) {
    ++n;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    json j;
    try {
      j = json::parse(line);
    } catch (const json::exception& e) {
      GLM5_FAIL("stdin line ", n, ": malformed JSON: ", e.what());
    }
    if (decode) {
      CHECK(j.contains("ids") && j["ids"].is_array(), "stdin line ", n, ": expected {\"ids\": [...]}");
      std::vector<int32_t> ids;
      for (auto& x : j["ids"]) {
        CHECK(x.is_number_integer() && x.get<int64_t>() >= 0 && x.get<int64_t>() < tok.vocab_size(), "stdin line ", n,
              ": token id ", describe(x), " outside [0, ", tok.vocab_size(), ")");
        ids.push_back(x.get<int32_t>());
      }
      std::cout << json({{"text", tok.decode(ids)}}).dump(-1, ' ', false, json::error_handler_t::replace) << '\n';
    } else {
      CHECK(j.contains("text") && j["text"].is_string(), "stdin line ", n, ": expected {\"text\": \"...\"}");
      std::cout << json({{"ids", tok.encode(j["text"].get<std::string>(), !literal_special)}}).dump() << '\n';
    }
  }
  return 0;
}

}  // namespace glm5::launcher
