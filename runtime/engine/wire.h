// The engine's messages between ranks: byte vectors written field by field (Writer) and read
// back with bounds checks (Reader). Stage 0 sends each Step down its column, the last stage sends
// the step's Backs up; between ticks finished Results go to world rank 0 and new Requests come
// back. Every rank runs the same binary, so fields travel in host layout. A message is sent as
// (int64 size, bytes) (Outbox::send_bytes) and received with recv_bytes.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "kernels/core/check.h"
#include "parallel/comm.h"
#include "runtime/request.h"
#include "runtime/scheduler.h"

namespace glm5::runtime::wire {

struct Writer {
  std::vector<char> b;
  template <typename T>
  void put(const T& v) {
    const char* p = reinterpret_cast<const char*>(&v);
    b.insert(b.end(), p, p + sizeof(T));
  }
  template <typename T>
  void put_vec(const std::vector<T>& v) {
    put<int64_t>(int64_t(v.size()));
    const char* p = reinterpret_cast<const char*>(v.data());
    b.insert(b.end(), p, p + v.size() * sizeof(T));
  }
  void put_str(const std::string& s) { put_vec(std::vector<char>(s.begin(), s.end())); }
};

// Sizes are compared, never pointers moved past the end (an empty message's data() is null, and a
// count read from a bad message may be anything).
struct Reader {
  const char* p;
  const char* end;
  explicit Reader(const std::vector<char>& v) : p(v.data()), end(v.data() + v.size()) {}
  size_t left() const { return size_t(end - p); }
  template <typename T>
  T get() {
    CHECK(left() >= sizeof(T), "internal: truncated engine message");
    T v;
    std::memcpy(&v, p, sizeof(T));
    p += sizeof(T);
    return v;
  }
  template <typename T>
  std::vector<T> get_vec() {
    int64_t n = get<int64_t>();
    CHECK(n >= 0 && uint64_t(n) <= left() / sizeof(T), "internal: truncated engine message");
    std::vector<T> v(static_cast<size_t>(n));
    if (n) std::memcpy(static_cast<void*>(v.data()), p, size_t(n) * sizeof(T));
    p += size_t(n) * sizeof(T);
    return v;
  }
  std::string get_str() {
    auto v = get_vec<char>();
    return std::string(v.begin(), v.end());
  }
};

// One (size, bytes) message from src.
std::vector<char> recv_bytes(parallel::Comm& c, int src, int tag);

void put_request(Writer& w, const Request& r);
Request get_request(Reader& rd);
void put_result(Writer& w, const Result& r);
Result get_result(Reader& rd);
void put_step(Writer& w, const Step& s);
Step get_step(Reader& rd);
void put_backs(Writer& w, const std::vector<Back>& backs);
std::vector<Back> get_backs(Reader& rd);

}  // namespace glm5::runtime::wire
