// Byte-level BPE tokenizer read from a Hugging Face `tokenizer.json` (GLM-5, DeepSeek-V3/V3.2, the
// project's tiny models): encode() gives HF `tokenizers`' ids (add_special_tokens=False), decode()
// inverts it byte for byte. Supports model BPE, normalizer Sequence/Replace/Prepend, pre_tokenizer
// Sequence/Split/Digits/ByteLevel, decoder ByteLevel. Leaves out Unicode normalization, WordPiece/
// Unigram, post-processor templates (no BOS: the chat formatter writes it), offsets, padding.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace glm5::runtime {

class Tokenizer {
 public:
  // `path_or_model_dir` is a tokenizer.json file or a directory holding one. Throws glm5::Error
  // naming the file when it is missing, is not JSON, or uses a component this class does not
  // implement (the message names the component and its type).
  static Tokenizer load(const std::string& path_or_model_dir);
  // A model directory's tokenizer.json when it has one, else null: such a model is run on token ids
  // (prompt_ids) alone. The one rule batch, serve and generate share.
  static std::unique_ptr<Tokenizer> load_if_present(const std::string& model_dir);

  // Text -> ids. With parse_special, added tokens in the text (e.g. "<|user|>") become their ids,
  // honouring their special/lstrip/rstrip/single_word/normalized flags as HF does; without it,
  // tokens flagged special are encoded as plain text (HF's encode_special_tokens=True), other
  // added tokens are still recognised. Bytes that are not valid UTF-8 are each encoded as their
  // own byte-level symbol, so decode(encode(s)) == s for any byte string.
  std::vector<int32_t> encode(std::string_view text, bool parse_special = true) const;

  // Ids -> bytes. skip_special drops tokens flagged special. Ids with no token are skipped (as HF
  // does: models pad their embedding past the tokenizer). The result is the raw byte string; it
  // is not repaired to valid UTF-8 (HF would put U+FFFD where a multi-byte char is cut).
  std::string decode(const std::vector<int32_t>& ids, bool skip_special = false) const;
  // Appends one id's bytes to `out` exactly as decode() joins it after the ids before it (`first`:
  // no id was appended before), so that appending ids one by one gives decode(ids). Returns
  // whether the id counted (false: skipped, like a special token with skip_special).
  bool append_decoded(std::string& out, int32_t id, bool skip_special, bool first) const;

  // Id of a token given by its vocabulary string (added tokens first, then the BPE vocab), e.g.
  // token_id("<|endoftext|>") or token_id("Ġthe"); -1 if absent.
  int32_t token_id(std::string_view token) const;
  // Vocabulary string of an id ("" if absent) and whether it is an added token flagged special.
  std::string id_to_token(int32_t id) const;
  bool is_special(int32_t id) const;

  // One past the largest id (BPE vocab and added tokens): a model's vocab_size must be >= this.
  int32_t vocab_size() const;
  // The tokenizer.json this was read from.
  const std::string& path() const;

 private:
  struct Impl;
  explicit Tokenizer(std::shared_ptr<const Impl> impl);
  std::shared_ptr<const Impl> impl_;  // immutable after load, except an internal word cache
};

}  // namespace glm5::runtime
