// Helpers shared by the test files: the binary and data paths, expect_error for glm5::Error messages, per-process
// scratch folders, reading a file whole, and running shell commands for their exit code and output. Header-only
// (inline); include as "tests/test_support.h". No assertions of its own beyond expect_error's; each test file keeps its
// own scratch prefix (ctest runs tests in parallel).
#pragma once

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <exception>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "kernels/core/check.h"

namespace glm5::testing {

// Where the tests find the glm5 executable, the source tree and tests/data (set by CMake for
// every test target).
inline const std::string kBin = GLM5_BINARY;
inline const std::string kSrc = GLM5_SOURCE_DIR;
inline const std::string kData = GLM5_TEST_DATA;

// A sanitized build (AddressSanitizer, ThreadSanitizer) runs the model several times slower: tests
// that must finish work inside a fixed window (a stream inside a drain before mpirun's kill) ask for
// less work there, so that they test the same rule rather than the build's speed.
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
inline constexpr bool kSanitized = true;
#elif defined(__has_feature)
inline constexpr bool kSanitized = __has_feature(address_sanitizer) || __has_feature(thread_sanitizer);
#else
inline constexpr bool kSanitized = false;
#endif

// Runs f and expects a glm5::Error whose message contains every part.
inline void expect_error(const std::function<void()>& f, const std::vector<std::string>& parts) {
  try {
    f();
  } catch (const Error& e) {
    const std::string m = e.what();
    for (const std::string& p : parts) EXPECT_NE(m.find(p), std::string::npos) << "expected '" << p << "' in: " << m;
    return;
  } catch (const std::exception& e) {
    ADD_FAILURE() << "expected glm5::Error, got another exception: " << e.what();
    return;
  }
  ADD_FAILURE() << "expected glm5::Error, nothing was thrown";
}

inline bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

// The whole file as bytes ("" when it cannot be opened).
inline std::string slurp(const std::filesystem::path& p) {
  std::ifstream f(p, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// This process's scratch folder <temp>/<prefix>_<pid>; each test file passes its own prefix.
// scratch(name) is the path <folder>/<name>, with its parent folders created. The folder is
// removed at program end when every test passed (kept to look at otherwise).
class ScratchDir {
 public:
  explicit ScratchDir(std::string prefix) : prefix_(std::move(prefix)) {
    ::testing::AddGlobalTestEnvironment(new RemoveWhenPassed(prefix_));
  }
  std::filesystem::path operator()(const std::string& name) const {
    std::filesystem::path p = folder(prefix_) / name;
    std::filesystem::create_directories(p.parent_path());
    return p;
  }

 private:
  static std::filesystem::path folder(const std::string& prefix) {
    return std::filesystem::temp_directory_path() / (prefix + "_" + std::to_string(getpid()));
  }
  class RemoveWhenPassed : public ::testing::Environment {
   public:
    explicit RemoveWhenPassed(std::string prefix) : prefix_(std::move(prefix)) {}
    void TearDown() override {
      if (::testing::UnitTest::GetInstance()->Passed()) std::filesystem::remove_all(folder(prefix_));
    }

   private:
    std::string prefix_;
  };
  std::string prefix_;
};

// How a command run by std::system ended: its exit code (128+n for signal n, 255 when neither).
struct ExitStatus {
  int code = -1;
  bool signaled = false;
};

inline ExitStatus exit_status(int system_rc) {
  ExitStatus s;
  s.signaled = WIFSIGNALED(system_rc);
  s.code = s.signaled ? 128 + WTERMSIG(system_rc) : WIFEXITED(system_rc) ? WEXITSTATUS(system_rc) : 255;
  return s;
}

// OpenMP threads per test process and per mpirun rank: 1, or GLM5_TEST_THREADS (ctest runs the
// invariance tests a second time with 2, so the threaded kernel paths are checked too).
inline std::string test_threads() {
  const char* t = std::getenv("GLM5_TEST_THREADS");
  return t && *t ? t : "1";
}

// The precision the invariance suites run in: exact, or GLM5_TEST_PRECISION (ctest runs them again
// in fast on each fast gemm path).
inline std::string test_precision() {
  const char* p = std::getenv("GLM5_TEST_PRECISION");
  return p && *p ? p : "exact";
}

// Runs a shell command line with stdout to `out` and stderr to `err` (empty: to `out` too).
// With `exec` the shell execs a plain command, so a signal that ends it shows as `signaled`.
inline ExitStatus run_shell(const std::string& cmd, const std::filesystem::path& out,
                            const std::filesystem::path& err = {}, bool exec = false) {
  // One thread per process unless asked: the machine is small and shared (threads would only spin).
  setenv("OMP_NUM_THREADS", test_threads().c_str(), 1);
  const std::string to_err = err.empty() ? std::string(" 2>&1") : " 2> '" + err.string() + "'";
  const std::string line = (exec ? "exec " : "") + cmd + " > '" + out.string() + "'" + to_err;
  return exit_status(std::system(line.c_str()));
}

// run_shell's exit code alone.
inline int sh(const std::string& cmd, const std::filesystem::path& out, const std::filesystem::path& err = {}) {
  return run_shell(cmd, out, err).code;
}

// A finished command: how it ended and what it wrote.
struct Proc {
  int code = -1;  // exit code, or 128 + signal
  bool signaled = false;
  std::string out, err;
};

// Runs a shell command line with stdout and stderr captured apart (through the files `out` and
// `err`); see run_shell for `exec`.
inline Proc run_captured(const std::string& cmd, const std::filesystem::path& out, const std::filesystem::path& err,
                         bool exec = true) {
  const ExitStatus s = run_shell(cmd, out, err, exec);
  Proc p;
  p.code = s.code;
  p.signaled = s.signaled;
  p.out = slurp(out);
  p.err = slurp(err);
  return p;
}

#ifdef GLM5_MPIRUN
// The mpirun prefix for np local ranks (test_threads() threads each), ending in a space.
inline std::string mpirun(int np) {
  return std::string(GLM5_MPIRUN) + " --allow-run-as-root --oversubscribe --mca btl self,vader,tcp " +
         "-x OMP_NUM_THREADS=" + test_threads() + " -np " + std::to_string(np) + " ";
}
#endif

}  // namespace glm5::testing
