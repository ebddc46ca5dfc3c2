// The BPE model: vocabulary, merges by rank, a word cache. A part of the tokenizer (tokenizer.cpp), used by it alone.
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
#include "runtime/tokenizer/pre_tokenizer.h"

namespace glm5::runtime::tok {

// ------------------------------------------------------------------------------------------------
// Hash maps keyed by std::string, looked up with std::string_view.

struct SvHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};
template <typename V>
using StrMap = std::unordered_map<std::string, V, SvHash, std::equal_to<>>;
// ------------------------------------------------------------------------------------------------
// BPE model.

// (left id, right id) -> (rank, merged id), open addressing in a power-of-two table: one probe
// sequence per lookup instead of std::unordered_map's modulo and node chasing (this lookup is the
// inner loop of BPE).
class MergeTable {
 public:
  struct Entry {
    uint64_t key = kEmpty;
    int32_t rank = 0, new_id = 0;
  };
  void reserve(size_t n) {
    size_t cap = 16;
    while (cap < 2 * n) cap <<= 1;
    slots_.assign(cap, Entry{});
    shift_ = 64 - __builtin_ctzll(cap);
  }
  void set(int32_t a, int32_t b, int32_t rank, int32_t new_id) {
    uint64_t key = pack(a, b);
    for (size_t i = slot(key);; i = (i + 1) & (slots_.size() - 1)) {
      if (slots_[i].key == kEmpty || slots_[i].key == key) {
        slots_[i] = Entry{key, rank, new_id};  // a repeated pair: the later rank wins, as in HF
        return;
      }
    }
  }
  const Entry* find(int32_t a, int32_t b) const {
    uint64_t key = pack(a, b);
    for (size_t i = slot(key);; i = (i + 1) & (slots_.size() - 1)) {
      if (slots_[i].key == key) return &slots_[i];
      if (slots_[i].key == kEmpty) return nullptr;
    }
  }

 private:
  static constexpr uint64_t kEmpty = ~0ull;
  static uint64_t pack(int32_t a, int32_t b) { return (uint64_t(uint32_t(a)) << 32) | uint32_t(b); }
  size_t slot(uint64_t key) const { return size_t((key * 0x9E3779B97F4A7C15ull) >> shift_); }
  std::vector<Entry> slots_;
  int shift_ = 60;
};

// Finished words -> ids, shared by all threads of one tokenizer (HF keeps the same kind of cache).
// Open addressing on a 64-bit hash; keys and ids live in two arenas. When full it starts over.
class WordCache {
 public:
  static constexpr size_t kMaxWord = 256;  // longer pieces are not cached

  bool find(std::string_view key, uint64_t h, std::vector<int32_t>& out) const {
    std::lock_guard<std::mutex> lock(mu_);
    if (slots_.empty()) return false;
    for (size_t i = h & kMask;; i = (i + 1) & kMask) {
      const Slot& s = slots_[i];
      if (s.hash == 0) return false;
      if (s.hash == h && s.key_len == key.size() &&
          std::memcmp(keys_.data() + s.key_off, key.data(), key.size()) == 0) {
        out.insert(out.end(), ids_.begin() + s.ids_off, ids_.begin() + s.ids_off + s.n_ids);
        return true;
      }
    }
  }
  void insert(std::string_view key, uint64_t h, const int32_t* ids, size_t n) const {
    std::lock_guard<std::mutex> lock(mu_);
    if (slots_.empty()) slots_.resize(kSlots);  // allocated on first use
    if (count_ * 2 >= kSlots || ids_.size() + n > kMaxIds) {
      std::fill(slots_.begin(), slots_.end(), Slot{});
      keys_.clear();
      ids_.clear();
      count_ = 0;
    }
    size_t i = h & kMask;
    while (slots_[i].hash != 0) {
      if (slots_[i].hash == h && slots_[i].key_len == key.size() &&
          std::memcmp(keys_.data() + slots_[i].key_off, key.data(), key.size()) == 0)
        return;  // another thread got there first
      i = (i + 1) & kMask;
    }
    slots_[i] = Slot{h, uint32_t(keys_.size()), uint32_t(key.size()), uint32_t(ids_.size()), uint32_t(n)};
    keys_.append(key);
    ids_.insert(ids_.end(), ids, ids + n);
    ++count_;
  }
  static uint64_t hash(std::string_view key) {
    uint64_t h = std::hash<std::string_view>{}(key);
    return h ? h : 1;  // 0 marks an empty slot
  }

 private:
  static constexpr size_t kSlots = size_t(1) << 18, kMask = kSlots - 1, kMaxIds = size_t(1) << 22;
  struct Slot {
    uint64_t hash = 0;
    uint32_t key_off = 0, key_len = 0, ids_off = 0, n_ids = 0;
  };
  mutable std::mutex mu_;
  mutable std::vector<Slot> slots_;
  mutable std::string keys_;
  mutable std::vector<int32_t> ids_;
  mutable size_t count_ = 0;
};

struct Bpe {
  StrMap<int32_t> vocab;
  std::vector<std::string> id_to_token;  // "" where the model has no token
  MergeTable merges;
  std::vector<int32_t> small_char_id;      // id of each single-char token below U+0800
  std::array<int32_t, 256> byte_id{};      // byte-level: id of the printable char of each byte
  std::array<std::string, 256> byte_char;  // byte-level: that char in UTF-8
  bool ignore_merges = false, byte_fallback = false, fuse_unk = false;
  int32_t unk_id = -1;
  WordCache cache;

  int32_t lookup(std::string_view s) const {
    auto it = vocab.find(s);
    return it == vocab.end() ? -1 : it->second;
  }

  // A pre-tokenized piece of text: its chars are the initial symbols (HF BPE::tokenize).
  void tokenize(std::string_view word, std::vector<int32_t>& out) const { tokenize_impl(word, false, out); }
  // A piece of raw bytes under a byte-level pre-tokenizer: byte b's initial symbol is the token
  // of its printable char, so the mapped string need not be built. Same ids as
  // tokenize(map(word)).
  void tokenize_bytes(std::string_view raw, std::vector<int32_t>& out) const { tokenize_impl(raw, true, out); }

 private:
  struct Sym {
    int32_t id, prev, next;
    bool alive;
  };

  void tokenize_impl(std::string_view word, bool raw_bytes, std::vector<int32_t>& out) const {
    if (word.empty()) return;
    if (ignore_merges) {
      int32_t id = -1;
      if (raw_bytes) {
        std::string mapped;
        for (char c : word) mapped += byte_char[static_cast<unsigned char>(c)];
        id = lookup(mapped);
      } else {
        id = lookup(word);
      }
      if (id >= 0) {
        out.push_back(id);
        return;
      }
    }
    if (raw_bytes && word.size() == 1) {  // a lone byte: its symbol, nothing to merge
      if (int32_t id = byte_id[static_cast<unsigned char>(word[0])]; id >= 0) {
        out.push_back(id);
        return;
      }
    }
    const bool cacheable = word.size() <= WordCache::kMaxWord;
    uint64_t h = 0;
    if (cacheable) {
      h = WordCache::hash(word);
      if (cache.find(word, h, out)) return;
    }
    size_t first = out.size();
    thread_local std::vector<Sym> syms;
    syms.clear();
    if (raw_bytes)
      initial_bytes(word, syms);
    else
      initial_chars(word, syms);
    merge_all(syms);
    for (const Sym& s : syms)
      if (s.alive) out.push_back(s.id);
    if (cacheable) cache.insert(word, h, out.data() + first, out.size() - first);
  }

  static void push_sym(std::vector<Sym>& syms, int32_t id) {
    int32_t n = int32_t(syms.size());
    syms.push_back({id, n - 1, n + 1, true});
  }

  void initial_bytes(std::string_view word, std::vector<Sym>& syms) const {
    for (char c : word) {
      int32_t id = byte_id[static_cast<unsigned char>(c)];
      if (id >= 0)
        push_sym(syms, id);
      else
        initial_chars(byte_char[static_cast<unsigned char>(c)], syms);  // unk / fallback rules
    }
  }

  // One symbol per char; chars missing from the vocab go to byte fallback, then unk (fused or
  // not), else are dropped, as in HF.
  void initial_chars(std::string_view word, std::vector<Sym>& syms) const {
    bool pending_unk = false;
    for (size_t i = 0; i < word.size();) {
      size_t len = utf8_valid_len(bytes(word), word.size(), i);
      bool valid = len != 0;
      if (!valid) len = 1;
      std::string_view ch = word.substr(i, len);
      uint32_t cp = valid ? decode_cp(bytes(word) + i, len) : 0;
      int32_t id = valid && cp < small_char_id.size() ? small_char_id[cp] : lookup(ch);
      i += len;
      if (id >= 0) {
        pending_unk = false;
        push_sym(syms, id);
        continue;
      }
      if (byte_fallback) {
        std::array<int32_t, 4> ids{};
        bool all = true;
        for (size_t k = 0; k < ch.size(); ++k) {
          char name[8];
          std::snprintf(name, sizeof(name), "<0x%02X>", unsigned(static_cast<unsigned char>(ch[k])));
          ids[k] = lookup(name);
          all = all && ids[k] >= 0;
        }
        if (all) {
          pending_unk = false;
          for (size_t k = 0; k < ch.size(); ++k) push_sym(syms, ids[k]);
          continue;
        }
      }
      if (unk_id >= 0 && !(fuse_unk && pending_unk)) {
        push_sym(syms, unk_id);
        pending_unk = true;
      }
    }
  }

  // HF's Word::merge_all: repeatedly apply the lowest-rank merge (leftmost on ties). Short words
  // rescan their few pairs; long ones use a heap with stale entries skipped. Both give the same
  // result: the pair chosen is always the minimum (rank, position).
  void merge_all(std::vector<Sym>& syms) const {
    if (syms.size() < 2) return;
    syms.back().next = -1;
    if (syms.size() <= 24)
      merge_small(syms);
    else
      merge_heap(syms);
  }

  void merge_small(std::vector<Sym>& syms) const {
    // rank[i]: rank of the pair (symbol i, its next), INT32_MAX if none.
    thread_local std::vector<int32_t> rank, result;
    size_t n = syms.size();
    rank.assign(n, INT32_MAX);
    result.assign(n, -1);
    auto update = [&](int32_t i) {
      const Sym& s = syms[i];
      rank[i] = INT32_MAX;
      if (s.next < 0) return;
      if (const MergeTable::Entry* m = merges.find(s.id, syms[s.next].id)) {
        rank[i] = m->rank;
        result[i] = m->new_id;
      }
    };
    for (size_t i = 0; i < n; ++i) update(int32_t(i));
    for (;;) {
      int32_t best = -1;
      for (int32_t i = 0; i >= 0; i = syms[i].next)
        if (rank[i] != INT32_MAX && (best < 0 || rank[i] < rank[best])) best = i;
      if (best < 0) return;
      Sym& left = syms[best];
      Sym& right = syms[left.next];
      left.id = result[best];
      right.alive = false;
      left.next = right.next;
      if (left.next >= 0) syms[left.next].prev = best;
      update(best);
      if (left.prev >= 0) update(left.prev);
    }
  }

  void merge_heap(std::vector<Sym>& syms) const {
    struct Cand {
      int32_t rank, pos, new_id;
      bool operator<(const Cand& o) const {  // priority_queue pops the "largest": lowest rank
        return rank != o.rank ? rank > o.rank : pos > o.pos;
      }
    };
    thread_local std::vector<Cand> storage;
    storage.clear();
    std::priority_queue<Cand, std::vector<Cand>> heap(std::less<Cand>(), std::move(storage));
    for (size_t i = 0; i + 1 < syms.size(); ++i)
      if (const MergeTable::Entry* m = merges.find(syms[i].id, syms[i + 1].id))
        heap.push({m->rank, int32_t(i), m->new_id});
    while (!heap.empty()) {
      Cand top = heap.top();
      heap.pop();
      Sym& left = syms[top.pos];
      if (!left.alive || left.next < 0) continue;
      Sym& right = syms[left.next];
      const MergeTable::Entry* m = merges.find(left.id, right.id);
      if (!m || m->new_id != top.new_id) continue;  // stale entry
      left.id = top.new_id;
      right.alive = false;
      left.next = right.next;
      if (left.next >= 0) syms[left.next].prev = top.pos;
      if (left.prev >= 0)
        if (const MergeTable::Entry* pm = merges.find(syms[left.prev].id, left.id))
          heap.push({pm->rank, left.prev, pm->new_id});
      if (left.next >= 0)
        if (const MergeTable::Entry* nm = merges.find(left.id, syms[left.next].id))
          heap.push({nm->rank, top.pos, nm->new_id});
    }
  }
};

}  // namespace glm5::runtime::tok
