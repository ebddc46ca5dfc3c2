// Byte-level BPE tokenizer from a Hugging Face tokenizer.json, step by step as HF `tokenizers`:
// added tokens are cut out (raw, then normalized text), the rest is normalized, pre-tokenized
// (regex splits, byte-level mapping) and BPE-merged by rank. Regexes are PCRE2 (UTF+UCP, JIT) with
// Oniguruma's \s \w \h rewritten to mean what they mean in HF; chars newer than PCRE2's Unicode
// tables may still split differently. Not here: offsets, Unicode normalization.
#include "runtime/tokenizer/tokenizer.h"

#include <algorithm>
#include <array>
#include <cctype>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <nlohmann/json.hpp>
#include <queue>
#include <sstream>
#include <unordered_map>

#include "kernels/core/check.h"
#include "runtime/tokenizer/added_tokens.h"

namespace glm5::runtime {

using namespace tok;  // the parts (this folder's headers)

// ------------------------------------------------------------------------------------------------

// The largest token id model.vocab may hold: the id tables are dense (a string and two flags per id,
// up to the largest id), so one stray id would otherwise size them; 16x the largest vocabularies in
// use (GLM-5: 154,880 ids, Gemma: 262,144).
constexpr int64_t kMaxTokenId = (int64_t(1) << 22) - 1;

struct Tokenizer::Impl {
  std::string path;
  Bpe bpe;
  std::vector<NormOp> normalizer;
  std::vector<Stage> stages;
  bool byte_level_pre = false;      // a ByteLevel pre-tokenizer maps bytes to printable chars
  bool byte_level_decoder = false;  // else the decoder is absent: tokens are joined by spaces

  std::vector<AddedToken> added;
  StrMap<int32_t> added_by_content;     // content -> index in `added`
  std::vector<int32_t> added_index;     // id -> index in `added`, -1 if not added
  Trie raw_trie, normalized_trie;       // match content (raw) / normalized content
  std::unique_ptr<Regex> word_char_re;  // Rust regex \w, for single_word
  std::unique_ptr<Regex> space_re;      // Rust regex \s, for lstrip/rstrip

  std::vector<std::string> id_bytes;  // what decode() emits for each id
  std::vector<bool> id_present;
  int32_t size = 0;

  // -- encode ------------------------------------------------------------------------------------

  bool is_word(uint32_t cp) const {
    std::string s;
    append_utf8(s, cp);
    return word_char_re->matches_whole(s);
  }
  bool is_space(uint32_t cp) const {
    std::string s;
    append_utf8(s, cp);
    return space_re->matches_whole(s);
  }
  // Start of the run of whitespace that ends `s` (s.size() if none).
  size_t trailing_space_start(std::string_view s) const {
    size_t end = s.size();
    uint32_t cp;
    size_t start;
    while (last_cp(s.substr(0, end), cp, start) && is_space(cp)) end = start;
    return end;
  }
  // Length of the run of whitespace that starts `s`.
  size_t leading_space_len(std::string_view s) const {
    size_t pos = 0;
    uint32_t cp;
    while (first_cp(s.substr(pos), cp) && is_space(cp)) pos += utf8_valid_len(bytes(s), s.size(), pos);
    return pos;
  }

  // HF AddedVocabulary::find_matches: cut `text` into added tokens (id >= 0) and the pieces
  // between them (id -1), in order.
  template <typename F>
  void split_added(std::string_view text, const Trie& trie, bool parse_special, F&& f) const {
    if (text.empty()) return;
    if (trie.empty()) {
      f(text, -1);
      return;
    }
    size_t start_offset = 0, pos = 0, ms, me;
    int32_t idx;
    while (trie.find(text, pos, ms, me, idx)) {
      pos = me;
      const AddedToken& tok = added[idx];
      if (!parse_special && tok.special) continue;
      if (ms < start_offset) continue;  // inside whitespace an rstrip token already took
      if (tok.single_word) {
        uint32_t cp;
        size_t st;
        bool start_ok = ms == 0 || !(last_cp(text.substr(0, ms), cp, st) && is_word(cp));
        bool stop_ok = me == text.size() || !(first_cp(text.substr(me), cp) && is_word(cp));
        if (!start_ok || !stop_ok) continue;
      }
      size_t start = ms, stop = me;
      if (tok.lstrip) start = std::max(trailing_space_start(text.substr(0, ms)), start_offset);
      if (tok.rstrip) stop += leading_space_len(text.substr(me));
      if (start_offset < start) f(text.substr(start_offset, start - start_offset), -1);
      f(std::string_view(), tok.id);
      start_offset = stop;
      pos = std::max(pos, stop);
    }
    if (start_offset < text.size()) f(text.substr(start_offset), -1);
  }

  void encode(std::string_view text, bool parse_special, std::vector<int32_t>& out) const {
    split_added(text, raw_trie, parse_special, [&](std::string_view piece, int32_t id) {
      if (id >= 0)
        out.push_back(id);
      else
        encode_unadded(piece, parse_special, out);
    });
  }

  // A piece with no raw-matched added token: valid UTF-8 runs go through normalization; each
  // byte that is not valid UTF-8 becomes its own piece.
  void encode_unadded(std::string_view piece, bool parse_special, std::vector<int32_t>& out) const {
    size_t run = 0, i = 0;
    while (i < piece.size()) {
      size_t len = utf8_valid_len(bytes(piece), piece.size(), i);
      if (len) {
        i += len;
        continue;
      }
      encode_valid(piece.substr(run, i - run), parse_special, out);
      encode_raw_byte(static_cast<unsigned char>(piece[i]), out);
      run = ++i;
    }
    encode_valid(piece.substr(run), parse_special, out);
  }

  void encode_raw_byte(unsigned char b, std::vector<int32_t>& out) const {
    std::string_view one(reinterpret_cast<const char*>(&b), 1);
    if (!byte_level_pre)
      bpe.tokenize(one, out);
    else if (stages.back().kind == Stage::kByteLevel)
      bpe.tokenize_bytes(one, out);
    else
      bpe.tokenize(bpe.byte_char[b], out);
  }

  void encode_valid(std::string_view run, bool parse_special, std::vector<int32_t>& out) const {
    if (run.empty()) return;
    auto pieces = [&](std::string_view text) {
      split_added(text, normalized_trie, parse_special, [&](std::string_view p, int32_t id) {
        if (id >= 0)
          out.push_back(id);
        else
          pre_tokenize_and_merge(p, out);
      });
    };
    if (normalizer.empty()) {
      pieces(run);
    } else {
      std::string norm = apply_normalizer(normalizer, run);
      pieces(norm);
    }
  }

  void pre_tokenize_and_merge(std::string_view text, std::vector<int32_t>& out) const {
    // Pieces are spans of `cur`; a ByteLevel stage that is not last moves them to a new buffer.
    thread_local std::string owned, next_buf, prefixed;
    thread_local std::vector<Span> spans, next, sub;
    std::string_view cur = text;
    spans.assign(1, Span{0, uint32_t(text.size())});
    for (size_t si = 0; si < stages.size(); ++si) {
      const Stage& st = stages[si];
      next.clear();
      if (st.kind == Stage::kSplit) {
        for (const Span& sp : spans) split_piece(st, cur.substr(sp.off, sp.len), sp.off, next);
        spans.swap(next);
        continue;
      }
      // ByteLevel: optional leading space per piece, optional GPT-2 split, then every byte
      // becomes its printable char. As the last stage it hands raw bytes to the model instead.
      const bool last = si + 1 == stages.size();
      next_buf.clear();
      for (const Span& sp : spans) {
        std::string_view piece = cur.substr(sp.off, sp.len);
        if (st.add_prefix_space && (piece.empty() || piece[0] != ' ')) {
          prefixed.assign(1, ' ');
          prefixed.append(piece);
          piece = prefixed;
        }
        sub.clear();
        if (st.re)
          split_gpt2(st, piece, sub);
        else
          sub.push_back({0, uint32_t(piece.size())});
        for (const Span& s : sub) {
          if (last) {
            bpe.tokenize_bytes(piece.substr(s.off, s.len), out);
            continue;
          }
          uint32_t off = uint32_t(next_buf.size());
          for (size_t k = s.off; k < s.off + s.len; ++k)
            next_buf += bpe.byte_char[static_cast<unsigned char>(piece[k])];
          if (next_buf.size() > off) next.push_back({off, uint32_t(next_buf.size() - off)});
        }
      }
      if (last) return;
      owned.swap(next_buf);
      cur = owned;
      spans.swap(next);
    }
    for (const Span& sp : spans) bpe.tokenize(cur.substr(sp.off, sp.len), out);
  }

  // The GPT-2 regex split of ByteLevel(use_regex=true), Isolated.
  static void split_gpt2(const Stage& st, std::string_view piece, std::vector<Span>& out) {
    uint32_t prev = 0;
    st.re->for_each_match(piece, [&](size_t s, size_t e) {
      if (prev != s) out.push_back({prev, uint32_t(s) - prev});
      out.push_back({uint32_t(s), uint32_t(e - s)});
      prev = uint32_t(e);
    });
    if (prev != piece.size()) out.push_back({prev, uint32_t(piece.size()) - prev});
  }

  // -- load --------------------------------------------------------------------------------------

  void load(const std::string& file) {
    path = file;
    JsonCtx ctx{file};
    std::ifstream in(file, std::ios::binary);
    CHECK(in.good(), "tokenizer: cannot open '", file, "'");
    std::stringstream ss;
    ss << in.rdbuf();
    json j;
    try {
      j = json::parse(ss.str());
    } catch (const json::exception& e) {
      GLM5_FAIL("tokenizer '", file, "' is not valid JSON: ", e.what());
    }
    if (!j.is_object()) ctx.fail("top level", std::string("expected an object, found ") + j.type_name());
    try {
      load_model(ctx, ctx.member(j, "model", "tokenizer"));
      if (auto it = j.find("normalizer"); it != j.end()) parse_normalizer(ctx, *it, "normalizer", normalizer);
      if (auto it = j.find("pre_tokenizer"); it != j.end()) parse_pre_tokenizer(ctx, *it, "pre_tokenizer", stages);
      for (const Stage& st : stages) byte_level_pre = byte_level_pre || st.kind == Stage::kByteLevel;
      load_decoder(ctx, j.contains("decoder") ? j["decoder"] : json());
      if (auto it = j.find("added_tokens"); it != j.end()) load_added(ctx, *it);
    } catch (const json::exception& e) {
      GLM5_FAIL("tokenizer '", file, "': unexpected JSON content: ", e.what());
    }
    build_tables();
  }

  void load_model(const JsonCtx& ctx, const json& m) {
    std::string type = m.contains("type") ? ctx.str(m, "type", "model") : std::string("BPE");
    if (type != "BPE") ctx.fail("model.type", "'" + type + "' is not supported (only BPE)");
    if (m.contains("dropout") && !m["dropout"].is_null() && m["dropout"].get<double>() > 0)
      ctx.fail("model.dropout", "BPE dropout is random at encode time; not supported");
    for (const char* k : {"continuing_subword_prefix", "end_of_word_suffix"})
      if (m.contains(k) && !m[k].is_null() && !m[k].get<std::string>().empty())
        ctx.fail(std::string("model.") + k, "'" + m[k].get<std::string>() + "' is not supported");
    bpe.ignore_merges = ctx.flag(m, "ignore_merges", false, "model");
    bpe.byte_fallback = ctx.flag(m, "byte_fallback", false, "model");
    bpe.fuse_unk = ctx.flag(m, "fuse_unk", false, "model");

    const json& vocab = ctx.member(m, "vocab", "model");
    if (!vocab.is_object()) ctx.fail("model.vocab", "expected an object token -> id");
    int32_t max_id = -1;
    bpe.vocab.reserve(vocab.size());
    for (auto it = vocab.begin(); it != vocab.end(); ++it) {
      if (!it.value().is_number_integer() || it.value().get<int64_t>() < 0)
        ctx.fail("model.vocab[\"" + it.key() + "\"]", "expected a non-negative id, found " + it.value().dump());
      if (it.value().get<int64_t>() > kMaxTokenId)
        ctx.fail("model.vocab[\"" + it.key() + "\"]", "id " + it.value().dump() + " is above the largest supported, " +
                                                          std::to_string(kMaxTokenId) +
                                                          " (the tables are indexed by id)");
      int32_t id = it.value().get<int32_t>();
      bpe.vocab[it.key()] = id;
      max_id = std::max(max_id, id);
    }
    bpe.id_to_token.assign(size_t(max_id + 1), std::string());
    for (const auto& [tok, id] : bpe.vocab) bpe.id_to_token[id] = tok;
    size = max_id + 1;

    if (m.contains("unk_token") && !m["unk_token"].is_null()) {
      std::string unk = ctx.str(m, "unk_token", "model");
      bpe.unk_id = bpe.lookup(unk);
      if (bpe.unk_id < 0) ctx.fail("model.unk_token", "'" + unk + "' is not in model.vocab");
    }

    const json& merges = ctx.member(m, "merges", "model");
    if (!merges.is_array()) ctx.fail("model.merges", "expected a list");
    bpe.merges.reserve(merges.size());
    for (size_t r = 0; r < merges.size(); ++r) {
      const json& e = merges[r];
      std::string field = "model.merges[" + std::to_string(r) + "]";
      std::string a, b;
      if (e.is_string()) {
        std::string s = e.get<std::string>();
        size_t sp = s.find(' ');
        if (sp == std::string::npos || s.find(' ', sp + 1) != std::string::npos)
          ctx.fail(field, "expected \"left right\" with one space, found \"" + s + "\"");
        a = s.substr(0, sp);
        b = s.substr(sp + 1);
      } else if (e.is_array() && e.size() == 2 && e[0].is_string() && e[1].is_string()) {
        a = e[0].get<std::string>();
        b = e[1].get<std::string>();
      } else {
        ctx.fail(field, "expected \"left right\" or [left, right], found " + e.dump());
      }
      int32_t ia = bpe.lookup(a), ib = bpe.lookup(b), inew = bpe.lookup(a + b);
      if (ia < 0) ctx.fail(field, "left part '" + a + "' is not in model.vocab");
      if (ib < 0) ctx.fail(field, "right part '" + b + "' is not in model.vocab");
      if (inew < 0) ctx.fail(field, "merged token '" + a + b + "' is not in model.vocab");
      bpe.merges.set(ia, ib, int32_t(r), inew);
    }
  }

  void load_decoder(const JsonCtx& ctx, const json& d) {
    if (d.is_null()) return;
    std::string type = ctx.str(d, "type", "decoder");
    if (type == "ByteLevel") {
      byte_level_decoder = true;
    } else {
      ctx.fail("decoder", "decoder type '" + type + "' is not supported (supported: ByteLevel)");
    }
  }

  // Ids are assigned the way HF's AddedVocabulary::add_tokens does when it reads the file: a
  // content already added or in the BPE vocab keeps that id; a new one gets the BPE vocab's entry
  // count, or one past the largest added id once that is reached. For any consistent file this is
  // the "id" written there; where it is not, HF (and so the model's training) used these ids.
  void load_added(const JsonCtx& ctx, const json& list) {
    if (!list.is_array()) ctx.fail("added_tokens", "expected a list");
    const int64_t vocab_count = int64_t(bpe.vocab.size());
    int64_t max_added = -1;
    for (size_t i = 0; i < list.size(); ++i) {
      const json& t = list[i];
      std::string field = "added_tokens[" + std::to_string(i) + "]";
      const json& idj = ctx.member(t, "id", field);
      if (!idj.is_number_integer() || idj.get<int64_t>() < 0 || idj.get<int64_t>() > INT32_MAX)
        ctx.fail(field + ".id", "expected a non-negative id, found " + idj.dump());
      AddedToken tok{ctx.str(t, "content", field),          -1,
                     ctx.flag(t, "special", false, field),  ctx.flag(t, "lstrip", false, field),
                     ctx.flag(t, "rstrip", false, field),   ctx.flag(t, "single_word", false, field),
                     ctx.flag(t, "normalized", true, field)};
      if (tok.content.empty()) continue;  // HF ignores empty added tokens
      auto it = added_by_content.find(tok.content);
      if (it != added_by_content.end()) {
        tok.id = added[it->second].id;
      } else if (int32_t vid = bpe.lookup(tok.content); vid >= 0) {
        tok.id = vid;
      } else {
        int64_t id = max_added < 0                                    ? vocab_count
                     : (max_added >= vocab_count || vocab_count == 0) ? max_added + 1
                                                                      : vocab_count;
        if (id > INT32_MAX) ctx.fail(field, "too many added tokens");
        tok.id = int32_t(id);
      }
      max_added = std::max<int64_t>(max_added, tok.id);
      if (it != added_by_content.end()) {
        added[it->second] = tok;  // same content again: the later flags win, as in HF
      } else {
        added_by_content[tok.content] = int32_t(added.size());
        added.push_back(tok);
      }
      size = std::max(size, tok.id + 1);
    }
    bool need_word = false, need_space = false;
    for (size_t i = 0; i < added.size(); ++i) {
      const AddedToken& t = added[i];
      need_word = need_word || t.single_word;
      need_space = need_space || t.lstrip || t.rstrip;
      if (t.normalized) {
        std::string key = normalizer.empty() ? t.content : apply_normalizer(normalizer, t.content);
        normalized_trie.insert(key, int32_t(i));
      } else {
        raw_trie.insert(t.content, int32_t(i));
      }
    }
    std::string where = "tokenizer '" + ctx.file + "'";
    if (need_word)
      word_char_re = std::make_unique<Regex>(R"([\p{Alphabetic}\p{M}\p{Nd}\p{Pc}\p{Join_Control}])", where);
    if (need_space) space_re = std::make_unique<Regex>(R"(\p{White_Space})", where);
  }

  void build_tables() {
    auto byte_to_cp = make_byte_to_cp();
    std::unordered_map<uint32_t, unsigned char> cp_to_byte;
    for (int b = 0; b < 256; ++b) {
      bpe.byte_char[b].clear();
      append_utf8(bpe.byte_char[b], byte_to_cp[b]);
      cp_to_byte[byte_to_cp[b]] = static_cast<unsigned char>(b);
    }
    bpe.small_char_id.assign(0x800, -1);
    for (const auto& [tok, id] : bpe.vocab) {
      size_t len = utf8_valid_len(bytes(tok), tok.size(), 0);
      if (len == tok.size() && len > 0) {
        uint32_t cp = decode_cp(bytes(tok), len);
        if (cp < 0x800) bpe.small_char_id[cp] = id;
      }
    }
    for (int b = 0; b < 256; ++b) bpe.byte_id[b] = bpe.small_char_id[byte_to_cp[b]];
    added_index.assign(size_t(size), -1);
    for (size_t i = 0; i < added.size(); ++i) added_index[added[i].id] = int32_t(i);

    // Decoded bytes per id: ByteLevel maps a token back to bytes when every char of it is a
    // byte-level char, and otherwise emits the token's text as it is (as HF does).
    id_bytes.assign(size_t(size), std::string());
    id_present.assign(size_t(size), false);
    for (int32_t id = 0; id < size; ++id) {
      std::string tok;
      if (added_index[id] >= 0)
        tok = added[added_index[id]].content;
      else if (id < int32_t(bpe.id_to_token.size()) && !bpe.id_to_token[id].empty())
        tok = bpe.id_to_token[id];
      else
        continue;
      id_present[id] = true;
      if (!byte_level_decoder) {
        id_bytes[id] = tok;
        continue;
      }
      std::string out;
      bool all = true;
      for (size_t i = 0; i < tok.size() && all;) {
        size_t len = utf8_valid_len(bytes(tok), tok.size(), i);
        if (!len) {
          all = false;
          break;
        }
        auto it = cp_to_byte.find(decode_cp(bytes(tok) + i, len));
        if (it == cp_to_byte.end())
          all = false;
        else
          out += char(it->second);
        i += len;
      }
      id_bytes[id] = all ? out : tok;
    }
  }
};

// ------------------------------------------------------------------------------------------------

Tokenizer::Tokenizer(std::shared_ptr<const Impl> impl) : impl_(std::move(impl)) {}

Tokenizer Tokenizer::load(const std::string& path_or_model_dir) {
  namespace fs = std::filesystem;
  std::string file = path_or_model_dir;
  std::error_code ec;
  if (fs::is_directory(file, ec)) file = (fs::path(file) / "tokenizer.json").string();
  CHECK(fs::exists(file, ec), "tokenizer: '", file, "' does not exist");
  CHECK(fs::is_regular_file(file, ec), "tokenizer: '", file, "' is not a regular file");
  auto impl = std::make_shared<Impl>();
  impl->load(file);
  return Tokenizer(std::move(impl));
}

std::unique_ptr<Tokenizer> Tokenizer::load_if_present(const std::string& model_dir) {
  std::error_code ec;
  if (!std::filesystem::exists(std::filesystem::path(model_dir) / "tokenizer.json", ec)) return nullptr;
  return std::make_unique<Tokenizer>(load(model_dir));
}

std::vector<int32_t> Tokenizer::encode(std::string_view text, bool parse_special) const {
  CHECK(text.size() < (size_t(1) << 32), "tokenizer: text of ", text.size(),
        " bytes is too long to encode at once (limit 4 GiB)");
  std::vector<int32_t> out;
  out.reserve(text.size() / 3 + 4);
  impl_->encode(text, parse_special, out);
  return out;
}

std::string Tokenizer::decode(const std::vector<int32_t>& ids, bool skip_special) const {
  std::string out;
  bool first = true;
  for (int32_t id : ids)
    if (append_decoded(out, id, skip_special, first)) first = false;
  return out;
}

bool Tokenizer::append_decoded(std::string& out, int32_t id, bool skip_special, bool first) const {
  const Impl& m = *impl_;
  if (id < 0 || id >= m.size || !m.id_present[id]) return false;
  if (skip_special && m.added_index[id] >= 0 && m.added[m.added_index[id]].special) return false;
  if (!m.byte_level_decoder && !first) out += ' ';
  out += m.id_bytes[id];
  return true;
}

int32_t Tokenizer::token_id(std::string_view token) const {
  if (auto it = impl_->added_by_content.find(token); it != impl_->added_by_content.end())
    return impl_->added[it->second].id;
  return impl_->bpe.lookup(token);
}

std::string Tokenizer::id_to_token(int32_t id) const {
  const Impl& m = *impl_;
  if (id < 0 || id >= m.size) return {};
  if (m.added_index[id] >= 0) return m.added[m.added_index[id]].content;
  if (id < int32_t(m.bpe.id_to_token.size())) return m.bpe.id_to_token[id];
  return {};
}

bool Tokenizer::is_special(int32_t id) const {
  const Impl& m = *impl_;
  return id >= 0 && id < m.size && m.added_index[id] >= 0 && m.added[m.added_index[id]].special;
}

int32_t Tokenizer::vocab_size() const { return impl_->size; }

const std::string& Tokenizer::path() const { return impl_->path; }

}  // namespace glm5::runtime
