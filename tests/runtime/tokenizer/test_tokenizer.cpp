// Tokenizer tests: ids identical to Hugging Face `tokenizers` on ~3000 generated strings for the
// DeepSeek-V3 tokenizer.json and on variants of the tiny tokenizer that exercise every supported
// component (reference data from scripts/make_tokenizer_reference.py), byte-exact round trips
// including invalid UTF-8, and the error messages for missing, corrupt or unsupported files.
#include <gtest/gtest.h>

#include <unistd.h>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "kernels/core/check.h"
#include "runtime/tokenizer/tokenizer.h"

namespace glm5::runtime {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

const std::string kData = GLM5_TEST_DATA;
const std::string kDeepSeek = kData + "/tokenizer/deepseek_v3/tokenizer.json";
const std::string kTiny = kData + "/tiny-tokenizer/tokenizer.json";

std::vector<json> read_jsonl(const std::string& path) {
  std::ifstream in(path);
  EXPECT_TRUE(in.good()) << "cannot open " << path;
  std::vector<json> out;
  std::string line;
  while (std::getline(in, line))
    if (!line.empty()) out.push_back(json::parse(line));
  return out;
}

// Printable form of a test string for failure messages.
std::string show(const std::string& s) {
  std::string out = json(s).dump();
  return out.size() > 300 ? out.substr(0, 300) + "...\"" : out;
}

std::string show(const std::vector<int32_t>& ids) {
  std::string out = "[";
  for (size_t i = 0; i < ids.size() && i < 60; ++i) {
    if (i) out += ',';
    out += std::to_string(ids[i]);
  }
  return out + (ids.size() > 60 ? ",...]" : "]");
}

const Tokenizer& deepseek() {
  static const Tokenizer tok = Tokenizer::load(kDeepSeek);
  return tok;
}

// Checks every reference line against `tok`; reports at most a few failing lines in full.
void check_reference(const Tokenizer& tok, const std::vector<json>& lines, const std::string& what) {
  int failures = 0;
  for (const json& r : lines) {
    std::string text = r["text"];
    std::vector<int32_t> want = r["ids"];
    std::vector<int32_t> want_plain = r.contains("ids_plain") ? r["ids_plain"].get<std::vector<int32_t>>() : want;
    std::vector<int32_t> got = tok.encode(text);
    std::vector<int32_t> got_plain = tok.encode(text, /*parse_special=*/false);
    // HF's decode output; it differs from the text only where a normalizer, a Removed split or
    // a prefix space changed it.
    std::string want_decoded = r.value("decoded", text);
    std::string want_skip = r.value("decoded_skip", want_decoded);
    std::string round = tok.decode(got);
    bool ok = got == want && got_plain == want_plain && round == want_decoded &&
              tok.decode(want, /*skip_special=*/true) == want_skip;
    if (!ok && ++failures <= 5) {
      ADD_FAILURE() << what << " text " << show(text) << "\n  want " << show(want) << "\n  got  " << show(got)
                    << "\n  plain want " << show(want_plain) << " got " << show(got_plain) << "\n  decode "
                    << show(round);
    }
  }
  EXPECT_EQ(failures, 0) << what << ": " << failures << " of " << lines.size() << " lines differ";
}

TEST(Tokenizer, DeepSeekMatchesHuggingFaceReference) {
  std::vector<json> lines = read_jsonl(kData + "/tokenizer/deepseek_v3_reference.jsonl");
  ASSERT_GT(lines.size(), 2000u);
  check_reference(deepseek(), lines, "deepseek_v3");
}

TEST(Tokenizer, VariantsMatchHuggingFaceReference) {
  std::map<std::string, std::vector<json>> by_variant;
  for (json& r : read_jsonl(kData + "/tokenizer/variants_reference.jsonl"))
    by_variant[r["variant"].get<std::string>()].push_back(std::move(r));
  ASSERT_GE(by_variant.size(), 10u);
  for (const auto& [name, lines] : by_variant) {
    Tokenizer tok = Tokenizer::load(kData + "/tokenizer/variants/" + name + ".json");
    check_reference(tok, lines, name);
  }
}

// The four strings recorded in the toolchain notes (HF tokenizers and a JS port agree on them).
TEST(Tokenizer, DeepSeekLiteralCases) {
  const Tokenizer& tok = deepseek();
  EXPECT_EQ(
      tok.encode("Hello, 世界! 12345 tokens 😀🚀 naïve café"),
      (std::vector<int32_t>{19923, 14, 223, 3427, 3, 223, 6895, 1883, 35977, 53769, 225, 74287, 225, 112752, 57664}));
  EXPECT_EQ(tok.encode("DeepSeek-V3 是一个混合专家模型，参数量为671B。"),
            (std::vector<int32_t>{53091, 4374, 1465, 13582, 21, 223, 6715, 14769, 10756, 8842, 303, 2294, 9853, 545,
                                  26612, 36, 320}));
  EXPECT_EQ(tok.encode("  leading spaces\n\nnewlines\ttabs 3.14159 "),
            (std::vector<int32_t>{223, 6646, 13564, 271, 2839, 12678, 17299, 10284, 223, 21, 16, 9926, 3318, 223}));
  EXPECT_EQ(tok.encode("<｜begin▁of▁sentence｜>hi<｜end▁of▁sentence｜>"), (std::vector<int32_t>{0, 6366, 1}));
  // Without special-token parsing the markers are spelled out as text.
  EXPECT_GT(tok.encode("<｜begin▁of▁sentence｜>hi", false).size(), 3u);
  EXPECT_EQ(tok.decode({0, 6366, 1}), "<｜begin▁of▁sentence｜>hi<｜end▁of▁sentence｜>");
  EXPECT_EQ(tok.decode({0, 6366, 1}, /*skip_special=*/true), "hi");
  EXPECT_TRUE(tok.encode("").empty());
}

TEST(Tokenizer, VocabularyQueries) {
  const Tokenizer& tok = deepseek();
  EXPECT_EQ(tok.vocab_size(), 128815);
  EXPECT_EQ(tok.token_id("<｜begin▁of▁sentence｜>"), 0);
  EXPECT_EQ(tok.token_id("<｜end▁of▁sentence｜>"), 1);
  EXPECT_EQ(tok.token_id("<｜User｜>"), 128803);
  EXPECT_EQ(tok.token_id("Hello"), 19923);
  EXPECT_EQ(tok.token_id("no such token at all"), -1);
  EXPECT_EQ(tok.id_to_token(19923), "Hello");
  EXPECT_EQ(tok.id_to_token(0), "<｜begin▁of▁sentence｜>");
  EXPECT_EQ(tok.id_to_token(-1), "");
  EXPECT_EQ(tok.id_to_token(999999), "");
  EXPECT_TRUE(tok.is_special(0));
  EXPECT_FALSE(tok.is_special(128803));  // <｜User｜> is an added token but not flagged special
  EXPECT_FALSE(tok.is_special(19923));
  EXPECT_EQ(tok.path(), kDeepSeek);
}

TEST(Tokenizer, DecodeSkipsIdsWithoutToken) {
  const Tokenizer& tok = deepseek();
  // Ids past the tokenizer (the model pads its embedding to 129280 rows) and negative ids.
  EXPECT_EQ(tok.decode({19923, 129000, -3, 14}), "Hello,");
}

TEST(Tokenizer, InvalidUtf8RoundTripsByteForByte) {
  const Tokenizer& tok = deepseek();
  Tokenizer tiny = Tokenizer::load(kTiny);
  std::vector<std::string> cases = {"\xff",
                                    "\x80",
                                    "abc\x80"
                                    "def",
                                    "\xe4\xb8",
                                    "\xe4\xb8 end",
                                    "\xed\xa0\x80",
                                    "\xc0\xaf",
                                    "\xf5\x80\x80\x80",
                                    "\xf4\x90\x80\x80",
                                    "中\xff文",
                                    "<｜User｜>\xfe<｜User｜>",
                                    "\xff<think>\xfe",
                                    "  \xc3\n\n\xa9 12\xff"
                                    "345",
                                    std::string("nul\0byte", 8)};
  // Deterministic pseudo-random byte strings, half of them mostly ASCII.
  uint64_t state = 12345;
  for (int n = 0; n < 300; ++n) {
    std::string s;
    int len = int(state % 97);
    for (int i = 0; i < len; ++i) {
      state = state * 6364136223846793005ull + 1442695040888963407ull;
      unsigned char b = static_cast<unsigned char>(state >> 56);
      s += char(n % 2 ? b : (b & 0x7f) | (b > 0xf0 ? 0x80 : 0));
    }
    cases.push_back(s);
  }
  for (const std::string& s : cases) {
    EXPECT_EQ(tok.decode(tok.encode(s)), s) << show(s);
    EXPECT_EQ(tok.decode(tok.encode(s, false)), s) << show(s);
    EXPECT_EQ(tiny.decode(tiny.encode(s)), s) << show(s);
  }
  // Each invalid byte is its own byte-level symbol: 0xFF is 'ÿ', 0x80 is 'Ģ' in GPT-2's map.
  EXPECT_EQ(tok.encode("\xff"), std::vector<int32_t>{tok.token_id("ÿ")});
  EXPECT_EQ(tok.encode("\x80"), std::vector<int32_t>{tok.token_id("Ģ")});
  // Valid text around an invalid byte tokenizes as it would alone.
  std::vector<int32_t> want = tok.encode("Hello");
  want.push_back(tok.token_id("ÿ"));
  for (int32_t id : tok.encode(" world")) want.push_back(id);
  EXPECT_EQ(tok.encode("Hello\xff world"), want);
}

TEST(Tokenizer, TinyTokenizerLayout) {
  Tokenizer tok = Tokenizer::load(kData + "/tiny-tokenizer");  // a directory works too
  EXPECT_EQ(tok.vocab_size(), 512);
  const std::vector<std::pair<std::string, int32_t>> specials = {
      {"[gMASK]", 503},  {"<sop>", 504},         {"<|system|>", 505}, {"<|assistant|>", 506},  {"<think>", 507},
      {"</think>", 508}, {"<|endoftext|>", 509}, {"<|user|>", 510},   {"<|observation|>", 511}};
  for (const auto& [text, id] : specials) {
    EXPECT_EQ(tok.token_id(text), id) << text;
    EXPECT_TRUE(tok.is_special(id)) << text;
    EXPECT_EQ(tok.encode(text), std::vector<int32_t>{id}) << text;
  }
  std::vector<int32_t> ids = tok.encode("[gMASK]<sop><|user|>hello<|assistant|><think>");
  ASSERT_GE(ids.size(), 5u);
  EXPECT_EQ(std::vector<int32_t>(ids.begin(), ids.begin() + 3), (std::vector<int32_t>{503, 504, 510}));
  EXPECT_EQ(std::vector<int32_t>(ids.end() - 2, ids.end()), (std::vector<int32_t>{506, 507}));
  for (int32_t id : ids) EXPECT_LT(id, 512);
  EXPECT_EQ(tok.decode(ids, /*skip_special=*/true), "hello");
}

TEST(Tokenizer, ConcurrentEncodeGivesSameIds) {
  const Tokenizer& tok = deepseek();
  std::vector<json> lines = read_jsonl(kData + "/tokenizer/deepseek_v3_reference.jsonl");
  lines.resize(400);
  std::vector<int> bad(4, 0);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([&, t] {
      for (size_t i = t; i < lines.size(); i += 2)  // overlapping halves: shared cache entries
        if (tok.encode(lines[i]["text"].get<std::string>()) != lines[i]["ids"].get<std::vector<int32_t>>()) ++bad[t];
    });
  for (auto& th : threads) th.join();
  for (int t = 0; t < 4; ++t) EXPECT_EQ(bad[t], 0) << "thread " << t;
}

// ---- errors -----------------------------------------------------------------------------------

class TokenizerErrors : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::path(::testing::TempDir()) / ("glm5_tok_" + std::to_string(::getpid()) + "_" +
                                             ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string write(const std::string& name, const std::string& content) {
    std::string p = (dir_ / name).string();
    std::ofstream(p, std::ios::binary) << content;
    return p;
  }
  static json tiny() {
    std::ifstream in(kTiny);
    return json::parse(in);
  }
  // The message of the glm5::Error that loading `path` throws ("" if it does not throw).
  static std::string load_error(const std::string& path) {
    try {
      Tokenizer::load(path);
    } catch (const glm5::Error& e) {
      return e.what();
    }
    return "";
  }
  fs::path dir_;
};

#define EXPECT_CONTAINS(haystack, needle) \
  EXPECT_NE(std::string(haystack).find(needle), std::string::npos) << "message: " << (haystack)

TEST_F(TokenizerErrors, MissingFileNamesIt) {
  std::string p = (dir_ / "nope.json").string();
  std::string msg = load_error(p);
  EXPECT_CONTAINS(msg, p);
  EXPECT_CONTAINS(msg, "does not exist");
}

TEST_F(TokenizerErrors, DirectoryWithoutTokenizerJsonNamesTheFile) {
  std::string msg = load_error(dir_.string());
  EXPECT_CONTAINS(msg, (dir_ / "tokenizer.json").string());
}

TEST_F(TokenizerErrors, CorruptJson) {
  std::string p = write("tokenizer.json", "{\"model\": {\"type\": \"BPE\", \"vocab\": {");
  std::string msg = load_error(p);
  EXPECT_CONTAINS(msg, p);
  EXPECT_CONTAINS(msg, "not valid JSON");
  std::ifstream in(kTiny);
  std::string full((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::string half = write("half.json", full.substr(0, full.size() / 2));
  EXPECT_CONTAINS(load_error(half), "not valid JSON");
  EXPECT_CONTAINS(load_error(write("empty.json", "")), "not valid JSON");
  EXPECT_CONTAINS(load_error(write("array.json", "[1, 2]")), "expected an object");
}

TEST_F(TokenizerErrors, UnsupportedComponentsAreNamed) {
  json j = tiny();
  j["model"]["type"] = "WordPiece";
  std::string msg = load_error(write("wp.json", j.dump()));
  EXPECT_CONTAINS(msg, "model.type");
  EXPECT_CONTAINS(msg, "WordPiece");

  j = tiny();
  j["normalizer"] = {{"type", "NFC"}};
  msg = load_error(write("nfc.json", j.dump()));
  EXPECT_CONTAINS(msg, "normalizer");
  EXPECT_CONTAINS(msg, "NFC");

  j = tiny();
  j["pre_tokenizer"] = {{"type", "Metaspace"}, {"replacement", "_"}};
  EXPECT_CONTAINS(load_error(write("meta.json", j.dump())), "Metaspace");

  j = tiny();
  j["decoder"] = {{"type", "WordPiece"}};
  EXPECT_CONTAINS(load_error(write("dec.json", j.dump())), "decoder type 'WordPiece'");

  j = tiny();
  j["pre_tokenizer"]["pretokenizers"][0]["behavior"] = "Sideways";
  EXPECT_CONTAINS(load_error(write("beh.json", j.dump())), "Sideways");
}

TEST_F(TokenizerErrors, BadContentIsNamed) {
  json j = tiny();
  j["model"]["merges"][3] = json::array({"Ġ", "no-such-token"});
  std::string msg = load_error(write("merge.json", j.dump()));
  EXPECT_CONTAINS(msg, "model.merges[3]");
  EXPECT_CONTAINS(msg, "no-such-token");

  j = tiny();
  j["model"]["merges"][0] = "a b c";
  EXPECT_CONTAINS(load_error(write("merge3.json", j.dump())), "model.merges[0]");

  j = tiny();
  j["model"]["vocab"]["x"] = "seven";
  EXPECT_CONTAINS(load_error(write("vocab.json", j.dump())), "model.vocab[\"x\"]");

  j = tiny();
  j["model"].erase("merges");
  EXPECT_CONTAINS(load_error(write("nomerges.json", j.dump())), "model.merges");

  j = tiny();
  j["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = "(unclosed";
  msg = load_error(write("regex.json", j.dump()));
  EXPECT_CONTAINS(msg, "(unclosed");
  EXPECT_CONTAINS(msg, "does not compile");

  // An id far past the others (found by fuzz_tokenizer_json: the id tables are sized by the
  // largest id, and 90,522,183 asked for gigabytes).
  j = tiny();
  j["model"]["vocab"]["far"] = 90522183;
  msg = load_error(write("far.json", j.dump()));
  EXPECT_CONTAINS(msg, "model.vocab[\"far\"]");
  EXPECT_CONTAINS(msg, "id 90522183 is above the largest supported, 4194303");

  j = tiny();
  j["added_tokens"][0]["id"] = -4;
  EXPECT_CONTAINS(load_error(write("added.json", j.dump())), "added_tokens[0].id");
}

}  // namespace
}  // namespace glm5::runtime
