// Hand-worked oracles for every op: small inputs whose results are written out as literal numbers
// (worked by hand; the comments show the arithmetic). They pin the reference backend to ops.h and
// run on the fast CPU backend too. Calls go through Buffers, so guard values are checked as well.
#include <algorithm>
#include <cmath>

#include "kernels/cpu/reference.h"
#include "tests/kernels/op_check.h"

namespace glm5::kernels::test {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

class Oracle : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override { backend_ = GetParam() == "cpu" ? make_cpu_backend() : make_reference_backend(); }
  // Runs `call` and returns its outputs, failing on overwritten guards.
  Outputs run(const std::function<void(Buffers&)>& call) {
    Outputs o = run_case(*backend_, OpCase{"oracle", call});
    for (const auto& e : o.guard_errors) ADD_FAILURE() << e;
    return o;
  }
  std::unique_ptr<Backend> backend_;
};

void expect_near(const std::vector<float>& got, const std::vector<float>& want, float tol = 1e-5f) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::isinf(want[i])) {
      EXPECT_EQ(got[i], want[i]) << "element " << i;
    } else {
      EXPECT_NEAR(got[i], want[i], tol) << "element " << i;
    }
  }
}

// y = x W^T with x = [[1, 2], [3, 4]], W = [[1, 0], [0, 1], [1, 1]]  ->  [[1, 2, 3], [3, 4, 7]].
TEST_P(Oracle, GemmAllWeightDtypes) {
  for (DType dt : {DType::BF16, DType::F16, DType::F32}) {
    auto w = weight_bytes({1, 0, 0, 1, 1, 1}, dt);
    Outputs o = run([&](Buffers& b) {
      GemmParams p;
      p.x = b.in(std::vector<float>{1, 2, 3, 4}), p.ldx = 2;
      p.w = Weight{b.in_bytes(w), dt, 3, 2, 2};
      p.y = b.out("y", 6), p.ldy = 3, p.m = 2, p.n = 3, p.k = 2;
      b.backend().gemm(p);
    });
    expect_near(o.floats[0], {1, 2, 3, 3, 4, 7});
  }
}

// trans_w: W [k = 2, n = 3] = [[1, 2, 3], [4, 5, 6]], x = [1, 1]  ->  [5, 7, 9]; accumulate onto
// [10, 20, 30] -> [15, 27, 39]. Strides: ldx 3, W ld 4, ldy 4 (padding never written).
TEST_P(Oracle, GemmTransposedAccumulateStrided) {
  auto w = weight_bytes({1, 2, 3, -99, 4, 5, 6, -99}, DType::BF16);
  Outputs o = run([&](Buffers& b) {
    GemmParams p;
    p.x = b.in(std::vector<float>{1, 1, 100}), p.ldx = 3;
    p.w = Weight{b.in_bytes(w), DType::BF16, 2, 3, 4};
    p.trans_w = true;
    p.y = b.out("y", std::vector<float>{10, 20, 30, -1}), p.ldy = 4, p.m = 1, p.n = 3, p.k = 2;
    p.accumulate = true;
    b.backend().gemm(p);
  });
  expect_near(o.floats[0], {15, 27, 39, -1});
}

// mean(x^2) of [1, 2, 3, 4] = 30 / 4 = 7.5, 1/sqrt(7.5) = 0.36514837; weights [1, 1, 2, 0.5].
TEST_P(Oracle, RmsNorm) {
  Outputs o = run([&](Buffers& b) {
    RmsNormParams p;
    p.x = b.in(std::vector<float>{1, 2, 3, 4}), p.ldx = 4;
    p.weight = b.in(std::vector<float>{1, 1, 2, 0.5f});
    p.y = b.out("y", 4), p.ldy = 4, p.m = 1, p.d = 4, p.eps = 0.0f;
    b.backend().rms_norm(p);
  });
  expect_near(o.floats[0], {0.36514837f, 0.73029674f, 2.19089023f, 0.73029674f});
}

// mean 2.5, biased variance (2.25 + 0.25 + 0.25 + 2.25) / 4 = 1.25, 1/sqrt(1.25) = 0.89442719;
// weight 1, bias [0, 0, 0, 1]. In place.
TEST_P(Oracle, LayerNormInPlace) {
  Outputs o = run([&](Buffers& b) {
    LayerNormParams p;
    float* xy = b.out("xy", std::vector<float>{1, 2, 3, 4});
    p.x = xy, p.y = xy, p.ldx = p.ldy = 4;
    p.weight = b.in(std::vector<float>{1, 1, 1, 1});
    p.bias = b.in(std::vector<float>{0, 0, 0, 1});
    p.m = 1, p.d = 4, p.eps = 0.0f;
    b.backend().layer_norm(p);
  });
  expect_near(o.floats[0], {-1.34164079f, -0.44721360f, 0.44721360f, 2.34164079f});
}

// x = [1, 2, 3, 4] at position 1, inv_freq [1, 0.5]: angles 1 and 0.5.
// cos 1 = 0.54030231, sin 1 = 0.84147098, cos .5 = 0.87758256, sin .5 = 0.47942554.
// Interleaved pairs (0,1)@1, (2,3)@.5: [1c1 - 2s1, 1s1 + 2c1, 3c.5 - 4s.5, 3s.5 + 4c.5].
// Half-split pairs (0,2)@1, (1,3)@.5:  [1c1 - 3s1, 2c.5 - 4s.5, 1s1 + 3c1, 2s.5 + 4c.5].
// Layout: 2 tokens x 2 heads, head stride 6, rope slice at offset 1; token 1 is at position 0
// (unchanged); head 1 carries [1, 2, 3, 4] * 2 -> doubled results; other elements untouched.
TEST_P(Oracle, RopeBothLayoutsAtPositionOne) {
  const std::vector<float> inter = {-1.14263966f, 1.92207560f, 0.71504553f, 4.94860686f};
  const std::vector<float> half = {-1.98411065f, -0.16253703f, 2.46237790f, 4.46918132f};
  for (bool interleaved : {true, false}) {
    std::vector<float> x = {9, 1, 2, 3, 4, 9, 9, 2, 4, 6, 8, 9,   // token 0: head 0, head 1
                            9, 1, 2, 3, 4, 9, 9, 2, 4, 6, 8, 9};  // token 1
    Outputs o = run([&](Buffers& b) {
      RopeParams p;
      p.x = b.out("x", x);
      p.m = 2, p.n_heads = 2, p.token_stride = 12, p.head_stride = 6, p.offset = 1, p.rope_dim = 4;
      p.positions = b.in(std::vector<int32_t>{1, 0});
      p.inv_freq = b.in(std::vector<float>{1.0f, 0.5f});
      p.interleaved = interleaved;
      b.backend().rope(p);
    });
    const auto& r = interleaved ? inter : half;
    std::vector<float> want = x;
    for (int j = 0; j < 4; ++j) want[1 + j] = r[j], want[7 + j] = 2 * r[j];
    expect_near(o.floats[0], want);
  }
  // mscale multiplies cos and sin: position 0 with mscale 2 doubles the vector.
  Outputs o = run([&](Buffers& b) {
    RopeParams p;
    p.x = b.out("x", std::vector<float>{1, 2, 3, 4});
    p.m = 1, p.token_stride = 4, p.rope_dim = 4, p.mscale = 2.0f;
    p.positions = b.in(std::vector<int32_t>{0});
    p.inv_freq = b.in(std::vector<float>{1.0f, 0.5f});
    b.backend().rope(p);
  });
  expect_near(o.floats[0], {2, 4, 6, 8});
}

// keys k0 = [1, 2], k1 = [3, -1], k2 = [-1, -1]; 2 heads of dim 2.
// row 0: q = [[1, 0], [0, 1]], w = [1, -2], q_pos 1:
//   t0: dots (1, 2) -> 1*1 - 2*2 = -3;  t1: dots (3, -1) -> 3*1 + relu(-1) = 3;  t2 > q_pos: -inf
// row 1: q = [[1, 1], [2, 0]], w = [0.5, 1], q_pos 2:
//   t0: (3, 2) -> 1.5 + 2 = 3.5;  t1: (2, 6) -> 1 + 6 = 7;  t2: (-2, -2) -> 0
// ld_scores 4: column 3 is never written.
TEST_P(Oracle, IndexerScores) {
  Outputs o = run([&](Buffers& b) {
    IndexerScoresParams p;
    p.q = b.in(std::vector<float>{1, 0, 0, 1, 1, 1, 2, 0});
    p.weights = b.in(std::vector<float>{1, -2, 0.5f, 1});
    p.k = b.in(std::vector<float>{1, 2, 3, -1, -1, -1});
    p.q_pos = b.in(std::vector<int32_t>{1, 2});
    p.scores = b.out("scores", 8);
    p.s = 2, p.t = 3, p.n_heads = 2, p.head_dim = 2, p.ld_scores = 4;
    b.backend().indexer_scores(p);
  });
  const auto& s = o.floats[0];
  expect_near({s[0], s[1], s[2], s[4], s[5], s[6]}, {-3, 3, -kInf, 3.5f, 7, 0});
  uint32_t bits3, bits7;
  std::memcpy(&bits3, &s[3], 4);
  std::memcpy(&bits7, &s[7], 4);
  EXPECT_EQ(bits3, kFloatSentinel);
  EXPECT_EQ(bits7, kFloatSentinel);
}

// Largest finite values, ties to the lower index, output ascending, -1 padding.
TEST_P(Oracle, TopkTiesInfNanAndWideK) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  // row 0: finite 3@0, 5@2, 5@3, 1@5 -> top 3 = 5@2, 5@3, 3@0 -> [0, 2, 3]
  // row 1: all equal -> the lowest indices [0, 1, 2]
  // row 2: +inf and -inf are not finite; 1@1 and 0@5 -> [1, 5, -1]
  // row 3: nothing finite -> [-1, -1, -1]
  std::vector<float> s = {3,    -kInf, 5,     5,   nan,   1, 2,     2,     2,   2,    2,     2,
                          kInf, 1,     -kInf, nan, -kInf, 0, -kInf, -kInf, nan, kInf, -kInf, -kInf};
  Outputs o = run([&](Buffers& b) {
    TopkParams p;
    p.scores = b.in(s), p.rows = 4, p.cols = 6, p.ld = 6, p.k = 3;
    p.indices = b.out_i32("indices", 12);
    b.backend().topk(p);
  });
  EXPECT_EQ(o.ints[0], (std::vector<int32_t>{0, 2, 3, 0, 1, 2, 1, 5, -1, -1, -1, -1}));
  // k larger than cols: [7, -inf] with k = 4 -> [0, -1, -1, -1]
  Outputs w = run([&](Buffers& b) {
    TopkParams p;
    p.scores = b.in(std::vector<float>{7, -kInf}), p.rows = 1, p.cols = 2, p.ld = 2, p.k = 4;
    p.indices = b.out_i32("indices", 4);
    b.backend().topk(p);
  });
  EXPECT_EQ(w.ints[0], (std::vector<int32_t>{0, -1, -1, -1}));
}

// 8 experts, sigmoid scores sc = [.5, .9, .25, .75, .9, .1, .1, .8] (logits ln(p / (1 - p))),
// bias [0, -.5, 0, 0, 0, -.1, 1, 0] -> b = [.5, .4, .25, .75, .9, 0, 1.1, .8].
// 4 groups of 2, group score = sum of its top 2: [.9, 1.0, .9, 1.9] -> keep groups 3 and 1.
// Candidates 2 (.25), 3 (.75), 6 (1.1), 7 (.8) -> top 3 by b: 6, 7, 3 -> ids [3, 6, 7].
// Weights from unbiased sc: [.75, .1, .8] / 1.65 * 2.5 = [1.13636364, 0.15151515, 1.21212121].
// (Experts 1 and 4 have the best scores but their groups are dropped -- group 2 by its weak
// second member; expert 6 wins by bias only.)
TEST_P(Oracle, RouterGroupsBiasAndNormalisation) {
  const std::vector<float> logits = {0.0f,        2.19722458f,  -1.09861229f, 1.09861229f,
                                     2.19722458f, -2.19722458f, -2.19722458f, 1.38629436f};
  Outputs o = run([&](Buffers& b) {
    RouterParams p;
    p.logits = b.in(logits);
    p.bias = b.in(std::vector<float>{0, -0.5f, 0, 0, 0, -0.1f, 1.0f, 0});
    p.m = 1, p.n_experts = 8, p.top_k = 3, p.n_group = 4, p.topk_group = 2;
    p.norm_topk_prob = true, p.routed_scaling_factor = 2.5f;
    p.expert_weights = b.out("expert_weights", 3);
    p.expert_ids = b.out_i32("expert_ids", 3);
    b.backend().router(p);
  });
  EXPECT_EQ(o.ints[0], (std::vector<int32_t>{3, 6, 7}));
  expect_near(o.floats[0], {1.13636364f, 0.15151515f, 1.21212121f});
  // All logits 0 (every score .5), no bias, no groups: ties go to the lowest ids; without
  // normalisation the weights are .5 * 2 = 1.
  Outputs t = run([&](Buffers& b) {
    RouterParams p;
    p.logits = b.in(std::vector<float>{0, 0, 0, 0});
    p.m = 1, p.n_experts = 4, p.top_k = 2, p.norm_topk_prob = false, p.routed_scaling_factor = 2.0f;
    p.expert_weights = b.out("expert_weights", 2);
    p.expert_ids = b.out_i32("expert_ids", 2);
    b.backend().router(p);
  });
  EXPECT_EQ(t.ints[0], (std::vector<int32_t>{0, 1}));
  expect_near(t.floats[0], {1.0f, 1.0f});
}

// One head, nope dim 1, rope dim 1, v dim 2, scale 1. Keys: t0 k_nope 1, k_pe 0, v [1, 2];
// t1 k_nope 2, k_pe ln3 - 1, v [3, 4].
// row 0: q [1, 0], q_pos 0 -> only t0 -> [1, 2]
// row 1: q [1, 1], q_pos 1 -> scores 1 and 1 + ln 3 -> softmax [.25, .75] -> [2.5, 3.5]
// row 2: q_pos -1 -> nothing allowed -> zeros (not NaN)
TEST_P(Oracle, MlaPrefillCausalAndMaskedRow) {
  Outputs o = run([&](Buffers& b) {
    MlaPrefillParams p;
    p.q = b.in(std::vector<float>{1, 0, 1, 1, 1, 1});
    p.kv = b.in(std::vector<float>{1, 1, 2, 2, 3, 4});
    p.k_pe = b.in(std::vector<float>{0, 0.09861229f}), p.ld_k_pe = 1;
    p.q_pos = b.in(std::vector<int32_t>{0, 1, -1});
    p.out = b.out("out", 6);
    p.s = 3, p.t = 2, p.n_heads = 1, p.qk_nope_head_dim = 1, p.qk_rope_head_dim = 1;
    p.v_head_dim = 2, p.scale = 1.0f;
    b.backend().mla_prefill(p);
  });
  expect_near(o.floats[0], {1, 2, 2.5f, 3.5f, 0, 0});
}

// Same keys with an indexer selection: row 0 selects [1, 0] but t1 > q_pos 0 -> t0 only;
// row 1 selects [1, -1] -> t1 only -> [3, 4]; row 2 selects nothing -> zeros.
// Also one token alone (s = t = 1).
TEST_P(Oracle, MlaPrefillTopkAndOneToken) {
  Outputs o = run([&](Buffers& b) {
    MlaPrefillParams p;
    p.q = b.in(std::vector<float>{1, 0, 1, 1, 1, 1});
    p.kv = b.in(std::vector<float>{1, 1, 2, 2, 3, 4});
    p.k_pe = b.in(std::vector<float>{0, 0.09861229f}), p.ld_k_pe = 1;
    p.q_pos = b.in(std::vector<int32_t>{0, 1, 1});
    p.topk = b.in(std::vector<int32_t>{1, 0, 1, -1, -1, -1}), p.topk_len = 2;
    p.out = b.out("out", 6);
    p.s = 3, p.t = 2, p.n_heads = 1, p.qk_nope_head_dim = 1, p.qk_rope_head_dim = 1;
    p.v_head_dim = 2, p.scale = 1.0f;
    b.backend().mla_prefill(p);
  });
  expect_near(o.floats[0], {1, 2, 3, 4, 0, 0});
  Outputs one = run([&](Buffers& b) {
    MlaPrefillParams p;
    p.q = b.in(std::vector<float>{5, -3}), p.kv = b.in(std::vector<float>{2, 7, -8});
    p.k_pe = b.in(std::vector<float>{4}), p.ld_k_pe = 1;
    p.q_pos = b.in(std::vector<int32_t>{0});
    p.out = b.out("out", 2);
    p.s = 1, p.t = 1, p.n_heads = 1, p.qk_nope_head_dim = 1, p.qk_rope_head_dim = 1;
    p.v_head_dim = 2, p.scale = 0.7f;
    b.backend().mla_prefill(p);
  });
  expect_near(one.floats[0], {7, -8});  // a single key gets weight 1
}

// Cache rows [c_kv | k_pe]: t0 [1, 2 | 0], t1 [3, 4 | 5]; kv_lora_rank 2, rope 1, scale 1.
// head 0: q_lat 0 -> equal scores -> mean [2, 3]
// head 1: q_lat [1, 0 | 0] -> scores 1, 3 -> softmax [1/(1+e^2), e^2/(1+e^2)] = [.11920292, .88079708]
//         -> [.1192 + 3 * .8808, 2 * .1192 + 4 * .8808] = [2.76159416, 3.76159416]
// row 1: q_pos -1 -> zeros. Then an indexer selection of [-1, 0] -> t0 only -> [1, 2] per head.
TEST_P(Oracle, MlaDecode) {
  Outputs o = run([&](Buffers& b) {
    MlaDecodeParams p;
    p.q_lat = b.in(std::vector<float>{0, 0, 0, 1, 0, 0, 1, 1, 1, 1, 1, 1});
    p.cache = b.in(std::vector<float>{1, 2, 0, 3, 4, 5});
    p.q_pos = b.in(std::vector<int32_t>{1, -1});
    p.out_lat = b.out("out_lat", 8);
    p.s = 2, p.t = 2, p.n_heads = 2, p.kv_lora_rank = 2, p.qk_rope_head_dim = 1, p.scale = 1.0f;
    b.backend().mla_decode(p);
  });
  expect_near(o.floats[0], {2, 3, 2.76159416f, 3.76159416f, 0, 0, 0, 0});
  Outputs t = run([&](Buffers& b) {
    MlaDecodeParams p;
    p.q_lat = b.in(std::vector<float>{9, 9, 9, 1, 2, 3});
    p.cache = b.in(std::vector<float>{1, 2, 0, 3, 4, 5});
    p.q_pos = b.in(std::vector<int32_t>{1});
    p.topk = b.in(std::vector<int32_t>{-1, 0}), p.topk_len = 2;
    p.out_lat = b.out("out_lat", 4);
    p.s = 1, p.t = 2, p.n_heads = 2, p.kv_lora_rank = 2, p.qk_rope_head_dim = 1, p.scale = 1.0f;
    b.backend().mla_decode(p);
  });
  expect_near(t.floats[0], {1, 2, 1, 2});
}

// silu(g) = g / (1 + e^-g): silu(0) = 0, silu(1) = .73105858, silu(-1) = -.26894142.
TEST_P(Oracle, Swiglu) {
  Outputs o = run([&](Buffers& b) {
    SwigluParams p;
    p.gate = b.in(std::vector<float>{0, 1, -1}), p.up = b.in(std::vector<float>{1, 2, 3});
    p.ld_in = 3, p.out = b.out("out", 3), p.ld_out = 3, p.m = 1, p.n = 3;
    b.backend().swiglu(p);
  });
  expect_near(o.floats[0], {0, 1.46211716f, -0.80682426f});
}

TEST_P(Oracle, EmbeddingAllDtypes) {
  for (DType dt : {DType::BF16, DType::F16, DType::F32}) {
    auto table = weight_bytes({1, 2, -7, 3, 4, -7, 5, 6, -7}, dt);  // ld 3, 2 columns used
    Outputs o = run([&](Buffers& b) {
      EmbeddingParams p;
      p.table = Weight{b.in_bytes(table), dt, 3, 2, 3};
      p.ids = b.in(std::vector<int32_t>{2, 0, 2}), p.m = 3;
      p.out = b.out("out", 6);
      b.backend().embedding(p);
    });
    expect_near(o.floats[0], {5, 6, 1, 2, 5, 6});
  }
}

TEST_P(Oracle, GatherRows) {
  Outputs o = run([&](Buffers& b) {
    GatherRowsParams p;
    p.src = b.in(std::vector<float>{1, 2, 3, 4, 5, 6});
    p.rows = b.in(std::vector<int32_t>{2, 2, 0}), p.n = 3, p.d = 2;
    p.dst = b.out("dst", 6);
    b.backend().gather_rows(p);
  });
  expect_near(o.floats[0], {5, 6, 5, 6, 1, 2});
}

// 0.5 * [100, 200] + (slot -1 skipped) + 2 * [1, 2] = [52, 104]; accumulate onto [1, 1].
TEST_P(Oracle, MoeCombine) {
  for (bool acc : {false, true}) {
    Outputs o = run([&](Buffers& b) {
      MoeCombineParams p;
      p.expert_out = b.in(std::vector<float>{1, 2, 10, 20, 100, 200});
      p.slots = b.in(std::vector<int32_t>{2, -1, 0});
      p.weights = b.in(std::vector<float>{0.5f, 9, 2});
      p.out = b.out("out", std::vector<float>{1, 1});
      p.m = 1, p.top_k = 3, p.d = 2, p.accumulate = acc;
      b.backend().moe_combine(p);
    });
    expect_near(o.floats[0], acc ? std::vector<float>{53, 105} : std::vector<float>{52, 104});
  }
}

TEST_P(Oracle, AddAndCopy2d) {
  Outputs o = run([&](Buffers& b) {
    AddParams p;
    p.x = b.in(std::vector<float>{1, 2, 3}), p.y = b.out("y", std::vector<float>{10, 20, 30});
    p.n = 3;
    b.backend().add(p);
  });
  expect_near(o.floats[0], {11, 22, 33});
  // 2 x 2 block from ld 3 into ld 4; the rest of dst keeps its values.
  Outputs c = run([&](Buffers& b) {
    Copy2dParams p;
    p.src = b.in(std::vector<float>{1, 2, 3, 4, 5, 6}), p.ld_src = 3;
    p.dst = b.out("dst", std::vector<float>{0, 0, 0, 0, 0, 0, -1, -1}), p.ld_dst = 4;
    p.rows = 2, p.cols = 2;
    b.backend().copy_2d(p);
  });
  expect_near(c.floats[0], {1, 2, 0, 0, 4, 5, -1, -1});
}

INSTANTIATE_TEST_SUITE_P(Backends, Oracle, ::testing::Values("reference", "cpu"));

}  // namespace
}  // namespace glm5::kernels::test

// The host backends' allocator: 64-byte aligned blocks (from 2 MiB on: 2 MiB aligned, whole 2 MiB
// pages), sizes rounded to 4 classes per power of
// two (at most a quarter wasted), and a freed block handed out again for any size of its class,
// which is what keeps step-to-step row-count changes from faulting in fresh pages.
TEST(HostAllocator, SizeClassesAndReuse) {
  using glm5::kernels::make_cpu_backend;
  using glm5::kernels::make_reference_backend;
  using glm5::kernels::cpu::HostBackend;
  EXPECT_EQ(HostBackend::size_class(1), 64u);
  EXPECT_EQ(HostBackend::size_class(4096), 4096u);
  EXPECT_EQ(HostBackend::size_class(4097), 5120u);
  EXPECT_EQ(HostBackend::size_class(6144), 6144u);
  EXPECT_EQ(HostBackend::size_class(7169), 8192u);
  EXPECT_EQ(HostBackend::size_class((size_t(1) << 20) + 1), (size_t(1) << 20) * 5 / 4);
  for (size_t b = 1; b < (size_t(1) << 26); b = b * 3 / 2 + 1) {
    const size_t c = HostBackend::size_class(b);
    EXPECT_GE(c, b);
    EXPECT_LE(c, std::max<size_t>(b + 63, b + b / 4)) << b;
    EXPECT_EQ(c % 64, 0u) << b;
  }
  for (const char* which : {"reference", "cpu"}) {
    auto be = std::string(which) == "cpu" ? make_cpu_backend() : make_reference_backend();
    void* a = be->alloc(1000 * 1024 + 8);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(a) % 64, 0u);
    be->free(a);
    void* b = be->alloc(1020 * 1024);  // same class (0.875 MiB < size <= 1 MiB): the same block
    EXPECT_EQ(a, b) << which;
    void* c = be->alloc(2000 * 1024);  // another class: a new block
    EXPECT_NE(c, b) << which;
    be->free(b);
    be->free(c);
    EXPECT_EQ(be->alloc(0), nullptr);
    // From 2 MiB (KV pools): on a 2 MiB boundary (where transparent huge pages can back it),
    // writable to its last byte, and reused like any other class.
    const size_t big = (size_t(5) << 20) + 3;
    auto* h = static_cast<uint8_t*>(be->alloc(big));
    EXPECT_EQ(reinterpret_cast<uintptr_t>(h) % HostBackend::kHugeBytes, 0u) << which;
    h[0] = 1, h[big - 1] = 2;
    EXPECT_EQ(h[0] + h[big - 1], 3);
    be->free(h);
    EXPECT_EQ(be->alloc(big + 1000), static_cast<void*>(h)) << which;  // the same class (6 MiB)
    be->free(h);
    EXPECT_EQ(HostBackend::block_size((size_t(2) << 20) + 1), size_t(4) << 20);  // class 2.5 MiB: 2 pages
    EXPECT_EQ(HostBackend::block_size(3 << 20), size_t(4) << 20);
  }
}
