// Tokenizer throughput on one core (thread CPU time): encode MB/s on a first pass (words new to
// the cache) and on repeated passes, and decode MB/s, over a deterministic mixed corpus (words with
// many distinct spellings, Chinese, code, digits, emoji, whitespace runs) or a file. Not a test:
// it prints numbers and checks only that decode(encode(text)) round-trips. Build: see the end.
//
//   bench_tokenizer TOKENIZER_JSON_OR_DIR [--mb N] [--text FILE] [--seconds S] [--write-corpus
//   FILE]
//
// --write-corpus saves the text used, so that HF `tokenizers` can be timed on the same bytes:
//   RAYON_NUM_THREADS=1 python3 -c "import time,tokenizers as t; k=t.Tokenizer.from_file(TOK);
//     s=open(FILE,encoding='utf-8').read(); d=[s[i:i+4096] for i in range(0,len(s),4096)];
//     c=time.process_time(); [k.encode(x,add_special_tokens=False) for x in d];
//     print(len(s.encode())/1e6/(time.process_time()-c),'MB/s')"
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "runtime/tokenizer/tokenizer.h"

namespace {

// CPU time of this thread: on a shared machine, wall time would count other processes' turns.
struct CpuClock {
  double now() const {
    timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return double(ts.tv_sec) + 1e-9 * double(ts.tv_nsec);
  }
};
const CpuClock Clock;

double seconds_since(double t0) { return Clock.now() - t0; }

// About `bytes` of mixed text, split into documents of a few KB (as a batch job would feed them).
std::vector<std::string> make_corpus(size_t bytes) {
  std::mt19937_64 rng(42);
  auto pick = [&](size_t n) { return size_t(rng() % n); };
  const char* syllables[] = {"ka",  "lo",  "mi",  "ten", "ser", "qu",  "ux", "bra", "vin", "dor",
                             "the", "ing", "ion", "al",  "ex",  "pre", "st", "ro",  "na",  "ble"};
  const char* chinese[] = {"模型", "专家", "注意力", "分词器", "世界", "你好", "数据", "训练", "推理",
                           "的",   "是",   "在",     "一个",   "我们", "，",   "。",   "参数"};
  const char* code[] = {
      "    return x + y;\n", "for (int i = 0; i < n; ++i) {\n",    "}\n",
      "def f(self, x):\n",   "    h = layer(h) + h  # residual\n", "{\"role\": \"user\", \"content\": \"hi\"}\n",
      "#include <vector>\n"};
  const char* emoji[] = {"😀", "🚀", "👍🏽", "🇨🇳", "❤️", "✨"};
  std::vector<std::string> docs;
  size_t total = 0;
  while (total < bytes) {
    std::string d;
    while (d.size() < 4096) {
      size_t kind = pick(100);
      if (kind < 55) {  // words with many distinct spellings
        std::string w;
        for (size_t k = 0, n = 1 + pick(4); k < n; ++k) w += syllables[pick(20)];
        if (pick(10) == 0) w[0] = char(std::toupper(w[0]));
        d += w;
        d += pick(12) == 0 ? ", " : pick(15) == 0 ? ". " : " ";
      } else if (kind < 75) {
        d += chinese[pick(17)];
      } else if (kind < 85) {
        d += code[pick(7)];
      } else if (kind < 92) {
        d += std::to_string(rng() % 10000000) + (pick(2) ? "." + std::to_string(pick(1000)) : "") + " ";
      } else if (kind < 96) {
        d += emoji[pick(6)];
      } else {
        d += pick(2) ? "\n\n" : "    \t ";
      }
    }
    total += d.size();
    docs.push_back(std::move(d));
  }
  return docs;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr,
                 "usage: %s TOKENIZER_JSON_OR_DIR [--mb N] [--text FILE] [--seconds S] "
                 "[--write-corpus FILE]\n",
                 argv[0]);
    return 2;
  }
  std::string tok_path = argv[1], text_file, corpus_out;
  double mb = 8, min_seconds = 2;
  for (int i = 2; i + 1 < argc; i += 2) {
    std::string a = argv[i];
    if (a == "--mb")
      mb = std::atof(argv[i + 1]);
    else if (a == "--text")
      text_file = argv[i + 1];
    else if (a == "--seconds")
      min_seconds = std::atof(argv[i + 1]);
    else if (a == "--write-corpus")
      corpus_out = argv[i + 1];
    else {
      std::fprintf(stderr, "unknown option %s\n", a.c_str());
      return 2;
    }
  }

  auto t0 = Clock.now();
  glm5::runtime::Tokenizer tok = glm5::runtime::Tokenizer::load(tok_path);
  double load_s = seconds_since(t0);

  std::vector<std::string> docs;
  if (!text_file.empty()) {
    std::ifstream in(text_file, std::ios::binary);
    if (!in) {
      std::fprintf(stderr, "cannot open %s\n", text_file.c_str());
      return 1;
    }
    std::stringstream ss;
    ss << in.rdbuf();
    std::string all = ss.str();
    for (size_t off = 0; off < all.size(); off += 4096) docs.push_back(all.substr(off, 4096));
  } else {
    docs = make_corpus(size_t(mb * 1e6));
  }
  size_t bytes = 0;
  for (const auto& d : docs) bytes += d.size();
  if (!corpus_out.empty()) {
    std::ofstream out(corpus_out, std::ios::binary);
    for (const auto& d : docs) out << d;
  }

  // First pass: every distinct word is new to the cache.
  std::vector<std::vector<int32_t>> ids(docs.size());
  t0 = Clock.now();
  size_t tokens = 0;
  for (size_t i = 0; i < docs.size(); ++i) {
    ids[i] = tok.encode(docs[i]);
    tokens += ids[i].size();
  }
  double cold_s = seconds_since(t0);

  // Repeated passes: the steady state of a long job.
  size_t warm_bytes = 0;
  t0 = Clock.now();
  do {
    for (const auto& d : docs) {
      auto v = tok.encode(d);
      warm_bytes += v.empty() ? 0 : d.size();
    }
  } while (seconds_since(t0) < min_seconds);
  double warm_s = seconds_since(t0);

  size_t decoded_bytes = 0;
  bool round_trip = true;
  t0 = Clock.now();
  for (size_t i = 0; i < docs.size(); ++i) {
    std::string s = tok.decode(ids[i]);
    decoded_bytes += s.size();
    round_trip = round_trip && s == docs[i];
  }
  double dec_s = seconds_since(t0);

  std::printf("tokenizer      %s (vocab %d), load %.2f s\n", tok.path().c_str(), tok.vocab_size(), load_s);
  std::printf("text           %.2f MB in %zu documents, %zu tokens (%.2f bytes/token)\n", bytes / 1e6, docs.size(),
              tokens, double(bytes) / double(tokens ? tokens : 1));
  std::printf("encode cold    %.2f MB/s  (%.2f Mtokens/s)\n", bytes / 1e6 / cold_s, tokens / 1e6 / cold_s);
  std::printf("encode warm    %.2f MB/s\n", warm_bytes / 1e6 / warm_s);
  std::printf("decode         %.2f MB/s\n", decoded_bytes / 1e6 / dec_s);
  std::printf("round trip     %s\n", round_trip ? "ok" : "MISMATCH");
  return round_trip ? 0 : 1;
}

// CMake (e.g. in scripts/CMakeLists.txt or the top level):
//   add_executable(bench_tokenizer scripts/bench_tokenizer.cpp)
//   target_link_libraries(bench_tokenizer PRIVATE glm5_runtime)
// Run: build/bench_tokenizer tests/data/tokenizer/deepseek_v3 --mb 8
