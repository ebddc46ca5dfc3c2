// Helpers of the libFuzzer targets (tests/fuzz/fuzz_*.cpp): where tests/data is, the rule every
// target checks, and scratch files for parsers that read paths.
//
// The rule: a parser given hostile bytes either accepts them or refuses them with glm5::Error, the
// project's one user-facing error (it names the file, field or tensor). Any other exception
// escaping a parser (a bare nlohmann or std:: error, whose message names nothing of the user's),
// a crash, a sanitizer report, a hang or unbounded memory is a finding.
#pragma once

#include <stdlib.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <fstream>
#include <string>
#include <string_view>
#include <typeinfo>

#include "kernels/core/check.h"

namespace glm5::fuzz {

inline const std::string kData = GLM5_TEST_DATA;

// Runs f: glm5::Error is a clean refusal; any other exception aborts, so libFuzzer keeps the input.
template <typename F>
void expect_clean(const char* what, F&& f) {
  try {
    f();
  } catch (const Error&) {
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fuzz: %s let a %s escape instead of glm5::Error: %s\n", what, typeid(e).name(), e.what());
    std::abort();
  }
}

// Fails the target when a property the parser promises does not hold.
inline void require(bool ok, const char* what) {
  if (ok) return;
  std::fprintf(stderr, "fuzz: property violated: %s\n", what);
  std::abort();
}

// A scratch folder of this process (under $TMPDIR), removed at exit. The path is never destroyed,
// so that the exit handler (registered after it, so run before static destructors would be) still
// has it.
inline const std::filesystem::path& scratch_dir() {
  static const std::filesystem::path* dir = [] {
    std::string tmpl = (std::filesystem::temp_directory_path() / "glm5-fuzz.XXXXXX").string();
    if (!mkdtemp(tmpl.data())) std::abort();
    return new std::filesystem::path(tmpl);
  }();
  static const bool cleanup = [] {
    std::atexit([] {
      std::error_code ec;
      std::filesystem::remove_all(*dir, ec);
    });
    return true;
  }();
  (void)cleanup;
  return *dir;
}

// Writes bytes to a file in the scratch folder (replacing it) and returns its path.
inline std::string write_scratch(const std::string& name, std::string_view bytes) {
  const std::filesystem::path p = scratch_dir() / name;
  std::ofstream(p, std::ios::binary | std::ios::trunc).write(bytes.data(), std::streamsize(bytes.size()));
  return p.string();
}

}  // namespace glm5::fuzz
