// Shared test helpers: load a checkpoint into a one-process model, run requests through the
// engine, read golden safetensors files.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "kernels/cpu/device_like.h"
#include "parallel/comm.h"
#include "parallel/grid.h"
#include "runtime/config.h"
#include "runtime/engine/engine.h"
#include "runtime/model.h"
#include "runtime/safetensors.h"
#include "tests/test_support.h"

namespace glm5::testing {

struct OneProcessModel {
  runtime::ModelConfig cfg;
  std::unique_ptr<runtime::Checkpoint> ckpt;
  std::unique_ptr<kernels::Backend> backend;
  std::unique_ptr<parallel::Comm> world, stage;
  std::unique_ptr<runtime::Model> model;

  enum class Kind { Cpu, Reference, DeviceLike };
  explicit OneProcessModel(const std::string& dir, bool reference_backend = false)
      : OneProcessModel(dir, reference_backend ? Kind::Reference : Kind::Cpu) {}
  OneProcessModel(const std::string& dir, Kind kind)
      : OneProcessModel(dir, kind, kernels::parse_precision(test_precision(), "GLM5_TEST_PRECISION")) {}
  OneProcessModel(const std::string& dir, Kind kind, kernels::Precision precision) {
    cfg = runtime::load_config(dir);
    ckpt = std::make_unique<runtime::Checkpoint>(dir);
    backend = kind == Kind::Reference    ? kernels::make_reference_backend(precision)
              : kind == Kind::DeviceLike ? kernels::make_device_like_backend(precision)
                                         : kernels::make_cpu_backend(precision);
    world = parallel::make_self_comm();
    stage = parallel::make_self_comm();
    model = std::make_unique<runtime::Model>(cfg, *ckpt, *backend, runtime::ModelShard{}, *stage);
  }

  // Runs the requests through the engine (one process) and returns results by request index.
  std::map<int64_t, runtime::Result> run(const std::vector<runtime::Request>& reqs, runtime::EngineOptions opt = {}) {
    runtime::Engine engine(*model, *world, *stage, parallel::Grid{1, 1}, opt);
    std::map<int64_t, runtime::Result> out;
    engine.run(reqs, [&](runtime::Result&& r) { out[r.index] = std::move(r); });
    last_stats = engine.stats();
    return out;
  }
  runtime::EngineStats last_stats;  // of the latest run()
};

// The golden convention of tests/data/tiny-a: greedy, N tokens, EOS ignored, all logits.
inline runtime::Request golden_request(const std::vector<int32_t>& prompt, int n, int64_t index = 0) {
  runtime::Request r;
  r.index = index;
  r.prompt = prompt;
  r.sampling.temperature = 0.0f;
  r.sampling.max_tokens = n;
  r.sampling.ignore_eos = true;
  r.want_prompt_logits = r.want_logits = r.extra_final_step = true;
  return r;
}

struct Golden {
  std::unique_ptr<runtime::SafetensorsFile> file;
  explicit Golden(const std::string& path) : file(std::make_unique<runtime::SafetensorsFile>(path)) {}
  template <typename T>
  std::vector<T> get(const std::string& name) const {
    const runtime::TensorInfo* t = file->find(name);
    if (!t) throw std::runtime_error("golden tensor missing: " + name);
    std::vector<T> v(t->nbytes / sizeof(T));
    std::memcpy(v.data(), t->data, t->nbytes);
    return v;
  }
  std::vector<int64_t> shape(const std::string& name) const { return file->find(name)->shape; }
};

inline float max_abs_diff(const std::vector<float>& a, const std::vector<float>& b) {
  EXPECT_EQ(a.size(), b.size());
  float m = 0;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) m = std::max(m, std::fabs(a[i] - b[i]));
  return m;
}

}  // namespace glm5::testing
