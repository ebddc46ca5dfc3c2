// glm5 subcommands. Each builds a Job (communicators, model shard, engine) and feeds it requests;
// rank 0 reads inputs and writes outputs.
#include "launcher/cli/commands.h"

#include <omp.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <thread>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "kernels/core/check.h"
#include "kernels/cpu/device_like.h"
#include "launcher/batch/batch_job.h"
#include "launcher/cluster/gpu_binding.h"
#include "launcher/convert/convert.h"
#include "launcher/inspect/inspect.h"
#include "launcher/launch/launch.h"
#include "launcher/perplexity/perplexity.h"
#include "launcher/report/report.h"
#include "launcher/serve/serve.h"
#include "launcher/simulate/simulate.h"
#include "parallel/device_comm.h"
#include "parallel/mpi_comm.h"
#include "parallel/nccl_comm.h"
#include "runtime/name_table.h"
#include "runtime/tokenizer/tokenizer.h"

namespace glm5::launcher {

using json = nlohmann::json;

namespace {

// The communicators that move device memory (host backends need none: MPI moves their memory),
// made only where bytes move: the hidden states when there are several stages (one communicator
// over the world: hops go between (stage s, column c) and (s + 1, c), addressed by world rank), the
// MoE payload when a stage has several columns. comm: nccl gives NCCL communicators bootstrapped
// over MPI and ordered on the backend's stream (backend cpu-devicelike: its stand-in); comm: mpi
// stages device memory through the host around MPI. Without one, the model and engine fall back
// to staging over the host communicator (never used: nothing moves there).
void make_payload_comms(Job& job, int device) {
  kernels::Backend& be = *job.backend;
  if (be.host_memory()) return;
  const bool hops = job.cluster.stages > 1, moe = job.cluster.expert_parallel > 1;
  auto make = [&](parallel::Comm& host) -> std::unique_ptr<parallel::Comm> {
    if (job.cluster.comm != "nccl") return parallel::make_staged_comm(host, be);
    if (job.cluster.backend == "cpu-devicelike") return parallel::make_device_like_comm(host);
#ifdef GLM5_HAVE_CUDA
    return parallel::make_nccl_comm(host, device, be.stream());
#else
    (void)device;
    GLM5_FAIL("cluster config ", job.cluster.source, ": comm nccl needs a build with CUDA and NCCL");
#endif
  };
  if (hops) job.hidden = make(*job.world);
  if (moe) job.moe_payload = make(*job.stage_comm);
}

// Ranks on hosts with and without AMX would run BF16 gemms on different paths: each within
// rounding of the reference, but the run no longer bitwise the single process. Rank 0 says so.
void warn_on_mixed_gemm_paths(parallel::Comm& world, bool fast) {
  // (a bad GLM5_CPU_GEMM / GLM5_CPU_FAST_GEMM fails here)
  const std::string mine = kernels::cpu_gemm_path(fast ? kernels::Precision::kFast : kernels::Precision::kExact);
  char my[16] = {};
  std::snprintf(my, sizeof my, "%s", mine.c_str());
  std::vector<char> all(sizeof my * size_t(world.size()));
  world.all_gather(my, sizeof my, all.data());
  std::string paths;
  bool mixed = false;
  for (int r = 0; r < world.size(); ++r) {
    const std::string p(&all[sizeof my * size_t(r)]);
    mixed |= p != mine;
    paths += (r ? ", " : "") + std::string("rank ") + std::to_string(r) + " " + p;
  }
  if (mixed && world.rank() == 0)
    std::fprintf(stderr,
                 "glm5: warning: ranks run different %s gemm paths (%s): results agree to rounding, not bitwise; %s\n",
                 fast ? "precision fast" : "BF16", paths.c_str(),
                 fast ? "set GLM5_CPU_FAST_GEMM=portable (or another path all hosts have) on every host (mpirun -x "
                        "GLM5_CPU_FAST_GEMM)"
                      : "set GLM5_CPU_GEMM=fp32 (or amx) on every host (mpirun -x GLM5_CPU_GEMM)");
}

}  // namespace

std::unique_ptr<Job> make_job(const std::string& model_dir, const std::string& cluster_file,
                              std::unique_ptr<parallel::Comm> world, bool progress, const ClusterOverrides& overrides) {
  auto job = std::make_unique<Job>();
  job->world = std::move(world);
  job->cluster = cluster_file.empty() ? default_cluster_config() : load_cluster_config(cluster_file);
  overrides.apply(job->cluster);
  job->config = runtime::load_config(model_dir);
  // The MTP layer drafts with its own indexer; whether GLM-5.2's draft steps 2..k share step 1's top-k
  // (index_share_for_mtp_iteration) is not published, so one draft step only there.
  const int64_t mtp_layer = job->config.num_hidden_layers;
  CHECK(job->cluster.speculative_tokens == 0 || job->config.has_indexer(mtp_layer), model_dir, "/config.json: ",
        int64_t(job->config.indexer_full.size()) > mtp_layer
            ? "indexer_types entry " + std::to_string(mtp_layer) + " makes the MTP layer \"shared\""
            : std::string("index_share_for_mtp_iteration leaves the MTP layer no indexer"),
        ", which speculative decoding does not run yet: set speculative_tokens to 0");
  CHECK(
      job->cluster.speculative_tokens <= 1 || !job->config.index_share_for_mtp_iteration, model_dir,
      "/config.json sets index_share_for_mtp_iteration (GLM-5.2: the MTP layer's draft steps may share top-k indices, "
      "which glm5 does not run yet): speculative_tokens must be 0 or 1, found ",
      job->cluster.speculative_tokens);
  job->stages = plan_stages(job->cluster, job->config, job->world->size());
  const parallel::Grid grid = job->cluster.grid();
  const int rank = job->world->rank(), stage = grid.stage_of(rank), column = grid.column_of(rank);

  CHECK(job->cluster.backend != "cuda" || job->cluster.kv_budget_gb > 0, "cluster config ", job->cluster.source,
        ": backend cuda needs kv_budget_gb (the paged KV pool is allocated in device memory up front)");
  const int device = job->cluster.backend == "cuda" ? cuda_device_for_this_rank() : -1;
  const kernels::Precision precision = kernels::parse_precision(job->cluster.precision, "precision");
  job->backend = job->cluster.backend == "cuda"             ? kernels::make_cuda_backend(device, precision)
                 : job->cluster.backend == "cpu-devicelike" ? kernels::make_device_like_backend(precision)
                                                            : kernels::make_cpu_backend(precision);
  if (job->cluster.backend != "cuda") warn_on_mixed_gemm_paths(*job->world, precision == kernels::Precision::kFast);
  job->checkpoint = std::make_unique<runtime::Checkpoint>(model_dir);
  if (rank == 0) {
    runtime::check_checkpoint(*job->checkpoint, job->config);
    if (progress && !job->config.ignored_fields.empty()) {  // said once, by name (runtime/spec/glm5.md §1.6)
      std::string names;
      for (const std::string& f : job->config.ignored_fields) names += (names.empty() ? "" : ", ") + f;
      std::fprintf(stderr, "glm5: %s: fields that do not change the result, ignored: %s\n", job->config.source.c_str(),
                   names.c_str());
    }
  }
  parallel::set_watchdog_seconds(0);  // armed by start_watchdog once every rank is ready
  job->stage_comm = job->world->split(stage, column);
  make_payload_comms(*job, device);

  const runtime::ModelShard shard = rank_shard(job->cluster, job->stages, rank);
  job->model = std::make_unique<runtime::Model>(job->config, *job->checkpoint, *job->backend, shard, *job->stage_comm,
                                                job->moe_payload.get());
  runtime::EngineOptions opt;
  opt.policy() = job->cluster.policy();
  opt.kv_budget_bytes = job->cluster.kv_budget_gb * 1e9;
  opt.kv_dtype = job->cluster.kv_cache_dtype();
  opt.kv_bytes_per_token = kv_bytes_per_token(job->cluster, job->config, job->stages);
  opt.progress = progress;
  job->engine =
      std::make_unique<runtime::Engine>(*job->model, *job->world, *job->stage_comm, grid, opt, job->hidden.get());
  return job;
}

void Job::start_watchdog() {
  parallel::set_watchdog_seconds(0);
  world->barrier();
  parallel::set_watchdog_seconds(cluster.watchdog_s);
}

namespace {

// The cluster-config overrides a running command takes (speculation only where it decodes).
void add_override_options(CLI::App* cmd, ClusterOverrides& o, bool decodes) {
  if (decodes)
    cmd->add_option(
        "--speculative-tokens", o.speculative_tokens,
        "MTP draft tokens per decode step, 0..8 (0: off; replaces the cluster config's speculative_tokens)");
  cmd->add_option("--precision", o.precision,
                  "exact | fast: fast rounds every gemm's inputs to bf16 (replaces the cluster config's precision)");
}

std::vector<int32_t> parse_ids(const std::string& s) {
  std::vector<int32_t> ids;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) {
    size_t used = 0;
    long v = 0;
    try {
      v = std::stol(item, &used);
    } catch (...) {
      used = 0;
    }
    CHECK(!item.empty() && used == item.size() && v >= 0 && v <= INT32_MAX,
          "--prompt-ids: expected comma-separated non-negative integers, found '", item, "'");
    ids.push_back(int32_t(v));
  }
  return ids;
}

struct GenerateArgs {
  std::string model, cluster, prompt, prompt_ids, dump_logits;
  int max_new_tokens = 16;
  float temperature = 1.0f, top_p = 1.0f;
  int top_k = 0;
  uint64_t seed = 0;
  bool ignore_eos = false;
  ClusterOverrides overrides;
};

int run_generate(const GenerateArgs& a, std::unique_ptr<parallel::Comm> world) {
  auto job = make_job(a.model, a.cluster, std::move(world), false, a.overrides);
  const bool root = job->rank() == 0;
  std::vector<runtime::Request> reqs;
  const std::unique_ptr<runtime::Tokenizer> tok = runtime::Tokenizer::load_if_present(a.model);
  if (root) {
    runtime::Request r;
    CHECK(a.prompt.empty() != a.prompt_ids.empty(), "give exactly one of --prompt and --prompt-ids");
    if (!a.prompt_ids.empty()) {
      r.prompt = parse_ids(a.prompt_ids);
      for (int32_t id : r.prompt)
        CHECK(id < job->config.vocab_size, "--prompt-ids: token id ", id, " is outside the vocabulary [0, ",
              job->config.vocab_size, ") of ", job->config.source);
    } else {
      CHECK(tok, "--prompt needs a tokenizer, but ", a.model, "/tokenizer.json does not exist; use --prompt-ids");
      r.prompt = tok->encode(a.prompt);
    }
    CHECK(!r.prompt.empty(), "the prompt is empty");
    r.sampling.max_tokens = a.max_new_tokens;
    r.sampling.temperature = a.temperature;
    r.sampling.top_p = a.top_p;
    r.sampling.top_k = a.top_k;
    r.sampling.seed = a.seed;
    r.sampling.ignore_eos = a.ignore_eos;
    r.sampling.validate();
    if (!a.dump_logits.empty()) {
      // The dump has a fixed shape (N = max-new-tokens rows), so EOS does not end it early.
      r.sampling.ignore_eos = true;
      r.want_prompt_logits = r.want_logits = r.extra_final_step = true;
    }
    reqs.push_back(std::move(r));
  }
  runtime::Result result;
  bool got = false;
  job->engine->set_tokenizer(tok.get());
  job->start_watchdog();
  job->engine->run(reqs, [&](runtime::Result&& r) {
    result = std::move(r);
    got = true;
  });
  if (!root) return 0;
  CHECK(got, "internal: no result for the request");
  CHECK(result.error.empty(), result.error);
  if (!a.dump_logits.empty()) {
    const int64_t V = job->config.vocab_size, P = int64_t(reqs[0].prompt.size());
    const int64_t N = int64_t(result.tokens.size());
    CHECK(int64_t(result.prompt_logits.size()) == P * V && int64_t(result.decode_logits.size()) == N * V,
          "internal: logits dump has the wrong size");
    runtime::write_safetensors(a.dump_logits, {{"prefill_logits", DType::F32, {P, V}, result.prompt_logits.data()},
                                               {"decode_tokens", DType::I32, {N}, result.tokens.data()},
                                               {"decode_logits", DType::F32, {N, V}, result.decode_logits.data()}});
  }
  json out = {{"token_ids", result.tokens}, {"finish_reason", result.finish_reason}};
  if (tok) out["text"] = tok->decode(result.tokens, true);
  std::cout << out.dump(-1, ' ', false, json::error_handler_t::replace) << std::endl;
  return 0;
}

}  // namespace

// Threads per rank when OMP_NUM_THREADS is not set: the cores divided among the ranks that
// mpirun placed on this host, so that ranks do not fight over cores (OpenMP barriers stall badly
// when their threads are descheduled).
static void default_threads() {
  if (std::getenv("OMP_NUM_THREADS")) return;
  int local = 1;
  if (const char* s = std::getenv("OMPI_COMM_WORLD_LOCAL_SIZE")) local = std::max(1, std::atoi(s));
  const int cores = std::max(1, int(std::thread::hardware_concurrency()));
  omp_set_num_threads(std::max(1, cores / local));
}

// Whether a run with this cluster config needs MPI: under mpirun (or another launcher), or for a
// config of more than one rank. A one-rank config started by hand (backend: cuda on one GPU, say)
// runs on a self communicator, so it needs no MPI runtime installed.
static bool launched_distributed(const std::string& cluster_file) {
  for (const char* v : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "SLURM_PROCID"})
    if (std::getenv(v)) return true;
  return load_cluster_config(cluster_file).world_size() > 1;
}

namespace {

// `glm5 generate`: one prompt completed.
CLI::App* add_generate(CLI::App& app, GenerateArgs& a) {
  CLI::App* c = app.add_subcommand("generate", "complete one prompt");
  c->add_option("--model", a.model, "model directory (HF layout)")->required();
  c->add_option("--cluster", a.cluster, "cluster config YAML (run under mpirun)");
  c->add_option("--prompt", a.prompt, "prompt text (needs tokenizer.json in the model dir)");
  c->add_option("--prompt-ids", a.prompt_ids, "prompt token ids, comma-separated");
  c->add_option("--max-new-tokens", a.max_new_tokens, "tokens to generate")->capture_default_str();
  c->add_option("--temperature", a.temperature, "0 = greedy")->capture_default_str();
  c->add_option("--top-p", a.top_p)->capture_default_str();
  c->add_option("--top-k", a.top_k)->capture_default_str();
  c->add_option("--seed", a.seed)->capture_default_str();
  c->add_flag("--ignore-eos", a.ignore_eos, "do not stop at the config's eos ids");
  add_override_options(c, a.overrides, true);
  c->add_option("--dump-logits", a.dump_logits,
                "write prefill_logits, decode_tokens, decode_logits to this safetensors file");
  return c;
}

// `glm5 batch`: a JSONL file of requests.
CLI::App* add_batch(CLI::App& app, BatchArgs& a) {
  CLI::App* c = app.add_subcommand("batch", "run a JSONL file of requests (OpenAI Batch format)");
  c->add_option("--model", a.model)->required();
  c->add_option("--cluster", a.cluster);
  c->add_option("--input", a.input)->required();
  c->add_option("--output", a.output)->required();
  c->add_option("--report", a.report, "write per-rank timing/traffic report JSON (with MoE routing health)");
  add_override_options(c, a.overrides, true);
  c->add_option("--metrics", a.metrics, "write the run's counters as a Prometheus text file");
  c->add_flag("--profile", a.profile, "time the forward pass's phases per layer on every rank (into --report)");
  c->add_option(
      "--trace", a.trace,
      "write the phase calls as a Chrome trace (opens in Perfetto; the first 2^19 per rank); implies --profile");
  c->add_option("--imbalance-warn", a.imbalance_warn,
                "warn when an MoE layer's busiest expert-parallel rank gets more than this x the mean load")
      ->capture_default_str()
      ->check(CLI::Range(1.0, 1e9));
  return c;
}

// `glm5 perplexity`: a text file's perplexity, KL divergence against a base run.
CLI::App* add_perplexity(CLI::App& app, PerplexityArgs& a) {
  CLI::App* c = app.add_subcommand(
      "perplexity", "perplexity of a text file (llama-perplexity windows), KL divergence against a base run");
  c->add_option("--model", a.model)->required();
  c->add_option("--cluster", a.cluster, "cluster config YAML (run under mpirun)");
  c->add_option("--file", a.file, "the text (tokenized whole, no special tokens)")->required();
  c->add_option("--ctx", a.ctx, "tokens per window")->capture_default_str();
  c->add_option("--stride", a.stride,
                "tokens between window starts (default --ctx); each window scores its last min(stride, ctx/2)");
  c->add_option("--chunks", a.chunks, "score only the first N windows (0: all)")->capture_default_str();
  auto* save = c->add_option("--save-logits", a.save_logits,
                             "write the scored rows' log-softmax (F32 safetensors) for --kl-base");
  c->add_option("--kl-base", a.kl_base,
                "a --save-logits file of a base run: KL divergence and top-1 agreement against it")
      ->excludes(save);
  c->add_flag("--json", a.json, "print one JSON object instead of the table");
  add_override_options(c, a.overrides, false);
  return c;
}

// `glm5 inspect`: the config and per-rank memory plan.
CLI::App* add_inspect(CLI::App& app, InspectArgs& a) {
  CLI::App* c = app.add_subcommand("inspect", "config summary and per-rank memory plan");
  c->add_option("--model", a.model, "model directory (config.json; model.safetensors.index.json if present)")
      ->required();
  c->add_option("--cluster", a.cluster, "cluster config YAML");
  auto* quant = c->add_option("--quant", a.quant,
                              "plan the checkpoint as `glm5 convert --quant` would write it: int4 | int8 | "
                              "fp8 | bf16 | f32");
  c->add_option("--group-size", a.group_size, "int4 / int8: columns per scale (32, 64, 128)")
      ->capture_default_str()
      ->needs(quant);
  c->add_option("--scale-dtype", a.scale_dtype, "int4 / int8 scales: bf16 (default) | f32")->needs(quant);
  c->add_option("--quantize", a.quantize,
                "roles --quant applies to, comma list of experts, shared, dense, attention, indexer, lm_head, all "
                "(default experts,shared)")
      ->needs(quant);
  return c;
}

// `glm5 convert`: a checkpoint rewritten in another storage format.
CLI::App* add_convert(CLI::App& app, ConvertArgs& a) {
  CLI::App* c =
      app.add_subcommand("convert", "rewrite a checkpoint as int4 / int8 / fp8 / bf16 / f32, tensor by tensor");
  c->add_option("--model", a.model, "input checkpoint (BF16, FP8 or pack-quantized)")->required();
  c->add_option("--out", a.out, "output directory (created; a rerun resumes an interrupted conversion)")->required();
  c->add_option("--quant", a.quant, "int4 | int8 | fp8 | bf16 | f32")->capture_default_str();
  c->add_option("--group-size", a.group_size, "int4 / int8: columns per scale (32, 64, 128)")->capture_default_str();
  c->add_option("--scale-dtype", a.scale_dtype,
                "int4 / int8 scales: bf16 (the default; llm-compressor's bytes) | f32 (2 more bytes per group; "
                "weights q * scale need no rounding, so int8 decodes faster on CPUs: BENCHMARKS.md). Without "
                "it, int tensors already in the target format and group keep their scales");
  c->add_option("--quantize", a.quantize,
                "roles to quantize, comma list of experts, shared, dense, attention, indexer, lm_head, all "
                "(default experts,shared)");
  c->add_option("--cluster", a.cluster, "write one file set per rank of this cluster config");
  c->add_option("--shard-size-mb", a.shard_size_mb, "largest output file")->capture_default_str();
  c->add_flag_callback(
      "--no-progress", [progress = &a.progress] { *progress = false; }, "no progress bar on stderr");
  return c;
}

// `glm5 simulate`: the analytic model of a run.
CLI::App* add_simulate(CLI::App& app, SimulateArgs& a) {
  CLI::App* c =
      app.add_subcommand("simulate", "predict tokens/s, utilisation and the bottleneck of a layout (analytic model)");
  c->add_option("--model", a.model, "model directory or config.json (required unless --calibrate)");
  auto* cluster = c->add_option("--cluster", a.cluster, "cluster config YAML");
  c->add_option("--workload", a.workload, "prompts=N,in=TOKENS,out=TOKENS[,prefix=TOKENS]");
  c->add_option("--hardware", a.hardware,
                "hardware YAML (cluster-configs/hardware/); required for backend cuda; for cpu, without it this CPU is "
                "calibrated first (~20 s)");
  c->add_option("--routing", a.routing, "a batch --report JSON whose per-layer expert loads replace uniform routing");
  c->add_option("--json", a.json, "also write the prediction as JSON");
  c->add_option("--exchange-bytes", a.exchange_bytes,
                "what-if: bytes per value the MoE exchange moves (glm5 sends 4, f32; 2 = bf16, 1 = fp8)")
      ->check(CLI::Range(0.5, 8.0));
  c->add_option("--acceptance", a.acceptance,
                "speculative decoding (cluster speculative_tokens k): fractions of verify steps whose drafts 1..j "
                "were all accepted, j = 1..k, e.g. 0.86,0.66,0.52 (a report's spec_accepted_at / spec_verify_steps "
                "reads low where steps verified fewer than k drafts, near max_tokens)");
  c->add_flag("--published-kernels", a.published_kernels,
              "what-if: the hardware file's published-kernel efficiencies (FlashMLA, DeepGEMM) instead of glm5's "
              "measured ones");
  c->add_flag("--overlap", a.overlap, "what-if: MoE exchange hidden behind compute (two micro-batches alternating)");
  auto* calibrate = c->add_flag("--calibrate", a.calibrate, "measure this machine and write a hardware file (--out)");
  c->add_option("--out", a.out, "with --calibrate: the hardware YAML to write (with --model: its expert shape)")
      ->needs(calibrate);
  calibrate->excludes(cluster);
  return c;
}

// `glm5 serve`: the OpenAI API over HTTP.
CLI::App* add_serve(CLI::App& app, ServeArgs& a) {
  CLI::App* c = app.add_subcommand("serve", "serve the OpenAI API (completions, chat, streaming) over HTTP on rank 0");
  c->add_option("--model", a.model, "model directory (HF layout)")->required();
  c->add_option("--cluster", a.cluster, "cluster config YAML (run under mpirun)");
  c->add_option("--host", a.host, "address to listen on (0.0.0.0: every interface)")->capture_default_str();
  c->add_option("--port", a.port, "TCP port; 0 picks a free one (printed on stderr)")
      ->capture_default_str()
      ->check(CLI::Range(0, 65535));
  c->add_option("--api-key", a.api_key, "require 'Authorization: Bearer KEY' on every endpoint but /health");
  c->add_option("--served-model-name", a.model_name, "the model id clients use (default: the model directory's name)");
  c->add_option("--max-queue", a.max_queue, "requests waiting for the engine beyond which new ones get 429")
      ->capture_default_str()
      ->check(CLI::Range(1, 1 << 30));
  c->add_option("--drain-timeout", a.drain_timeout_s,
                "seconds SIGTERM waits for accepted requests before cancelling them")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 1e6));
  c->add_option("--read-timeout", a.limits.read_timeout_s, "seconds a client has to send a whole request")
      ->capture_default_str()
      ->check(CLI::Range(0.01, 1e6));
  c->add_option("--write-timeout", a.limits.write_timeout_s, "seconds one write to a client may take")
      ->capture_default_str()
      ->check(CLI::Range(0.01, 1e6));
  c->add_option("--max-body-bytes", a.limits.body_bytes, "largest request body (413 beyond)")
      ->capture_default_str()
      ->check(CLI::Range(size_t(1), size_t(1) << 34));
  c->add_option("--max-connections", a.limits.max_connections, "open connections beyond which new ones get 503")
      ->capture_default_str()
      ->check(CLI::Range(1, 1 << 20));
  add_override_options(c, a.overrides, true);
  c->add_option("--http-threads", a.http_threads, "threads serving HTTP on rank 0")
      ->capture_default_str()
      ->check(CLI::Range(1, 64));
  return c;
}

// `glm5 report FILE`.
CLI::App* add_report(CLI::App& app, std::string& file) {
  CLI::App* c = app.add_subcommand("report", "print a --report file as tables (time, profile phases, MoE health)");
  c->add_option("file", file, "the JSON written by batch --report")->required();
  return c;
}

struct TokenizeArgs {
  std::string tokenizer;
  bool decode = false, literal_special = false;
};

// `glm5 tokenize`: JSON lines through the tokenizer.
CLI::App* add_tokenize(CLI::App& app, TokenizeArgs& a) {
  CLI::App* c = app.add_subcommand("tokenize", "JSON lines {\"text\"} on stdin -> {\"ids\"} on stdout");
  c->add_option("--tokenizer", a.tokenizer, "tokenizer.json or a model directory")->required();
  c->add_flag("--decode", a.decode, "read {\"ids\"} and write {\"text\"}");
  c->add_flag("--literal-special", a.literal_special,
              "encode special tokens written in the text as plain text (default: as their ids, like prompts)");
  return c;
}

struct LaunchArgs {
  std::string cluster, slurm;
  bool run = false, srun = false;
  std::vector<std::string> args;
};

// `glm5 launch`: the mpirun command (or Slurm script) of a cluster config.
CLI::App* add_launch(CLI::App& app, LaunchArgs& a) {
  CLI::App* c = app.add_subcommand("launch", "print (or --run) the mpirun command for a cluster config");
  c->add_option("--cluster", a.cluster)->required();
  auto* run = c->add_flag("--run", a.run, "execute it");
  auto* slurm =
      c->add_option("--slurm", a.slurm, "write a Slurm batch script (sbatch FILE) instead of printing")->excludes(run);
  c->add_flag("--srun", a.srun, "with --slurm: start the ranks with srun --mpi=pmix instead of mpirun")->needs(slurm);
  c->add_option("args", a.args, "glm5 subcommand and arguments (after --)");
  return c;
}

// Every subcommand's arguments and its CLI11 node (the one that parsed is the one that runs).
struct Commands {
  GenerateArgs generate;
  BatchArgs batch;
  PerplexityArgs perplexity;
  std::string report;
  InspectArgs inspect;
  ConvertArgs convert;
  TokenizeArgs tokenize;
  SimulateArgs simulate;
  ServeArgs serve;
  LaunchArgs launch;
  CLI::App *gen, *bat, *ppl, *rep, *ins, *conv, *tok, *sim, *srv, *lau;

  explicit Commands(CLI::App& app)
      : gen(add_generate(app, generate)),
        bat(add_batch(app, batch)),
        ppl(add_perplexity(app, perplexity)),
        rep(add_report(app, report)),
        ins(add_inspect(app, inspect)),
        conv(add_convert(app, convert)),
        tok(add_tokenize(app, tokenize)),
        sim(add_simulate(app, simulate)),
        srv(add_serve(app, serve)),
        lau(add_launch(app, launch)) {}

  // The cluster config of the command that runs (empty: one process).
  std::string cluster() const {
    return gen->parsed()   ? generate.cluster
           : bat->parsed() ? batch.cluster
           : ppl->parsed() ? perplexity.cluster
           : srv->parsed() ? serve.cluster
                           : std::string();
  }

  int run(std::unique_ptr<parallel::Comm> world, const char* argv0) {
    if (gen->parsed()) return run_generate(generate, std::move(world));
    if (bat->parsed()) return run_batch(batch, std::move(world));
    if (ppl->parsed()) return run_perplexity(perplexity, std::move(world));
    if (srv->parsed()) return run_serve(serve, std::move(world));
    if (ins->parsed()) return run_inspect(inspect);
    if (conv->parsed()) return run_convert(convert);
    if (tok->parsed()) return run_tokenize(tokenize.tokenizer, tokenize.decode, tokenize.literal_special);
    if (rep->parsed()) return run_report(report);
    if (sim->parsed()) return run_simulate(simulate);
    if (lau->parsed()) return run_launch(launch.cluster, launch.args, launch.run, argv0, launch.slurm, launch.srun);
    return 0;
  }
};

}  // namespace

int main_entry(int argc, char** argv) {
  default_threads();
  CLI::App app{"glm5: distributed inference for GLM-5 / DeepSeek-V3.2 checkpoints"};
  app.require_subcommand(1);
  Commands commands(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    // app.exit prints the message (or the help). Usage errors exit with 2, as shell tools do:
    // CLI11's own codes (104 conversion, 106 required, 109 extras, ...) look like crashes.
    return app.exit(e) == 0 ? 0 : 2;
  }
  const std::string cluster = commands.cluster();
  std::unique_ptr<parallel::MpiRuntime> mpi;
  std::unique_ptr<parallel::Comm> world;
  int rank = 0, size = 1;
  try {
    if (!cluster.empty() && launched_distributed(cluster)) {
      mpi = std::make_unique<parallel::MpiRuntime>(&argc, &argv);
      world = parallel::make_mpi_world();
      rank = world->rank();
      size = world->size();
    } else {
      world = parallel::make_self_comm();
    }
    return commands.run(std::move(world), argv[0]);
  } catch (const std::exception& e) {
    if (size > 1) {
      std::fprintf(stderr, "glm5: error on rank %d of %d: %s\n", rank, size, e.what());
      std::fflush(stderr);
      // Take the whole job down now rather than leave the other ranks waiting on this one.
      MPI_Abort(MPI_COMM_WORLD, 1);
    }
    std::fprintf(stderr, "glm5: error: %s\n", e.what());
    return 1;
  }
}

}  // namespace glm5::launcher
