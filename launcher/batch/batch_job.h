// `glm5 batch` and `glm5 tokenize`: JSONL in, JSONL out.
// Batch input lines follow the OpenAI Batch format (custom_id, method, url = /v1/completions or
// /v1/chat/completions, body) or the plain form {"custom_id", "prompt" | "prompt_ids" |
// "messages", ...sampling}. Output records follow the OpenAI Batch output format, one per input
// line, appended and flushed as each request finishes; a rerun skips ids already in the output.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "launcher/cluster/cluster_config.h"
#include "launcher/openai/openai_format.h"
#include "parallel/comm.h"
#include "runtime/engine/engine.h"

namespace glm5::runtime {
class Tokenizer;
struct ModelConfig;
}  // namespace glm5::runtime

namespace glm5::launcher {

struct BatchArgs {
  std::string model, cluster, input, output, report;
  std::string metrics;          // Prometheus text file of the run's counters (empty: none)
  double imbalance_warn = 1.5;  // warn when an MoE layer's busiest EP rank gets this x the mean load
  bool profile = false;         // time the forward pass's phases per layer into the report
  std::string trace;            // Chrome trace JSON of every phase call, one track per rank (implies profile)
  ClusterOverrides overrides;   // --speculative-tokens, --precision
};

// Keys (custom_id or "line:<n>") already answered in an existing output file.
std::vector<std::string> finished_keys(const std::string& output_path);

// run_batch's exit code when a signal stopped it before the end (EX_TEMPFAIL of sysexits.h: try
// again later): the output holds whole records only, and the same command answers the rest.
constexpr int kExitStopped = 75;

int run_batch(const BatchArgs& a, std::unique_ptr<parallel::Comm> world);
// Tokenizes as prompts are tokenized: special tokens written in the text become their ids (as HF
// `tokenizers` encodes them); literal_special keeps them as plain text.
int run_tokenize(const std::string& tokenizer, bool decode, bool literal_special);

}  // namespace glm5::launcher
