// Signals to a distributed job, as Kubernetes, Slurm and a terminal send them (RELIABILITY.md,
// Signals), on tiny-a under mpirun, 2 stages x 2 expert ranks, real processes and real clients
// (curl):
// - serve: SIGTERM or SIGINT to mpirun (Open MPI 4.1's kill sequence: SIGCONT, SIGTERM after
//   odls_base_sigkill_timeout, SIGKILL as long again) drains: the streams in flight end whole when
//   the sequence leaves room, with an error event and [DONE] (never cut) when it does not; mpirun
//   itself exits 1 (Open MPI's fixed status after SIGTERM). SIGTERM to every rank at once and to
//   `glm5 launch --run` drain and end the job with 0. Ctrl-Z / fg of mpirun is not a stop.
// - batch: stopped mid-run (SIGTERM to mpirun, to every rank, to `glm5 launch --run`) it writes
//   whole records only and says how far it got; reruns of the same command finish the file with
//   each id once and the records of an uninterrupted run.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <regex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "tests/test_support.h"

namespace fs = std::filesystem;
using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

namespace {

using glm5::testing::contains;
using glm5::testing::ExitStatus;
using glm5::testing::kBin;
using glm5::testing::kData;
using glm5::testing::kSanitized;
using glm5::testing::kSrc;
using glm5::testing::mpirun;
using glm5::testing::slurp;

const std::string kTinyA = kData + "/tiny-a";
const std::string kCluster22 = kSrc + "/cluster-configs/cpu-pp2-ep2.yaml";

const glm5::testing::ScratchDir scratch("glm5_signals");

double since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// The pids whose parent is `pid` (the ranks of an mpirun).
std::vector<pid_t> children(pid_t pid) {
  std::vector<pid_t> out;
  for (const auto& e : fs::directory_iterator("/proc")) {
    const std::string name = e.path().filename().string();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    const std::string stat = slurp(e.path() / "stat");
    const size_t close = stat.rfind(')');
    if (close == std::string::npos) continue;
    std::istringstream ss(stat.substr(close + 2));
    char state = 0;
    pid_t ppid = 0;
    ss >> state >> ppid;
    if (ppid == pid) out.push_back(pid_t(std::stoi(name)));
  }
  return out;
}

// A process's state letter from /proc/<pid>/stat ('T': stopped), or 0 when it is gone.
char process_state(pid_t pid) {
  const std::string stat = slurp("/proc/" + std::to_string(pid) + "/stat");
  const size_t close = stat.rfind(')');
  return close == std::string::npos || close + 2 >= stat.size() ? 0 : stat[close + 2];
}

// A command started in the background (sh -c "exec CMD", stdin from /dev/null, stdout and stderr
// to `log`): pid is the command's own. Killed with its children when the test leaves early.
class Background {
 public:
  Background(const std::string& cmd, fs::path log) : log_(std::move(log)) {
    setenv("OMP_NUM_THREADS", "1", 1);
    pid_ = fork();
    if (pid_ == 0) {
      const int fd = ::open(log_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      const int in = ::open("/dev/null", O_RDONLY);
      dup2(in, 0);
      dup2(fd, 1);
      dup2(fd, 2);
      execl("/bin/sh", "sh", "-c", ("exec " + cmd).c_str(), static_cast<char*>(nullptr));
      _exit(127);
    }
  }
  ~Background() {
    if (status_) return;
    for (pid_t c : children(pid_)) {
      for (pid_t g : children(c)) kill(g, SIGKILL);  // ranks under glm5 launch's mpirun
      kill(c, SIGKILL);
    }
    kill(pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);
  }
  pid_t pid() const { return pid_; }
  std::string log() const { return slurp(log_); }
  // How it ended, or nullopt if it is still running after `timeout_s`.
  std::optional<ExitStatus> wait(double timeout_s) {
    const auto t0 = Clock::now();
    while (running()) {
      if (since(t0) > timeout_s) return std::nullopt;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return status_;
  }
  bool running() {
    if (status_) return false;
    int status = 0;
    if (waitpid(pid_, &status, WNOHANG) != pid_) return true;
    status_ = glm5::testing::exit_status(status);
    return false;
  }

 private:
  fs::path log_;
  pid_t pid_ = -1;
  std::optional<ExitStatus> status_;
};

// Waits until pred() holds (true) or `timeout_s` passes (false).
template <class F>
bool wait_until(F pred, double timeout_s) {
  const auto t0 = Clock::now();
  while (!pred()) {
    if (since(t0) > timeout_s) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return true;
}

// A server under mpirun (or glm5 launch): its port and rank 0's pid, from the `listening on` line.
struct Server {
  std::unique_ptr<Background> job;
  int port = 0;
  pid_t rank0 = 0;
};

Server start_server(const std::string& cmd, const std::string& name) {
  Server s;
  s.job = std::make_unique<Background>(cmd, scratch(name + ".log"));
  const std::regex re(R"(listening on http://[0-9.]+:(\d+) .*pid (\d+))");
  std::smatch m;
  const bool up = wait_until(
      [&] {
        const std::string log = s.job->log();
        if (std::regex_search(log, m, re)) {
          s.port = std::stoi(m[1]);
          s.rank0 = pid_t(std::stoi(m[2]));
          return true;
        }
        return !s.job->running();
      },
      60);
  EXPECT_TRUE(up && s.port > 0) << "the server did not start:\n" << s.job->log();
  return s;
}

std::string serve_args(const std::string& extra = "") {
  return kBin + " serve --model " + kTinyA + " --cluster " + kCluster22 + " --port 0 " + extra;
}

// A streaming completion by curl (`max_tokens` generated tokens, greedy), its body to a file.
struct Stream {
  std::unique_ptr<Background> curl;
  fs::path body;
};

Stream start_stream(const Server& s, int max_tokens, const std::string& name) {
  Stream st;
  st.body = scratch(name + ".sse");
  const std::string req = json({{"model", "tiny-a"},
                                {"prompt", {1, 2, 3}},
                                {"max_tokens", max_tokens},
                                {"ignore_eos", true},
                                {"temperature", 0},
                                {"stream", true}})
                              .dump();
  st.curl = std::make_unique<Background>("curl -sN -m 120 -o " + st.body.string() +
                                             " http://127.0.0.1:" + std::to_string(s.port) +
                                             "/v1/completions -H 'Content-Type: application/json' -d '" + req + "'",
                                         scratch(name + ".curl"));
  return st;
}

size_t events(const fs::path& body) {
  const std::string b = slurp(body);
  size_t n = 0;
  for (size_t at = b.find("data: "); at != std::string::npos; at = b.find("data: ", at + 1)) ++n;
  return n;
}

// What a stream's body says: tokens, the finish reason, an error event's code, and [DONE] last.
struct StreamResult {
  int curl_code = -1;
  size_t tokens = 0;
  std::string finish, error;
  bool done = false;
};

StreamResult finish_stream(Stream& st) {
  StreamResult r;
  auto status = st.curl->wait(60);
  EXPECT_TRUE(status.has_value()) << "curl still running after 60 s";
  if (status) r.curl_code = status->code;
  std::istringstream ss(slurp(st.body));
  for (std::string line; std::getline(ss, line);) {
    if (!line.starts_with("data: ")) continue;
    r.done = line == "data: [DONE]";
    if (r.done) continue;
    const json j = json::parse(line.substr(6));
    if (j.contains("error")) r.error = j["error"].value("code", "?");
    for (const auto& c : j.value("choices", json::array())) {
      if (c.contains("token_ids") && c["token_ids"].is_array()) r.tokens += c["token_ids"].size();
      if (c.contains("finish_reason") && c["finish_reason"].is_string()) r.finish = c["finish_reason"];
    }
  }
  return r;
}

// The HTTP status of GET /health (0: no answer).
int health(const Server& s) {
  const fs::path out = scratch("health.txt");
  glm5::testing::sh(
      "curl -s -m 5 -o /dev/null -w '%{http_code}' http://127.0.0.1:" + std::to_string(s.port) + "/health", out);
  const std::string code = slurp(out);
  return code.empty() ? 0 : std::atoi(code.c_str());
}

void start_streams(const Server& s, std::vector<Stream>& streams, int n, int max_tokens, const std::string& name) {
  for (int i = 0; i < n; ++i) streams.push_back(start_stream(s, max_tokens, name + std::to_string(i)));
  // Accepted and running: a few events each.
  for (auto& st : streams)
    ASSERT_TRUE(wait_until([&] { return events(st.body) >= 3; }, 30)) << slurp(st.body) << "\n" << s.job->log();
}

// Tokens a stream that must end whole inside a drain asks for: 3000 take about 5 s in the optimised
// build (2 cores); a sanitized one on busy cores makes about 40 a second.
constexpr unsigned kLongStream = kSanitized ? 300 : 3000;
constexpr unsigned kWholeStream = kSanitized ? 300 : 1200;

// SIGTERM to mpirun with Open MPI's kill sequence stretched to 8 s a step: the ranks hear the
// SIGCONT at once and drain; the streams in flight end whole, new requests get 503, mpirun exits
// with its own fixed 1 once the sequence is over.
TEST(Signals, ServeSigtermToMpirunDrains) {
  const auto t_test = Clock::now();
  Server s = start_server(mpirun(4) + "--mca odls_base_sigkill_timeout 8 " + serve_args(), "serve_mpirun");
  ASSERT_GT(s.port, 0);
  std::vector<Stream> streams;
  start_streams(s, streams, 2, kLongStream, "drain");
  const auto t0 = Clock::now();
  ASSERT_EQ(0, kill(s.job->pid(), SIGTERM));
  EXPECT_TRUE(wait_until([&] { return health(s) == 503; }, 5)) << "not draining:\n" << s.job->log();
  for (auto& st : streams) {
    const StreamResult r = finish_stream(st);
    EXPECT_EQ(r.curl_code, 0) << slurp(st.body);
    EXPECT_EQ(r.tokens, kLongStream) << "stream cut or cancelled " << since(t0) << " s after SIGTERM";
    EXPECT_EQ(r.finish, "length");
    EXPECT_EQ(r.error, "");
    EXPECT_TRUE(r.done);
  }
  const double streams_s = since(t0);
  const auto status = s.job->wait(40);
  ASSERT_TRUE(status.has_value()) << "mpirun still running 40 s after SIGTERM:\n" << s.job->log();
  // Open MPI 4.1: mpirun's exit status after SIGTERM / SIGINT is 1, whatever the ranks return.
  EXPECT_FALSE(status->signaled);
  EXPECT_EQ(status->code, 1) << s.job->log();
  const std::string log = s.job->log();
  EXPECT_TRUE(contains(log, "signal 18: draining (SIGCONT from mpirun: its kill sequence")) << log;
  EXPECT_TRUE(contains(log, "drained; exiting")) << log;
  EXPECT_FALSE(contains(log, "drain timeout")) << log;
  std::fprintf(stderr, "streams done %.1f s after SIGTERM, mpirun exited after %.1f s; test %.1f s\n", streams_s,
               since(t0), since(t_test));
}

// SIGINT to mpirun (Ctrl-C) starts the same kill sequence as SIGTERM. By default (SIGKILL 2 s
// after the signal) it leaves no room for long streams: they are cancelled before it, so each
// client gets an error event and [DONE], not a cut connection.
TEST(Signals, ServeSigintToMpirunCancelsBeforeItsKill) {
  const auto t_test = Clock::now();
  unsetenv("OMPI_MCA_odls_base_sigkill_timeout");
  Server s = start_server(mpirun(4) + serve_args(), "serve_mpirun_short");
  ASSERT_GT(s.port, 0);
  std::vector<Stream> streams;
  start_streams(s, streams, 2, 4000, "cut");
  const auto t0 = Clock::now();
  ASSERT_EQ(0, kill(s.job->pid(), SIGINT));
  for (auto& st : streams) {
    const StreamResult r = finish_stream(st);
    EXPECT_EQ(r.curl_code, 0) << "the connection was cut:\n" << slurp(st.body);
    EXPECT_EQ(r.error, "unavailable") << r.tokens << " tokens";
    EXPECT_LT(r.tokens, 4000u);
    EXPECT_TRUE(r.done);
  }
  const double streams_s = since(t0);  // before mpirun's SIGKILL at 2 s, or curl would have failed
  const auto status = s.job->wait(30);
  ASSERT_TRUE(status.has_value()) << s.job->log();
  EXPECT_FALSE(status->signaled);
  EXPECT_EQ(status->code, 1) << s.job->log();
  const std::string log = s.job->log();
  EXPECT_TRUE(contains(log, "drain timeout (mpirun's SIGKILL is near)")) << log;
  EXPECT_TRUE(contains(log, "drained; exiting")) << log;
  std::fprintf(stderr, "streams ended %.1f s after SIGINT, mpirun after %.1f s; test %.1f s\n", streams_s, since(t0),
               since(t_test));
}

// SIGTERM to every rank at once (Slurm's scancel with srun, or a process-group kill): rank 0
// drains, the other ranks ignore it and follow rank 0's stop; every rank exits 0, so mpirun does.
TEST(Signals, ServeSigtermToEveryRankDrains) {
  const auto t_test = Clock::now();
  Server s = start_server(mpirun(4) + serve_args(), "serve_ranks");
  ASSERT_GT(s.port, 0);
  std::vector<Stream> streams;
  start_streams(s, streams, 2, kWholeStream, "ranks");
  const std::vector<pid_t> ranks = children(s.job->pid());
  ASSERT_EQ(ranks.size(), 4u);
  const auto t0 = Clock::now();
  for (pid_t r : ranks) ASSERT_EQ(0, kill(r, SIGTERM));
  for (auto& st : streams) {
    const StreamResult r = finish_stream(st);
    EXPECT_EQ(r.curl_code, 0) << slurp(st.body);
    EXPECT_EQ(r.tokens, kWholeStream);
    EXPECT_EQ(r.error, "");
    EXPECT_TRUE(r.done);
  }
  const auto status = s.job->wait(30);
  ASSERT_TRUE(status.has_value()) << s.job->log();
  EXPECT_FALSE(status->signaled);
  EXPECT_EQ(status->code, 0) << s.job->log();
  EXPECT_TRUE(contains(s.job->log(), "signal 15: draining (SIGTERM;")) << s.job->log();
  EXPECT_TRUE(contains(s.job->log(), "drained; exiting")) << s.job->log();
  std::fprintf(stderr, "job ended %.1f s after SIGTERM; test %.1f s\n", since(t0), since(t_test));
}

// A cluster config for `glm5 launch --run` here (root, an oversubscribed small machine).
fs::path launch_config(const std::string& name = "launch-2x2.yaml", const std::string& extra = "") {
  const fs::path cfg = scratch(name);
  std::ofstream(cfg) << "stages: 2\nexpert_parallel: 2\nmicro_batches: 2\nbackend: cpu\ncomm: mpi\n"
                     << "mpirun_args: [\"--oversubscribe\", \"--mca\", \"btl\", \"self,vader,tcp\"]\n"
                     << "env: {OMP_NUM_THREADS: \"1\"}\n"
                     << extra;
  return cfg;
}

// `glm5 launch --run` execs "mpirun" from PATH: the configured one first.
std::string launch(const fs::path& cfg, const std::string& args) {
  const std::string path = fs::path(GLM5_MPIRUN).parent_path().string() + ":" + std::getenv("PATH");
  return "env PATH='" + path + "' " + kBin + " launch --run --cluster " + cfg.string() + " -- " + args;
}

// SIGTERM to `glm5 launch --run` (what Kubernetes sends the container's first process): it becomes
// SIGUSR1 to mpirun, which forwards it; the streams end whole and the job exits 0.
TEST(Signals, ServeSigtermToLaunchDrainsAndExits0) {
  const auto t_test = Clock::now();
  const std::string args = "serve --model " + kTinyA + " --port 0";
  Server s = start_server(launch(launch_config(), args), "serve_launch");
  ASSERT_GT(s.port, 0);
  std::vector<Stream> streams;
  start_streams(s, streams, 2, kWholeStream, "launch");
  const auto t0 = Clock::now();
  ASSERT_EQ(0, kill(s.job->pid(), SIGTERM));
  for (auto& st : streams) {
    const StreamResult r = finish_stream(st);
    EXPECT_EQ(r.curl_code, 0) << slurp(st.body);
    EXPECT_EQ(r.tokens, kWholeStream);
    EXPECT_EQ(r.error, "");
  }
  const auto status = s.job->wait(30);
  ASSERT_TRUE(status.has_value()) << s.job->log();
  EXPECT_FALSE(status->signaled);
  EXPECT_EQ(status->code, 0) << s.job->log();
  EXPECT_TRUE(contains(s.job->log(), "signal 10: draining (SIGUSR1;")) << s.job->log();
  std::fprintf(stderr, "job ended %.1f s after SIGTERM; test %.1f s\n", since(t0), since(t_test));
}

// Ctrl-Z then fg of mpirun (SIGTSTP: mpirun stops the ranks; SIGCONT: it continues them) is job
// control, not the SIGCONT of Open MPI's kill sequence: the server goes on serving. The stop is
// timed from when every rank is stopped: mpirun forwards both signals through its event loop, so
// on a busy machine a fixed pause after SIGTSTP could hold a shorter stop than a person's Ctrl-Z
// (under 250 ms reads as the kill sequence, RELIABILITY.md).
TEST(Signals, ServeCtrlZOfMpirunIsNotAStop) {
  Server s = start_server(mpirun(4) + serve_args(), "serve_tstp");
  ASSERT_GT(s.port, 0);
  const std::vector<pid_t> ranks = children(s.job->pid());
  ASSERT_EQ(ranks.size(), 4u) << s.job->log();
  const auto stopped = [&] {
    return std::all_of(ranks.begin(), ranks.end(), [](pid_t r) { return process_state(r) == 'T'; });
  };
  ASSERT_EQ(0, kill(s.job->pid(), SIGTSTP));
  ASSERT_TRUE(wait_until(stopped, 30)) << "the ranks did not stop:\n" << s.job->log();
  std::this_thread::sleep_for(std::chrono::seconds(1));
  ASSERT_EQ(0, kill(s.job->pid(), SIGCONT));
  ASSERT_TRUE(wait_until(
      [&] { return std::none_of(ranks.begin(), ranks.end(), [](pid_t r) { return process_state(r) == 'T'; }); }, 30))
      << "the ranks did not continue:\n"
      << s.job->log();
  EXPECT_EQ(health(s), 200) << s.job->log();
  std::vector<Stream> streams;
  streams.push_back(start_stream(s, 64, "after_fg"));
  const StreamResult r = finish_stream(streams[0]);
  EXPECT_EQ(r.tokens, 64u) << slurp(streams[0].body) << "\n" << s.job->log();
  EXPECT_EQ(r.error, "");
  EXPECT_FALSE(contains(s.job->log(), "draining")) << s.job->log();
  ASSERT_EQ(0, kill(s.rank0, SIGTERM));
  const auto status = s.job->wait(30);
  ASSERT_TRUE(status.has_value()) << s.job->log();
  EXPECT_EQ(status->code, 0) << s.job->log();
}

// ---- batch ----

// 300 short requests (96 tokens each, greedy; 24 in a sanitized build) in waves of 16 (max_batch 8
// per column): a stop finds lines in flight and records already written.
fs::path batch_input() {
  const fs::path in = scratch("batch300.jsonl");
  std::ofstream f(in);
  for (int i = 0; i < 300; ++i) {
    char id[16];
    std::snprintf(id, sizeof id, "r%03d", i);
    f << json({{"custom_id", id},
               {"prompt_ids", {1 + i % 50, 2, 3, 4 + i % 7}},
               {"max_tokens", kSanitized ? 24 : 96},
               {"temperature", 0},
               {"ignore_eos", true}})
             .dump()
      << "\n";
  }
  return in;
}

fs::path batch_config() { return launch_config("batch-2x2.yaml", "max_batch: 8\n"); }

std::string batch_args(const fs::path& cfg, const fs::path& in, const fs::path& out) {
  return kBin + " batch --model " + kTinyA + " --cluster " + cfg.string() + " --input " + in.string() + " --output " +
         out.string();
}

size_t lines_in(const fs::path& p) {
  const std::string t = slurp(p);
  return size_t(std::count(t.begin(), t.end(), '\n'));
}

// Every line of the output is a whole record (JSON with its newline): custom_id -> token ids.
std::map<std::string, std::vector<int>> records(const fs::path& out, size_t& n) {
  const std::string text = slurp(out);
  EXPECT_TRUE(text.empty() || text.back() == '\n') << "a partial last line: " << text.substr(text.size() - 200);
  std::map<std::string, std::vector<int>> by_id;
  std::istringstream ss(text);
  n = 0;
  for (std::string line; std::getline(ss, line);) {
    ++n;
    json j;
    EXPECT_NO_THROW(j = json::parse(line)) << "line " << n << " is not a whole record: " << line;
    if (!j.is_object()) continue;
    const std::string id = j.value("custom_id", "");
    EXPECT_EQ(by_id.count(id), 0u) << id << " twice";
    by_id[id] = j["response"]["body"]["choices"][0]["token_ids"].get<std::vector<int>>();
  }
  return by_id;
}

// Runs `cmd` and signals it once the output holds `at_least` records: `to_ranks` sends SIGTERM to
// every rank (children of the mpirun), else to the process itself. Returns how it ended and its log.
std::pair<ExitStatus, std::string> stop_batch(const std::string& cmd, const fs::path& out, size_t at_least,
                                              bool to_ranks, const std::string& name) {
  Background job(cmd, scratch(name + ".log"));
  const bool reached = wait_until([&] { return lines_in(out) >= at_least || !job.running(); }, 60);
  EXPECT_TRUE(reached && job.running()) << name << ": the job ended before the signal:\n" << job.log();
  if (to_ranks) {
    std::vector<pid_t> ranks = children(job.pid());
    EXPECT_EQ(ranks.size(), 4u);
    for (pid_t r : ranks) kill(r, SIGTERM);
  } else {
    kill(job.pid(), SIGTERM);
  }
  const auto status = job.wait(30);
  EXPECT_TRUE(status.has_value()) << name << " still running 30 s after SIGTERM:\n" << job.log();
  return {status.value_or(ExitStatus{}), job.log()};
}

TEST(Signals, BatchStopsAtRecordBoundaryAndRerunFinishes) {
  const auto t_test = Clock::now();
  const fs::path in = batch_input(), cfg = batch_config();
  const fs::path out = scratch("batch_out.jsonl"), ref = scratch("batch_ref.jsonl");
  fs::remove(out);
  fs::remove(ref);
  const std::string cmd = mpirun(4) + batch_args(cfg, in, out);
  size_t n = 0, before = 0;

  // 1. SIGTERM to mpirun: Open MPI's kill sequence; mpirun's own status is 1.
  auto [s1, log1] = stop_batch(cmd, out, 40, false, "stop_mpirun");
  EXPECT_EQ(s1.code, 1) << log1;
  EXPECT_FALSE(s1.signaled);
  // Its SIGCONT, or (this rank starved at that moment, so it took it for job control) its SIGTERM.
  EXPECT_TRUE(contains(log1, "glm5: stopped by SIGCONT from mpirun") ||
              contains(log1, "glm5: stopped by SIGTERM from mpirun"))
      << log1;
  EXPECT_TRUE(contains(log1, "rerun the same command to finish")) << log1;
  records(out, n);
  EXPECT_GE(n, 40u);
  EXPECT_LT(n, 300u);
  EXPECT_TRUE(contains(log1, "after " + std::to_string(n) + " of 300 records")) << log1;

  // 2. The rerun, stopped by SIGTERM to every rank (scancel): rank 0's 75 is mpirun's status.
  before = n;
  auto [s2, log2] = stop_batch(cmd, out, before + 40, true, "stop_ranks");
  EXPECT_EQ(s2.code, 75) << log2;
  EXPECT_FALSE(s2.signaled);
  EXPECT_TRUE(contains(log2, "glm5: stopped by SIGTERM after")) << log2;
  EXPECT_TRUE(contains(log2, std::to_string(before) + " already answered")) << log2;
  records(out, n);
  EXPECT_LT(n, 300u);

  // 3. Again through glm5 launch --run: SIGTERM becomes SIGUSR1 to mpirun; 75 again.
  before = n;
  auto [s3, log3] =
      stop_batch(launch(cfg, "batch --model " + kTinyA + " --input " + in.string() + " --output " + out.string()), out,
                 before + 40, false, "stop_launch");
  EXPECT_EQ(s3.code, 75) << log3;
  EXPECT_TRUE(contains(log3, "glm5: stopped by SIGUSR1 after")) << log3;
  records(out, n);
  EXPECT_LT(n, 300u);

  // 4. The rerun finishes: each id once, the records of an uninterrupted run.
  ASSERT_EQ(0, glm5::testing::sh(cmd, scratch("finish.log"))) << slurp(scratch("finish.log"));
  const auto got = records(out, n);
  EXPECT_EQ(n, 300u);
  EXPECT_EQ(got.size(), 300u);
  const double stops_s = since(t_test);
  ASSERT_EQ(0, glm5::testing::sh(mpirun(4) + batch_args(cfg, in, ref), scratch("ref.log")))
      << slurp(scratch("ref.log"));
  size_t nref = 0;
  EXPECT_EQ(got, records(ref, nref));
  std::fprintf(stderr, "three stops and the rerun %.1f s, the reference run %.1f s\n", stops_s,
               since(t_test) - stops_s);
}

}  // namespace
