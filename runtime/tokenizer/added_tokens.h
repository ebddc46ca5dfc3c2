// Added tokens: a byte trie with leftmost-longest search. A part of the tokenizer (tokenizer.cpp), used by it alone.
#pragma once

#include <algorithm>
#include <array>
#include <cctype>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <queue>
#include <sstream>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "kernels/core/check.h"
#include "runtime/tokenizer/bpe.h"

namespace glm5::runtime::tok {

// ------------------------------------------------------------------------------------------------
// Added tokens: a byte trie with leftmost-longest search (HF uses aho-corasick LeftmostLongest).

struct AddedToken {
  std::string content;
  int32_t id;
  bool special, lstrip, rstrip, single_word, normalized;
};

class Trie {
 public:
  Trie() { root_.fill(-1); }
  bool empty() const { return nodes_.empty(); }
  void insert(std::string_view key, int32_t value) {
    if (key.empty()) return;
    int32_t node = child_of_root(bytes(key)[0], true);
    for (size_t i = 1; i < key.size(); ++i) node = child(node, bytes(key)[i], true);
    nodes_[node].value = value;
  }
  // Leftmost-longest match at or after `pos`: sets start, end and value.
  bool find(std::string_view text, size_t pos, size_t& start, size_t& end, int32_t& value) const {
    const unsigned char* s = bytes(text);
    for (size_t i = pos; i < text.size(); ++i) {
      int32_t node = root_[s[i]];
      if (node < 0) continue;
      int32_t best = -1;
      size_t best_end = 0;
      for (size_t k = i;;) {
        if (nodes_[node].value >= 0) {
          best = nodes_[node].value;
          best_end = k + 1;
        }
        if (++k >= text.size()) break;
        node = child(node, s[k], false);
        if (node < 0) break;
      }
      if (best >= 0) {
        start = i;
        end = best_end;
        value = best;
        return true;
      }
    }
    return false;
  }

 private:
  struct Node {
    int32_t value = -1;
    std::vector<std::pair<unsigned char, int32_t>> kids;
  };
  int32_t child_of_root(unsigned char c, bool create) {
    if (root_[c] < 0 && create) {
      root_[c] = int32_t(nodes_.size());
      nodes_.emplace_back();
    }
    return root_[c];
  }
  int32_t child(int32_t node, unsigned char c, bool create) {
    for (auto& [k, v] : nodes_[node].kids)
      if (k == c) return v;
    if (!create) return -1;
    int32_t n = int32_t(nodes_.size());
    nodes_.emplace_back();
    nodes_[node].kids.push_back({c, n});
    return n;
  }
  int32_t child(int32_t node, unsigned char c, bool) const {
    for (auto& [k, v] : nodes_[node].kids)
      if (k == c) return v;
    return -1;
  }
  std::array<int32_t, 256> root_;
  std::vector<Node> nodes_;
};

}  // namespace glm5::runtime::tok
