#pragma once

#include <cstdint>
#include <map>
#include <vector>

#include "kernels/core/check.h"
#include "runtime/kv_cache.h"
#include "runtime/model.h"
#include "runtime/request.h"
#include "runtime/scheduler.h"

namespace glm5::runtime {

// The state a stage keeps per running sequence: its request (from the step that first carries
// it), its KV block table (grown by the steps) and, on the last stage, the tokens it has sampled
// (penalties and the sampling step).
class SeqTable {
 public:
  explicit SeqTable(int64_t num_blocks) : num_blocks_(num_blocks) {}
  // Applies a step's releases, additions and new blocks, then returns its batch for Model::forward.
  std::vector<SeqStep> enter(const Step& step) {
    for (int64_t r : step.released) seqs_.erase(r);
    for (const Request& r : step.added) {
      Entry e;
      e.req = r;
      e.generated = r.generated;
      CHECK(seqs_.emplace(r.index, std::move(e)).second, "internal: request ", r.index, " added twice");
    }
    std::vector<SeqStep> batch;
    size_t at = 0;
    for (auto& s : step.seqs) {
      Entry& e = this->at(s.req);
      CHECK(at + size_t(s.new_blocks) <= step.blocks.size(), "internal: step lists too few KV blocks");
      for (int64_t i = 0; i < s.new_blocks; ++i) {
        const int32_t b = step.blocks[at + size_t(i)];
        CHECK(b >= 0 && b < num_blocks_, "internal: KV block ", b, " outside the pool of ", num_blocks_, " blocks");
        e.blocks.push_back(b);
      }
      at += size_t(s.new_blocks);
      CHECK(int64_t(e.blocks.size()) >= blocks_for(s.start + s.n), "internal: request ", s.req, " has KV blocks for ",
            e.blocks.size() * size_t(kBlockTokens), " positions, the step needs ", s.start + s.n);
    }
    for (auto& s : step.seqs) {
      Entry& e = this->at(s.req);
      batch.push_back({e.blocks.data(), s.start, s.n, int64_t(e.req.prompt.size())});
    }
    return batch;
  }
  struct Entry {
    Request req;
    std::vector<int32_t> blocks;
    std::vector<int32_t> generated;
    std::vector<int32_t> drafts;  // last stage: the drafts it proposed for the next step
    // The token at position p: the prompt's, then the generated ones (last stage).
    int32_t token_at(int64_t p) const {
      const int64_t P = int64_t(req.prompt.size());
      return p < P ? req.prompt[size_t(p)] : generated[size_t(p - P)];
    }
  };
  Entry& at(int64_t req) {
    auto it = seqs_.find(req);
    CHECK(it != seqs_.end(), "internal: step names request ", req, ", which this stage does not hold");
    return it->second;
  }

 private:
  std::map<int64_t, Entry> seqs_;
  int64_t num_blocks_;
};

}  // namespace glm5::runtime
