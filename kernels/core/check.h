// Error handling for the whole project: one exception type and the CHECK family.
// CHECK(cond, parts...) throws glm5::Error("file:line: parts...") when cond is false; the parts
// are streamed, so messages can name the file, field or tensor and the expected/found values.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace glm5 {

struct Error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

namespace detail {
template <typename... Parts>
[[noreturn]] void fail(const char* file, int line, const Parts&... parts) {
  std::ostringstream os;
  (os << ... << parts);
  std::string where = file;
  if (auto p = where.find_last_of('/'); p != std::string::npos) where = where.substr(p + 1);
  throw Error(os.str() + " [" + where + ":" + std::to_string(line) + "]");
}
}  // namespace detail

// Throws a user-facing error: the message comes first, the source location last.
#define GLM5_FAIL(...) ::glm5::detail::fail(__FILE__, __LINE__, __VA_ARGS__)
#define CHECK(cond, ...)                 \
  do {                                   \
    if (!(cond)) GLM5_FAIL(__VA_ARGS__); \
  } while (0)

}  // namespace glm5
