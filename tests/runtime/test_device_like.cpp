// The model and engine on the device-like backend (kernels/cpu/device_like.h): device memory
// rules on any machine. Results must be bitwise those of the cpu backend (same kernels), the
// host must see only control bytes (token ids, positions, block tables, expert ids, the sampled
// logits), a warm step must make no raw allocation, and a decode step must make the same number
// of backend calls whatever its batch size.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstring>

#include "tests/runtime/model_fixture.h"

namespace glm5::testing {
namespace {

using Kind = OneProcessModel::Kind;

const kernels::DeviceLikeCounters& counters(const OneProcessModel& m) {
  return *kernels::device_like_counters(*m.backend);
}

void expect_bitwise_cpu(const std::string& name) {
  const std::string dir = std::string(GLM5_TEST_DATA) + "/" + name;
  Golden g(dir + "/golden.safetensors");
  const auto prompt = g.get<int32_t>("prompt_ids");
  const int n = int(g.get<int32_t>("decode_tokens").size());
  OneProcessModel cpu(dir, Kind::Cpu), dev(dir, Kind::DeviceLike);
  ASSERT_FALSE(dev.backend->host_memory());
  auto a = cpu.run({golden_request(prompt, n)}), b = dev.run({golden_request(prompt, n)});
  ASSERT_TRUE(b[0].error.empty()) << b[0].error;
  EXPECT_EQ(b[0].tokens, a[0].tokens);
  ASSERT_EQ(b[0].prompt_logits.size(), a[0].prompt_logits.size());
  ASSERT_EQ(b[0].decode_logits.size(), a[0].decode_logits.size());
  EXPECT_EQ(std::memcmp(b[0].prompt_logits.data(), a[0].prompt_logits.data(), a[0].prompt_logits.size() * 4), 0);
  EXPECT_EQ(std::memcmp(b[0].decode_logits.data(), a[0].decode_logits.data(), a[0].decode_logits.size() * 4), 0);
  if (dev.backend->precision() == kernels::Precision::kExact) {
    EXPECT_LT(max_abs_diff(b[0].decode_logits, g.get<float>("decode_logits")), 1e-4f);
  }
}

TEST(DeviceLike, TinyABitwiseEqualToCpu) { expect_bitwise_cpu("tiny-a"); }
TEST(DeviceLike, TinyBBitwiseEqualToCpu) { expect_bitwise_cpu("tiny-b"); }
TEST(DeviceLike, TinyV32BitwiseEqualToCpu) { expect_bitwise_cpu("tiny-v32"); }

// One decode step of `seqs` sequences (sequence i at position base + 3 i, prefilled first) on a
// fresh model; returns what the step alone did.
struct StepCost {
  uint64_t op_calls = 0, to_host = 0, to_device = 0, raw_allocs = 0;
};
struct DecodeRig {
  OneProcessModel m;
  runtime::KvPool pool;
  std::vector<std::vector<int32_t>> tables;
  std::vector<int64_t> pos;
  DecodeRig(int seqs, int64_t base)
      : m(std::string(GLM5_TEST_DATA) + "/tiny-a", Kind::DeviceLike),
        pool(*m.backend, m.cfg, 0, int(m.cfg.num_hidden_layers), seqs * runtime::blocks_for(base + 3 * seqs + 8)) {
    m.model->set_kv_pool(&pool);
    const int64_t per = runtime::blocks_for(base + 3 * seqs + 8);
    for (int i = 0; i < seqs; ++i) {
      tables.emplace_back(static_cast<size_t>(per));
      for (int64_t b = 0; b < per; ++b) tables.back()[size_t(b)] = int32_t(i * per + b);
      pos.push_back(base + 3 * i);
      forward({{tables.back().data(), 0, pos.back(), pos.back()}}, pos.back());  // the prompt
    }
  }
  // Runs the step's rows (ids 1, 2, ...) through embed + forward.
  void forward(const std::vector<runtime::SeqStep>& batch, int64_t rows) {
    kernels::Backend& be = *m.backend;
    std::vector<int32_t> ids(static_cast<size_t>(rows));
    for (int64_t i = 0; i < rows; ++i) ids[size_t(i)] = int32_t(1 + i % 50);
    float* h = static_cast<float*>(be.alloc(size_t(rows * m.cfg.hidden_size) * sizeof(float)));
    m.model->embed(ids.data(), rows, h);
    m.model->forward(batch, h);
    be.free(h);
  }
  StepCost decode() {
    std::vector<runtime::SeqStep> batch;
    for (size_t i = 0; i < tables.size(); ++i) batch.push_back({tables[i].data(), pos[i], 1, pos[i]});
    const kernels::DeviceLikeCounters before = counters(m);
    forward(batch, int64_t(batch.size()));
    const kernels::DeviceLikeCounters& after = counters(m);
    return {after.op_calls - before.op_calls, after.to_host_bytes - before.to_host_bytes,
            after.to_device_bytes - before.to_device_bytes, after.raw_allocs - before.raw_allocs};
  }
};

TEST(DeviceLike, DecodeCallsPerStepDoNotDependOnTheBatchSize) {
  // Every sequence past index_topk (16): the indexer and top-k run for all rows of the step.
  DecodeRig one(1, 40), eight(8, 40);
  const StepCost a = one.decode(), b = eight.decode();
  EXPECT_GT(a.op_calls, 0u);
  EXPECT_EQ(a.op_calls, b.op_calls) << "backend calls of one decode step: batch 1 vs batch 8";
}

TEST(DeviceLike, AWarmStepMakesNoRawAllocationAndReadsBackOnlyExpertIds) {
  DecodeRig rig(4, 40);
  rig.decode();  // warm: the step's scratch sizes enter the cache
  for (int i = 0; i < 5; ++i) {
    // The same step again (same positions: the cache rows are rewritten with the same values).
    const StepCost c = rig.decode();
    EXPECT_EQ(c.raw_allocs, 0u) << "repeat " << i;
    // Read back: each MoE layer's expert ids (the exchange's plan), nothing else.
    int64_t moe_layers = 0;
    for (int l = 0; l < rig.m.cfg.num_hidden_layers; ++l) moe_layers += rig.m.cfg.is_moe_layer(l);
    EXPECT_EQ(c.to_host, uint64_t(moe_layers * 4 * rig.m.cfg.num_experts_per_tok) * sizeof(int32_t));
    // Sent down: ids, positions, block tables and the exchange's index arrays, all int32 and far
    // less than one activation row per layer.
    EXPECT_LT(c.to_device, uint64_t(4 * rig.m.cfg.hidden_size) * sizeof(float));
  }
}

TEST(DeviceLike, HostPointersGivenToOpsAreRefused) {
  OneProcessModel m(std::string(GLM5_TEST_DATA) + "/tiny-a", Kind::DeviceLike);
  std::vector<float> host(64, 1.0f);
  float* dev = static_cast<float*>(m.backend->alloc(64 * sizeof(float)));
  try {
    m.backend->add({host.data(), dev, 64});
    ADD_FAILURE() << "add() with a host operand did not throw";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("add x is host memory"), std::string::npos) << e.what();
  }
  EXPECT_THROW(m.backend->to_device(host.data(), dev, 64), Error);  // directions swapped
  m.backend->free(dev);
}

TEST(DeviceLikeDeathTest, HostCodeReadingDeviceMemoryFaults) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  OneProcessModel m(std::string(GLM5_TEST_DATA) + "/tiny-a", Kind::DeviceLike);
  float* dev = static_cast<float*>(m.backend->alloc(64 * sizeof(float)));
  EXPECT_DEATH({ std::fprintf(stderr, "%f\n", double(*static_cast<volatile float*>(dev))); }, "");
  m.backend->free(dev);
}

}  // namespace
}  // namespace glm5::testing
