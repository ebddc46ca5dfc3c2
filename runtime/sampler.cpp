// Host-side sampler (the semantics are in sampler.h). Nothing here sorts the vocabulary:
//  - one pass copies the logits (divided by the temperature) and finds the max; the penalties
//    then patch only the tokens seen in the prompt / generated so far;
//  - weights w = exp(x - max) come from a vectorised double exp (see exp_nonpos for why double).
//    The one pass that computes w for every token (for the softmax normaliser and top-p's mass)
//    also files each candidate's w in a 65536-bucket histogram over the high 16 bits of an
//    order-preserving integer key of x;
//  - the top-k / top-p cut is found by walking that histogram from the top; only the bucket that
//    holds the cut is collected and sorted (typically a few hundred tokens), so the cut is exact,
//    ties broken by id;
//  - a small top_k (<= kSmallTopK) needs no histogram: one pass keeps the k best in a sorted list;
//  - the draw walks the kept tokens in id order by spans of 256: a span's kept mass is the weight
//    pass's candidate mass when nothing is cut, 0 when all its keys lie below the cut, or summed
//    (recomputing w) otherwise; only the span that holds u is walked token by token;
//  - top-n logprobs: one pass keeping a bounded sorted list.
// Scratch arrays are per thread and reused, so a call allocates nothing once warm.
#include "runtime/sampler.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "kernels/core/check.h"

namespace glm5::runtime {

void SamplingParams::validate() const {
  CHECK(std::isfinite(temperature) && temperature >= 0.0f,
        "sampling field 'temperature': expected a number >= 0, found ", temperature);
  CHECK(std::isfinite(top_p) && top_p > 0.0f && top_p <= 1.0f,
        "sampling field 'top_p': expected a number in (0, 1], found ", top_p);
  CHECK(top_k >= -1, "sampling field 'top_k': expected -1, 0 (off) or a positive integer, found ", top_k);
  CHECK(std::isfinite(min_p) && min_p >= 0.0f && min_p <= 1.0f,
        "sampling field 'min_p': expected a number in [0, 1], found ", min_p);
  CHECK(std::isfinite(repetition_penalty) && repetition_penalty > 0.0f,
        "sampling field 'repetition_penalty': expected a number > 0, found ", repetition_penalty);
  CHECK(std::isfinite(presence_penalty) && std::fabs(presence_penalty) <= 2.0f,
        "sampling field 'presence_penalty': expected a number in [-2, 2], found ", presence_penalty);
  CHECK(std::isfinite(frequency_penalty) && std::fabs(frequency_penalty) <= 2.0f,
        "sampling field 'frequency_penalty': expected a number in [-2, 2], found ", frequency_penalty);
  CHECK(max_tokens >= 1, "sampling field 'max_tokens': expected an integer >= 1, found ", max_tokens);
  CHECK(logprobs >= -1 && logprobs <= 20, "sampling field 'logprobs': expected an integer in [0, 20], found ",
        logprobs);
}

namespace {

uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// ---- Vectors ----
// GCC/Clang vector extensions: one AVX-512 (or AVX2) register each with -march=native, several
// narrower registers elsewhere (same results, only slower). Float passes take 16 tokens at a
// time; weight passes take 8, the weights being doubles.
constexpr int64_t kL = 16;  // float lanes; the working copy is padded to a multiple of this
constexpr int kD = 8;       // double lanes
using vf = float __attribute__((vector_size(64)));
using vu = uint32_t __attribute__((vector_size(64)));
using vf8 = float __attribute__((vector_size(32)));
using vi8 = int32_t __attribute__((vector_size(32)));
using vu8 = uint32_t __attribute__((vector_size(32)));
using vd = double __attribute__((vector_size(64)));
using vl = int64_t __attribute__((vector_size(64)));
constexpr float kInf = std::numeric_limits<float>::infinity();
// The working copy's padding: the NaN with all bits set. It has w = 0, key 0 (histogram bucket 0,
// which is never read), is never kept, and max / equality tests skip it, so no pass needs to
// mask the lanes past the vocabulary.
const float kPad = [] {
  const uint32_t bits = 0xffffffffu;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}();

template <typename V, typename T>
V load(const T* p) {
  V v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
template <typename V, typename T>
void store(T* p, V v) {
  std::memcpy(p, &v, sizeof v);
}

template <typename M>
bool any(M m) {  // m: a comparison result (all-ones lanes where true)
  uint64_t q[8] = {};
  static_assert(sizeof m <= sizeof q);
  std::memcpy(q, &m, sizeof m);
  return (q[0] | q[1] | q[2] | q[3] | q[4] | q[5] | q[6] | q[7]) != 0;
}
float max_lanes(vf v) {
  float m = v[0];
  for (int j = 1; j < kL; ++j) m = v[j] > m ? v[j] : m;
  return m;
}
template <typename V>
auto sum_lanes(V v) {
  auto t = v[0];
  for (size_t j = 1; j < sizeof v / sizeof v[0]; ++j) t += v[j];
  return t;
}

// e^d in double for d <= 0, within about 1 ulp: d = n ln2 + r with |r| <= ln2 / 2, e^r by its
// Taylor series to degree 13 (truncation < 1e-17), times 2^n; 0 below -708 (denormal range).
// Double rather than float (which would be 4x cheaper): top-p's cut and the draw compare
// running sums of weights, and with float weights they would disagree with a plain double
// reference (and the previous sampler) about one case in a few hundred at this vocabulary.
vd exp_nonpos(vd d) {
  const vd lo = vd{} - 708.0;
  vd c = d > lo ? d : lo;
  vd n = (c * 1.4426950408889634 + 6755399441055744.0) - 6755399441055744.0;  // round to nearest
  vd r = c - n * 0.693145751953125;                                           // ln2's high bits: n * this is exact
  r = r - n * 1.42860682030941723212e-6;                                      // the rest of ln2
  constexpr double kInvFact[] = {
      1.0 / 6227020800, 1.0 / 479001600, 1.0 / 39916800, 1.0 / 3628800, 1.0 / 362880, 1.0 / 40320, 1.0 / 5040,
      1.0 / 720,        1.0 / 120,       1.0 / 24,       1.0 / 6,       1.0 / 2,      1.0,         1.0};
  vd y = vd{} + kInvFact[0];
  for (int k = 1; k < 14; ++k) y = y * r + kInvFact[k];
  vd two_n = (vd)((__builtin_convertvector(n, vl) + 1023) << 52);  // n in [-1022, 0]: normal
  return (vd)((vl)(y * two_n) & (d >= lo));                        // also 0 for NaN d (the padding)
}
// w of the 8 tokens from x: exp(x - mx).
vd weights8(const float* x, float mx) { return exp_nonpos(__builtin_convertvector(load<vf8>(x), vd) - double(mx)); }
double weight(float x, float mx) { return exp_nonpos(vd{} + (double(x) - double(mx)))[0]; }

// Order-preserving integer key: key(a) > key(b) exactly when a > b (-0 is folded into +0, which
// compares equal to it). Ranking by (key desc, id asc) is ranking by (x desc, id asc). The
// padding's NaN (all bits set) gets key 0, below every number.
template <typename U, typename F>
U rank_keys(F x) {
  U b = (U)(x + 0.0f);
  return b ^ ((U{} - (b >> 31)) | 0x80000000u);  // negative: all bits flipped; else the sign bit set
}
uint32_t rank_key(float x) {
  uint32_t b;
  const float z = x + 0.0f;
  std::memcpy(&b, &z, sizeof b);
  return b ^ ((0u - (b >> 31)) | 0x80000000u);
}

// ---- Scratch ----

constexpr int kBuckets = 65536;      // histogram over the key's high 16 bits; bucket 0: non-candidates
constexpr int64_t kSmallTopK = 128;  // up to this, top_k keeps a sorted list instead
constexpr int64_t kSpan = 256;       // tokens per span_mass entry

struct Member {  // a token of a boundary bucket
  uint32_t key;
  int32_t id;
  double w;
};

// Per-thread scratch, grown on demand and reused: vocabulary-sized vectors allocated (and
// zeroed) per token would cost about as much as the sampling itself.
struct Scratch {
  std::vector<float> x;                              // working logits, padded to a multiple of 16 with kPad
  std::vector<uint8_t> seen;                         // repetition-penalty marks, all 0 between calls
  std::vector<int32_t> count;                        // times generated, all 0 between calls
  std::vector<int32_t> touched;                      // tokens the penalties change
  std::vector<uint32_t> cnt;                         // per bucket, all 0 between calls
  std::vector<double> mass;                          // per bucket, all 0 between calls
  std::vector<double> span_mass;                     // candidate mass per kSpan tokens (the draw skips spans)
  std::vector<uint32_t> span_max_key;                // largest key per kSpan tokens (filled with a histogram)
  std::vector<Member> members_k, members_p, sorted;  // boundary buckets
  std::vector<uint32_t> low_count;                   // counting sort of a large bucket
  std::vector<std::pair<float, int32_t>> best;       // top-n / small top-k
  std::vector<std::pair<int32_t, double>> kept;      // small top-k's kept tokens

  void reserve(int64_t vocab, int64_t padded) {
    if (int64_t(x.size()) < padded) x.resize(size_t(padded));
    if (int64_t(seen.size()) < vocab) {
      seen.resize(size_t(vocab), 0);
      count.resize(size_t(vocab), 0);
    }
    if (cnt.empty()) {
      cnt.assign(kBuckets, 0);
      mass.assign(kBuckets, 0.0);
      low_count.assign(kBuckets, 0);
    }
  }
};

Scratch& scratch() {
  thread_local Scratch s;
  return s;
}

// ---- Logits and penalties ----

struct Range {
  float max, min;
};

// x[0, vocab) = logits / t (t 0 or 1: a plain copy), kPad up to `padded`; returns x's range.
Range load_logits(const float* logits, int64_t vocab, float t, float* x, int64_t padded) {
  const bool scale = t > 0.0f && t != 1.0f;
  const int64_t full = vocab / kL * kL;
  vf hi = vf{} - kInf, lo = vf{} + kInf;
  for (int64_t i = 0; i < full; i += kL) {
    vf v = load<vf>(logits + i);
    if (scale) v = v / t;
    store(x + i, v);
    hi = v > hi ? v : hi;
    lo = v < lo ? v : lo;
  }
  Range r{max_lanes(hi), -max_lanes(-lo)};
  for (int64_t i = full; i < vocab; ++i) {
    x[i] = scale ? logits[i] / t : logits[i];
    r.max = x[i] > r.max ? x[i] : r.max;
    r.min = x[i] < r.min ? x[i] : r.min;
  }
  std::fill(x + vocab, x + padded, kPad);
  return r;
}

float max_value(const float* x, int64_t padded) {  // skips NaN (the padding)
  vf m = vf{} - kInf;
  for (int64_t i = 0; i < padded; i += kL) {
    vf v = load<vf>(x + i);
    m = v > m ? v : m;
  }
  return max_lanes(m);
}

// The first i < n with x[i] == v (0 if none).
int32_t first_equal(const float* x, int64_t n, float v) {
  const int64_t full = n / kL * kL;
  for (int64_t i = 0; i < full; i += kL)
    if (any(load<vf>(x + i) == v))
      for (int j = 0;; ++j)
        if (x[i + j] == v) return int32_t(i + j);
  for (int64_t i = full; i < n; ++i)
    if (x[i] == v) return int32_t(i);
  return 0;
}

bool has_penalties(const SamplingParams& p) {
  return p.repetition_penalty != 1.0f || p.presence_penalty != 0.0f || p.frequency_penalty != 0.0f;
}

// Recomputes x for the tokens the penalties concern (from the caller's logits, so each gets its
// penalties once and in the documented order); the rest stay as load_logits left them. Updates
// the range: by the patched values, or by a fresh pass when the max itself went down.
void apply_penalties(const float* logits, int64_t vocab, int64_t padded, const SamplingParams& p,
                     const std::vector<int32_t>& prompt, const std::vector<int32_t>& generated, Range& range,
                     Scratch& s) {
  const bool rep = p.repetition_penalty != 1.0f;
  const bool pres_freq = p.presence_penalty != 0.0f || p.frequency_penalty != 0.0f;
  s.touched.clear();
  auto touch = [&](int32_t t) {
    if (!s.seen[size_t(t)] && !s.count[size_t(t)]) s.touched.push_back(t);
  };
  if (rep)
    for (const auto* list : {&prompt, &generated})
      for (int32_t t : *list)
        if (t >= 0 && t < vocab) touch(t), s.seen[size_t(t)] = 1;
  if (pres_freq)
    for (int32_t t : generated)
      if (t >= 0 && t < vocab) touch(t), ++s.count[size_t(t)];
  bool max_lowered = false;
  const float mx = range.max;
  for (int32_t t : s.touched) {
    float v = logits[t];
    if (s.seen[size_t(t)]) v = v > 0 ? v / p.repetition_penalty : v * p.repetition_penalty;
    if (const int32_t c = s.count[size_t(t)]) v -= p.presence_penalty + p.frequency_penalty * float(c);
    if (p.temperature > 0.0f) v /= p.temperature;
    max_lowered |= s.x[size_t(t)] == mx && v < mx;
    range.max = std::max(range.max, v);
    range.min = std::min(range.min, v);
    s.x[size_t(t)] = v;
    s.seen[size_t(t)] = 0;
    s.count[size_t(t)] = 0;
  }
  if (max_lowered) range.max = max_value(s.x.data(), padded);
}

// ---- Weights and the histogram ----

enum class Hist { none, mass, count_and_mass };

struct Weights {
  double all = 0;               // sum of w over the vocabulary: the log-softmax normaliser
  double candidates = 0;        // sum of w over the candidates (w >= min_p)
  int lowest = 0, highest = 0;  // the histogram's buckets in use (those of min x and max x)
};

// The pass computing w for every token: the sums, and (H != none) each candidate's mass (and
// count) in its bucket. Non-candidates and the padding go to bucket 0, which is never read: no
// branch per token (a branch that skipped negligible weights measured 1.7x slower: it
// mispredicts, and each miss discards the exp chains in flight). kMinP: whether min_p > 0
// (otherwise every token is a candidate).
template <Hist H, bool kMinP>
Weights weigh(Scratch& s, int64_t padded, Range range, double min_p) {
  vd all{};
  double candidates = 0;
  s.span_mass.resize(size_t((padded + kSpan - 1) / kSpan));
  s.span_max_key.resize(s.span_mass.size());
  for (int64_t span = 0; span < padded; span += kSpan) {
    vd span_sum{};
    vu8 span_max{};
    for (int64_t i = span; i < std::min(span + kSpan, padded); i += kD) {
      const vd w = weights8(&s.x[size_t(i)], range.max);
      const vl cand = w >= min_p;
      const vd wc = kMinP ? (vd)((vl)w & cand) : w;
      all += w;
      span_sum += wc;
      if constexpr (H != Hist::none) {  // then the draw may cut: it needs span_max_key
        const vu8 key = rank_keys<vu8>(load<vf8>(&s.x[size_t(i)]));
        span_max = key > span_max ? key : span_max;
        vu8 b = key >> 16;
        if constexpr (kMinP) b &= (vu8) __builtin_convertvector(cand, vi8);
        for (int j = 0; j < kD; ++j) {
          s.mass[b[j]] += wc[j];
          if constexpr (H == Hist::count_and_mass) ++s.cnt[b[j]];
        }
      }
    }
    candidates += s.span_mass[size_t(span / kSpan)] = sum_lanes(span_sum);
    uint32_t max_key = 0;
    for (int j = 0; j < kD; ++j) max_key = std::max(max_key, uint32_t(span_max[j]));
    s.span_max_key[size_t(span / kSpan)] = max_key;
  }
  Weights r;
  r.all = sum_lanes(all);
  r.candidates = candidates;
  r.lowest = int(rank_key(range.min) >> 16);
  r.highest = int(rank_key(range.max) >> 16);
  return r;
}
template <Hist H>
Weights weigh(Scratch& s, int64_t padded, Range range, double min_p) {
  return min_p > 0 ? weigh<H, true>(s, padded, range, min_p) : weigh<H, false>(s, padded, range, min_p);
}

void clear_histogram(Scratch& s, const Weights& wt) {  // only the buckets used, and bucket 0
  std::fill(s.cnt.begin() + wt.lowest, s.cnt.begin() + wt.highest + 1, 0u);
  std::fill(s.mass.begin() + wt.lowest, s.mass.begin() + wt.highest + 1, 0.0);
  s.cnt[0] = 0;
  s.mass[0] = 0;
}

// The candidates of bucket b, in rank order. They share the key's high half and are found in id
// order, so a stable ordering by the low half is enough: std::sort for the usual few hundred, a
// counting sort by the low 16 bits when there are many (e.g. many equal logits).
void bucket_members(Scratch& s, int64_t vocab, int64_t padded, int b, float mx, double min_p,
                    std::vector<Member>& out) {
  out.clear();
  const vu want = vu{} + uint32_t(b);
  for (int64_t i = 0; i < padded; i += kL) {
    const vu high = rank_keys<vu>(load<vf>(&s.x[size_t(i)])) >> 16;
    if (!any(high == want)) continue;
    for (int j = 0; j < kL; ++j)
      if (high[j] == want[j] && i + j < vocab)
        out.push_back({rank_key(s.x[size_t(i + j)]), int32_t(i + j), weight(s.x[size_t(i + j)], mx)});
  }
  std::erase_if(out, [&](const Member& m) { return !(m.w >= min_p); });  // as weigh() decided
  if (out.size() <= 2048) {
    std::sort(out.begin(), out.end(),
              [](const Member& a, const Member& c) { return a.key > c.key || (a.key == c.key && a.id < c.id); });
    return;
  }
  for (const Member& m : out) ++s.low_count[m.key & 0xffffu];
  uint32_t next = 0;  // each low half's first slot, the highest low half first
  for (int k = kBuckets - 1; k >= 0; --k) {
    const uint32_t c = s.low_count[size_t(k)];
    s.low_count[size_t(k)] = next;
    next += c;
  }
  s.sorted.resize(out.size());
  for (const Member& m : out) s.sorted[s.low_count[m.key & 0xffffu]++] = m;
  out.swap(s.sorted);
  std::fill(s.low_count.begin(), s.low_count.end(), 0u);
}

// ---- Cuts ----

// A cut in rank order: token i is kept when key(x_i) > key, or key(x_i) == key and i <= id.
// The default keeps every candidate (no real value has key 0).
struct Cut {
  uint32_t key = 0;
  int32_t id = -1;
};

struct Selection {
  Cut cut;
  double mass = 0;  // of the kept tokens
};

struct TopK {
  int bucket = -1;    // the bucket holding the cut; -1: top_k keeps every candidate
  int64_t taken = 0;  // how many of its members are kept (s.members_k, rank order)
};

// The top_k cut: buckets from the top until the count reaches k, then the first members of the
// bucket that crosses it. Nothing to cut when there are at most k candidates.
TopK cut_top_k(Scratch& s, int64_t vocab, int64_t padded, int64_t k, float mx, double min_p, const Weights& wt,
               Selection& sel) {
  if (k >= padded - int64_t(s.cnt[0])) return TopK{};  // bucket 0: non-candidates and padding
  int64_t above = 0;
  double mass_above = 0;
  int b = wt.highest;
  for (; above + int64_t(s.cnt[size_t(b)]) < k; --b) {
    above += s.cnt[size_t(b)];
    mass_above += s.mass[size_t(b)];
  }
  bucket_members(s, vocab, padded, b, mx, min_p, s.members_k);
  const TopK t{b, std::min(k - above, int64_t(s.members_k.size()))};
  if (t.taken <= 0) return TopK{};  // not reached: the histogram counted these very members
  for (int64_t j = 0; j < t.taken; ++j) mass_above += s.members_k[size_t(j)].w;
  const Member& last = s.members_k[size_t(t.taken - 1)];
  sel = {Cut{last.key, last.id}, mass_above};
  return t;
}

// The top_p cut: the smallest rank prefix (within what top_k kept) whose mass reaches
// top_p * sel.mass. Whole buckets are skipped by their mass; only the crossing one is sorted.
void cut_top_p(Scratch& s, int64_t vocab, int64_t padded, float top_p, float mx, double min_p, const Weights& wt,
               const TopK& k, Selection& sel) {
  const double target = double(top_p) * sel.mass;
  double acc = 0;
  auto reach = [&](const std::vector<Member>& run, int64_t n) {  // run: rank order
    for (int64_t j = 0; j < n; ++j) {
      acc += run[size_t(j)].w;
      if (acc >= target) {
        sel = {Cut{run[size_t(j)].key, run[size_t(j)].id}, acc};
        return true;
      }
    }
    return false;
  };
  for (int b = wt.highest; b >= wt.lowest; --b) {
    if (b == k.bucket) {  // the top-k cut: only its first members count, nothing below
      reach(s.members_k, k.taken);
      return;
    }
    if (acc + s.mass[size_t(b)] < target) {
      acc += s.mass[size_t(b)];
      continue;
    }
    bucket_members(s, vocab, padded, b, mx, min_p, s.members_p);
    if (reach(s.members_p, int64_t(s.members_p.size()))) return;
  }
  // Rounding left the mass just short of the target: keep everything top_k kept.
}

// ---- Draws ----

// Which of the 8 tokens from i on are kept (candidates on the kept side of the cut); w: theirs.
// No early exit for blocks without kept tokens: where kept tokens are spread out, that branch
// mispredicts and each miss discards the exp chains in flight.
vl kept_lanes(const Scratch& s, int64_t i, Cut cut, float mx, double min_p, vd& w) {
  const vu8 key = rank_keys<vu8>(load<vf8>(&s.x[size_t(i)]));
  const vu8 cut_key = vu8{} + cut.key;
  const vi8 ids = vi8{0, 1, 2, 3, 4, 5, 6, 7} + int32_t(i);
  const vi8 inside = (key > cut_key) | ((key == cut_key) & (ids <= cut.id));  // never the padding
  w = weights8(&s.x[size_t(i)], mx);
  return __builtin_convertvector(inside, vl) & (w >= min_p);
}

// The kept mass of one span: weigh()'s candidate mass when nothing is cut, 0 when the span's
// largest key is below the cut, else summed here.
double span_kept_mass(const Scratch& s, size_t span, int64_t padded, Cut cut, float mx, double min_p) {
  if (cut.key == 0) return s.span_mass[span];
  if (s.span_max_key[span] < cut.key) return 0;
  vd sum{}, w;
  for (int64_t i = int64_t(span) * kSpan; i < std::min(int64_t(span + 1) * kSpan, padded); i += kD) {
    const vl kept = kept_lanes(s, i, cut, mx, min_p, w);
    sum += (vd)((vl)w & kept);
  }
  return sum_lanes(sum);
}

// The draw: the first kept token in id order whose running mass exceeds u. Spans of kSpan tokens
// are skipped by their kept mass; inside the span that holds u the walk goes token by token.
int32_t draw(const Scratch& s, int64_t vocab, int64_t padded, Cut cut, float mx, double min_p, double u) {
  double acc = 0;
  for (size_t span = 0; span < s.span_mass.size(); ++span) {
    const double mass = span_kept_mass(s, span, padded, cut, mx, min_p);
    if (!(u < acc + mass)) {
      acc += mass;
      continue;
    }
    vd w;
    for (int64_t i = int64_t(span) * kSpan; i < std::min(int64_t(span + 1) * kSpan, padded); i += kD) {
      const vl kept = kept_lanes(s, i, cut, mx, min_p, w);
      for (int j = 0; j < kD; ++j) {
        if (!kept[j]) continue;
        acc += w[j];
        if (u < acc) return int32_t(i + j);
      }
    }  // rounding: u lies past this span's running sums after all; go on with the next span
  }
  // Rounding left u at or beyond the last running sum: the last kept token. (The best
  // candidate is always kept, so there is one.)
  for (int64_t i = vocab - 1; i >= 0; --i) {
    const uint32_t key = rank_key(s.x[size_t(i)]);
    if ((key > cut.key || (key == cut.key && i <= cut.id)) && weight(s.x[size_t(i)], mx) >= min_p) return int32_t(i);
  }
  return 0;
}

// The n best of x[0, vocab) by (x desc, id asc), best first: one pass keeping a sorted list of n,
// skipping blocks of 16 whose max cannot enter the full list.
void top_n(const float* x, int64_t vocab, int64_t n, std::vector<std::pair<float, int32_t>>& best) {
  best.clear();
  auto offer = [&](float v, int32_t id) {
    if (int64_t(best.size()) == n) {
      if (!(v > best.back().first)) return;  // a tie ranks after: its id is higher
      best.pop_back();
    }
    auto pos = best.end();
    while (pos != best.begin() && (pos - 1)->first < v) --pos;
    best.insert(pos, {v, id});
  };
  int64_t i = 0;
  for (; i + kL <= vocab; i += kL) {
    if (int64_t(best.size()) == n && !any(load<vf>(x + i) > best.back().first)) continue;
    for (int j = 0; j < kL; ++j) offer(x[i + j], int32_t(i + j));
  }
  for (; i < vocab; ++i) offer(x[i], int32_t(i));
}

// top_k <= kSmallTopK: the k best by one pass, then min_p and top_p on that list, and the draw
// over what is kept, sorted by id.
int32_t draw_small_top_k(Scratch& s, int64_t vocab, const SamplingParams& p, float mx, double u01) {
  top_n(s.x.data(), vocab, std::min<int64_t>(p.top_k, vocab), s.best);
  s.kept.clear();
  for (auto [v, id] : s.best) {
    const double w = weight(v, mx);
    if (!s.kept.empty() && !(w >= double(p.min_p))) break;  // min_p: a rank prefix, at least one
    s.kept.push_back({id, w});
  }
  if (p.top_p < 1.0f) {
    double mass = 0, acc = 0;
    for (auto [id, w] : s.kept) mass += w;
    size_t n = 0;
    while (n < s.kept.size()) {
      acc += s.kept[n++].second;
      if (acc >= double(p.top_p) * mass) break;
    }
    s.kept.resize(n);
  }
  std::sort(s.kept.begin(), s.kept.end());
  double mass = 0, acc = 0;
  for (auto [id, w] : s.kept) mass += w;
  const double u = u01 * mass;
  for (auto [id, w] : s.kept)
    if (u < (acc += w)) return id;
  return s.kept.back().first;
}

// Fills in the logprobs: x is the distribution's logits, mx its max, z = sum of exp(x - mx).
Sampled finish(int32_t token, const float* x, int64_t vocab, float mx, double z, int logprobs, Scratch& s) {
  Sampled out;
  out.token = token;
  if (logprobs < 0) return out;
  const double log_norm = double(mx) + std::log(z);
  out.logprob = float(double(x[token]) - log_norm);
  if (logprobs > 0) {
    top_n(x, vocab, std::min<int64_t>(logprobs, vocab), s.best);
    for (auto [v, id] : s.best) out.top.push_back({id, float(double(v) - log_norm)});
  }
  return out;
}

}  // namespace

double sampling_uniform(uint64_t seed, int64_t step) {
  uint64_t r = splitmix64(splitmix64(seed) ^ uint64_t(step) * 0xd1342543de82ef95ull);
  return double(r >> 11) * (1.0 / 9007199254740992.0);
}

Sampled token_logprob(const float* logits, int64_t vocab, int32_t token, int32_t n) {
  CHECK(vocab >= 1 && token >= 0 && token < vocab, "token_logprob: token ", token, " outside the vocabulary of ",
        vocab);
  CHECK(n >= 0, "token_logprob: expected n >= 0 best tokens, found ", n);
  Scratch& s = scratch();
  const int64_t padded = (vocab + kL - 1) / kL * kL;
  s.reserve(vocab, padded);
  const Range range = load_logits(logits, vocab, 0.0f, s.x.data(), padded);  // a plain copy
  const double z = weigh<Hist::none>(s, padded, range, 0.0).all;
  return finish(token, s.x.data(), vocab, range.max, z, n, s);
}

int32_t argmax(const float* x, int64_t n) {
  if (n <= 0) return 0;
  const int64_t full = n / kL * kL;
  float mx = full > 0 ? max_value(x, full) : -kInf;  // skips NaN, as the tail loop does
  for (int64_t i = full; i < n; ++i) mx = x[i] > mx ? x[i] : mx;
  return first_equal(x, n, mx);
}

std::vector<Sampled> verify_drafts(const float* logits, int64_t vocab, const int32_t* drafts, int64_t n_drafts,
                                   const SamplingParams& p, const std::vector<int32_t>& prompt,
                                   std::vector<int32_t>& generated) {
  std::vector<Sampled> out;
  for (int64_t j = 0; j <= n_drafts; ++j) {
    out.push_back(sample(logits + j * vocab, vocab, p, prompt, generated, int64_t(generated.size())));
    generated.push_back(out.back().token);
    if (j < n_drafts && out.back().token != drafts[j]) break;
  }
  return out;
}

Sampled sample(const float* logits, int64_t vocab, const SamplingParams& p, const std::vector<int32_t>& prompt,
               const std::vector<int32_t>& generated, int64_t step) {
  CHECK(vocab >= 1, "sample: expected a vocabulary of at least 1 token, found ", vocab);
  const bool greedy = p.temperature == 0.0f;
  if (greedy && p.logprobs < 0 && !has_penalties(p)) return Sampled{argmax(logits, vocab), 0.0f, {}};

  Scratch& s = scratch();
  const int64_t padded = (vocab + kL - 1) / kL * kL;
  s.reserve(vocab, padded);
  Range range = load_logits(logits, vocab, p.temperature, s.x.data(), padded);
  if (has_penalties(p)) apply_penalties(logits, vocab, padded, p, prompt, generated, range, s);
  const float mx = range.max;
  const double min_p = p.min_p;

  int32_t token;
  double z = 1;  // the softmax normaliser, when logprobs are asked for
  if (greedy) {
    token = first_equal(s.x.data(), vocab, mx);
    if (p.logprobs >= 0) z = weigh<Hist::none>(s, padded, range, 0.0).all;
  } else if (p.top_k > 0 && p.top_k <= kSmallTopK) {
    token = draw_small_top_k(s, vocab, p, mx, sampling_uniform(p.seed, step));
    if (p.logprobs >= 0) z = weigh<Hist::none>(s, padded, range, 0.0).all;
  } else {
    const bool top_k = p.top_k > 0, top_p = p.top_p < 1.0f;
    const Weights wt = top_k   ? weigh<Hist::count_and_mass>(s, padded, range, min_p)
                       : top_p ? weigh<Hist::mass>(s, padded, range, min_p)
                               : weigh<Hist::none>(s, padded, range, min_p);
    Selection sel{Cut{}, wt.candidates};
    if (top_k || top_p) {
      TopK k;
      if (top_k) k = cut_top_k(s, vocab, padded, p.top_k, mx, min_p, wt, sel);
      if (top_p) cut_top_p(s, vocab, padded, p.top_p, mx, min_p, wt, k, sel);
      clear_histogram(s, wt);
    }
    const double u = sampling_uniform(p.seed, step) * sel.mass;
    token = draw(s, vocab, padded, sel.cut, mx, min_p, u);
    z = wt.all;
  }
  return finish(token, s.x.data(), vocab, mx, z, p.logprobs, s);
}

}  // namespace glm5::runtime
