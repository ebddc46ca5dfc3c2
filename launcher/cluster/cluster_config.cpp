// Cluster-config YAML -> ClusterConfig (yaml-cpp), its checks against the model and the world size,
// the per-layer parameter count used to balance stages, and the mpirun command line for `glm5
// launch`. Every error names the file, the line, the key, what was expected and what was found.
// Model numbers never come from here: they come from the HF config.json (runtime/config.h).
#include "launcher/cluster/cluster_config.h"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <fstream>
#include <limits>
#include <numeric>
#include <set>
#include <sstream>
#include <thread>

#include "kernels/core/check.h"
#include "launcher/cluster/yaml.h"
#include "runtime/kv_cache.h"
#include "runtime/name_table.h"

namespace glm5::launcher {

namespace {

const char* const kAllowedKeys[] = {
    "stages",       "expert_parallel",    "micro_batches",         "backend",    "comm",
    "kv_budget_gb", "max_batch",          "prefill_chunk",         "hosts",      "mpirun_args",
    "env",          "device_memory_gb",   "max_step_tokens",       "watchdog_s", "prefix_caching",
    "kv_dtype",     "speculative_tokens", "speculative_max_batch", "precision"};

std::string where(const std::string& source) {
  return "cluster config " + (source.empty() ? std::string("(built-in default)") : source);
}

std::string allowed_keys_list() {
  std::string s;
  for (const char* k : kAllowedKeys) s += std::string(s.empty() ? "" : ", ") + k;
  return s;
}

// A found value for messages: the scalar's text, or what kind of node it is.
std::string show(const YAML::Node& n) {
  if (!n.IsDefined() || n.IsNull()) return "an empty value";
  if (n.IsSequence()) return "a list of " + std::to_string(n.size()) + " item(s)";
  if (n.IsMap()) return "a map of " + std::to_string(n.size()) + " key(s)";
  std::string s = n.Scalar();
  if (s.size() > 60) s = s.substr(0, 57) + "...";
  return "'" + s + "'";
}

// Reads the values of one file, naming the file, the line and the key in every error.
struct Reader {
  const std::string& source;

  [[noreturn]] void bad(const YAML::Node& n, const std::string& key, const std::string& expected,
                        const std::string& found) const {
    std::string line =
        n.IsDefined() && n.Mark().line >= 0 ? ", line " + std::to_string(n.Mark().line + 1) : std::string();
    GLM5_FAIL(where(source), line, ": key '", key, "': expected ", expected, ", found ", found);
  }
  [[noreturn]] void bad(const YAML::Node& n, const std::string& key, const std::string& expected) const {
    bad(n, key, expected, show(n));
  }

  int64_t integer(const YAML::Node& n, const std::string& key, int64_t min_value,
                  int64_t max_value = std::numeric_limits<int>::max()) const {
    std::string expected = max_value < std::numeric_limits<int>::max()
                               ? "an integer in [" + std::to_string(min_value) + ", " + std::to_string(max_value) + "]"
                               : "an integer >= " + std::to_string(min_value);
    long long x = 0;
    if (!n.IsScalar() || !YAML::convert<long long>::decode(n, x)) bad(n, key, expected);
    if (x < min_value || x > max_value) bad(n, key, expected);
    return x;
  }
  double number(const YAML::Node& n, const std::string& key, double min_value) const {
    std::ostringstream expected;
    expected << "a number >= " << min_value;
    double x = 0;
    if (!n.IsScalar() || !YAML::convert<double>::decode(n, x) || !std::isfinite(x)) bad(n, key, expected.str());
    if (x < min_value) bad(n, key, expected.str());
    return x;
  }
  bool boolean(const YAML::Node& n, const std::string& key) const {
    bool x = false;
    if (!n.IsScalar() || !YAML::convert<bool>::decode(n, x)) bad(n, key, "true or false");
    return x;
  }
  std::string text(const YAML::Node& n, const std::string& key, const std::string& expected) const {
    if (!n.IsScalar() || n.Scalar().empty()) bad(n, key, expected);
    return n.Scalar();
  }
  std::string one_of(const YAML::Node& n, const std::string& key, std::initializer_list<const char*> choices) const {
    std::string expected;
    for (const char* c : choices) expected += (expected.empty() ? "one of " : ", ") + std::string(c);
    std::string s = text(n, key, expected);
    for (const char* c : choices)
      if (s == c) return s;
    bad(n, key, expected);
  }

  // stages: N, or explicit ranges [[first, last), ...] contiguous from layer 0.
  void stages(const YAML::Node& n, ClusterConfig& cc) const {
    if (n.IsScalar()) {
      cc.stages = int(integer(n, "stages", 1));
      return;
    }
    const char* expected = "an integer >= 1 or a list of [first, last) layer ranges";
    if (!n.IsSequence() || n.size() == 0) bad(n, "stages", expected);
    int next = 0;
    for (size_t i = 0; i < n.size(); ++i) {
      const YAML::Node& r = n[i];
      std::string key = "stages[" + std::to_string(i) + "]";
      if (!r.IsSequence() || r.size() != 2) bad(r, key, "a [first, last) pair of layer indices");
      int first = int(integer(r[0], key + "[0]", 0));
      int last = int(integer(r[1], key + "[1]", 0));
      if (last <= first)
        bad(r, key, "a non-empty range (first < last)",
            "[" + std::to_string(first) + ", " + std::to_string(last) + "]");
      if (first != next)
        bad(r, key,
            "ranges contiguous from layer 0: first = " + std::to_string(next) +
                (i == 0 ? "" : " (the previous range's last)"),
            "first = " + std::to_string(first));
      cc.layer_ranges.push_back({first, last});
      next = last;
    }
    cc.stages = int(cc.layer_ranges.size());
  }

  // hosts: [{host: node1, slots: 8}, "node2:8", node3]
  void hosts(const YAML::Node& n, ClusterConfig& cc) const {
    if (!n.IsSequence()) bad(n, "hosts", "a list of {host: NAME, slots: N} entries");
    for (size_t i = 0; i < n.size(); ++i) {
      const YAML::Node& h = n[i];
      std::string key = "hosts[" + std::to_string(i) + "]";
      HostSlots hs;
      if (h.IsMap()) {
        for (auto it = h.begin(); it != h.end(); ++it) {
          std::string k = it->first.as<std::string>("");
          if (k != "host" && k != "slots") bad(it->first, key, "only the keys host, slots", "key '" + k + "'");
        }
        if (!h["host"]) bad(h, key + ".host", "a host name", "no 'host' key");
        hs.host = text(h["host"], key + ".host", "a host name");
        if (h["slots"]) hs.slots = int(integer(h["slots"], key + ".slots", 1));
      } else if (h.IsScalar() && !h.Scalar().empty()) {
        // "node1" or "node1:8", as mpirun --host writes them.
        std::string s = h.Scalar();
        auto colon = s.find(':');
        hs.host = s.substr(0, colon);
        if (colon != std::string::npos) {
          long long slots = 0;
          YAML::Node num(s.substr(colon + 1));
          if (!YAML::convert<long long>::decode(num, slots) || slots < 1 || slots > std::numeric_limits<int>::max())
            bad(h, key, "NAME or NAME:SLOTS with SLOTS an integer >= 1");
          hs.slots = int(slots);
        }
      } else {
        bad(h, key, "{host: NAME, slots: N} or \"NAME:SLOTS\"");
      }
      bool name_ok = !hs.host.empty() && hs.host.find_first_of(" \t,:=") == std::string::npos;
      if (!name_ok) bad(h, key + ".host", "a host name without spaces, ',', ':' or '='", "'" + hs.host + "'");
      cc.hosts.push_back(hs);
    }
  }

  void mpirun_args(const YAML::Node& n, ClusterConfig& cc) const {
    if (!n.IsSequence()) bad(n, "mpirun_args", "a list of strings, e.g. [\"--mca\", \"pml\", \"ucx\"]");
    for (size_t i = 0; i < n.size(); ++i)
      cc.mpirun_args.push_back(text(n[i], "mpirun_args[" + std::to_string(i) + "]", "a string"));
  }

  void env(const YAML::Node& n, ClusterConfig& cc) const {
    if (!n.IsMap()) bad(n, "env", "a map of NAME: value");
    for (auto it = n.begin(); it != n.end(); ++it) {
      std::string name = text(it->first, "env", "a variable name");
      bool ok = !name.empty() && !std::isdigit(static_cast<unsigned char>(name[0]));
      for (char c : name) ok = ok && (std::isalnum(static_cast<unsigned char>(c)) || c == '_');
      if (!ok) bad(it->first, "env", "a variable name ([A-Za-z_][A-Za-z0-9_]*)", "'" + name + "'");
      if (cc.env.count(name)) bad(it->first, "env." + name, "each variable once", "it twice");
      // A null value (`NAME:`) is the empty string; lists and maps are errors.
      if (it->second.IsNull()) {
        cc.env[name] = "";
        continue;
      }
      if (!it->second.IsScalar()) bad(it->second, "env." + name, "a string");
      cc.env[name] = it->second.Scalar();
    }
  }
};

}  // namespace

void ClusterOverrides::apply(ClusterConfig& cc) const {
  CHECK(speculative_tokens >= -1 && speculative_tokens <= kMaxSpeculativeTokens,
        "--speculative-tokens: expected an integer in [0, ", kMaxSpeculativeTokens, "], found ", speculative_tokens);
  if (speculative_tokens >= 0) cc.speculative_tokens = speculative_tokens;
  if (!precision.empty()) cc.precision = kernels::precision_name(kernels::parse_precision(precision, "--precision"));
}

ClusterConfig default_cluster_config() { return ClusterConfig{}; }

// One top-level key of the file (key_node: its name's node, for messages) into cc.
static void read_key(Reader& rd, const YAML::Node& key_node, const YAML::Node& v, ClusterConfig& cc) {
  const std::string key = key_node.Scalar();
  if (key == "stages")
    rd.stages(v, cc);
  else if (key == "expert_parallel")
    cc.expert_parallel = int(rd.integer(v, key, 1));
  else if (key == "micro_batches")
    cc.micro_batches = int(rd.integer(v, key, 1));
  else if (key == "backend")
    cc.backend = rd.one_of(v, key, {"cpu", "cuda", "cpu-devicelike"});
  else if (key == "comm")
    cc.comm = rd.one_of(v, key, {"mpi", "nccl"});
  else if (key == "kv_budget_gb")
    cc.kv_budget_gb = rd.number(v, key, 0.0);
  else if (key == "device_memory_gb")
    cc.device_memory_gb = rd.number(v, key, 0.0);
  else if (key == "max_batch")
    cc.max_batch = rd.integer(v, key, 1);
  else if (key == "prefill_chunk")
    cc.prefill_chunk = rd.integer(v, key, 1);
  else if (key == "max_step_tokens")
    cc.max_step_tokens = rd.integer(v, key, 1);
  else if (key == "watchdog_s")
    cc.watchdog_s = rd.number(v, key, 0.0);
  else if (key == "prefix_caching")
    cc.prefix_sharing = rd.boolean(v, key);
  else if (key == "kv_dtype")
    cc.kv_dtype = rd.one_of(v, key, {"f32", "bf16"});
  else if (key == "precision")
    cc.precision = rd.one_of(v, key, {"exact", "fast"});
  else if (key == "speculative_tokens")
    cc.speculative_tokens = int(rd.integer(v, key, 0, kMaxSpeculativeTokens));
  else if (key == "speculative_max_batch")
    cc.speculative_max_batch = rd.integer(v, key, 1);
  else if (key == "hosts")
    rd.hosts(v, cc);
  else if (key == "mpirun_args")
    rd.mpirun_args(v, cc);
  else if (key == "env")
    rd.env(v, cc);
  else
    rd.bad(key_node, key, "one of the keys (" + allowed_keys_list() + ")", "unknown key '" + key + "'");
}

// The rules between keys, once every key is read.
static void check_together(Reader& rd, const YAML::Node& root, const ClusterConfig& cc) {
  // Ranks are MPI ints; a world past a million ranks is a typo (and stages x E must not overflow).
  if (int64_t(cc.stages) * cc.expert_parallel > kMaxWorldSize) {
    const YAML::Node n = root["expert_parallel"] ? root["expert_parallel"] : root["stages"];
    rd.bad(n, "stages x expert_parallel", "at most " + std::to_string(kMaxWorldSize) + " ranks",
           std::to_string(cc.stages) + " x " + std::to_string(cc.expert_parallel) + " = " +
               std::to_string(int64_t(cc.stages) * cc.expert_parallel));
  }
  if (cc.max_step_tokens < cc.max_batch) {
    const YAML::Node n = root["max_step_tokens"] ? root["max_step_tokens"] : root["max_batch"];
    rd.bad(n, "max_step_tokens",
           "at least max_batch (" + std::to_string(cc.max_batch) + ": every running sequence decodes in one step)",
           std::to_string(cc.max_step_tokens));
  }
  if (cc.comm == "nccl" && cc.backend == "cpu")
    rd.bad(root["comm"], "comm",
           "mpi with backend cpu (comm nccl needs device memory: backend cuda, or cpu-devicelike)", "'nccl'");
}

ClusterConfig parse_cluster_config(const std::string& yaml_text, const std::string& source) {
  ClusterConfig cc;
  cc.source = source;
  Reader rd{source};

  YAML::Node root;
  try {
    root = YAML::Load(yaml_text);
  } catch (const YAML::Exception& e) {
    GLM5_FAIL(where(source), ", line ", e.mark.line + 1, ", column ", e.mark.column + 1, ": not valid YAML: ", e.msg);
  }
  if (!root.IsDefined() || root.IsNull()) return cc;  // an empty file: the 1 x 1 cpu default
  if (!root.IsMap()) rd.bad(root, "(top level)", "a map of keys (" + allowed_keys_list() + ")");

  try {
    std::set<std::string> seen;
    for (auto it = root.begin(); it != root.end(); ++it) {
      if (!it->first.IsScalar()) rd.bad(it->first, "(top level)", "a key name");
      const std::string key = it->first.Scalar();
      const YAML::Node v = it->second;  // a handle: it-> is a temporary proxy
      if (!seen.insert(key).second) rd.bad(it->first, key, "each key once", "it twice");
      read_key(rd, it->first, v, cc);
    }
    check_together(rd, root, cc);
  } catch (const YAML::Exception& e) {
    // yaml-cpp throws on odd nodes (e.g. an alias to nothing); report it as a file error.
    GLM5_FAIL(where(source), ", line ", e.mark.line + 1, ": ", e.msg);
  }
  return cc;
}

ClusterConfig load_cluster_config(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  CHECK(in, where(path), ": cannot open the file (", std::strerror(errno), ")");
  std::ostringstream ss;
  ss << in.rdbuf();
  return parse_cluster_config(ss.str(), path);
}

double layer_parameters(const runtime::ModelConfig& mc, int layer) {
  const int64_t n_layers = mc.num_hidden_layers + mc.num_nextn_predict_layers;
  CHECK(layer >= 0 && layer < n_layers, "layer_parameters: layer ", layer, " is outside [0, ", n_layers,
        ") of model config ", mc.source);
  double n = 0;
  for (const runtime::TensorSpec& s : runtime::layer_tensors(mc, layer)) n += double(s.numel());
  return n;
}

std::vector<parallel::LayerRange> plan_stages(const ClusterConfig& cc, const runtime::ModelConfig& mc, int world_size) {
  const std::string cfg = where(cc.source);
  const int P = cc.stages, E = cc.expert_parallel;
  CHECK(P >= 1 && E >= 1, cfg, ": stages (", P, ") and expert_parallel (", E, ") must both be >= 1");
  CHECK(world_size == P * E, cfg, ": stages (", P, ") x expert_parallel (", E, ") = ", P * E,
        " ranks, but the job has ", world_size, " ranks (mpirun -np)");
  if (mc.n_routed_experts % E != 0) {
    std::string divisors;
    for (int64_t d = 1; d <= mc.n_routed_experts; ++d)
      if (mc.n_routed_experts % d == 0) divisors += (divisors.empty() ? "" : ", ") + std::to_string(d);
    GLM5_FAIL(cfg, ": key 'expert_parallel': expected a divisor of n_routed_experts (", mc.n_routed_experts,
              ") of model config ", mc.source, " (one of ", divisors, "), found ", E);
  }
  const int L = int(mc.num_hidden_layers);
  CHECK(P <= L, cfg, ": key 'stages': expected at most num_hidden_layers (", L, ") of model config ", mc.source,
        " (every stage needs a layer), found ", P);

  if (!cc.layer_ranges.empty()) {
    CHECK(int(cc.layer_ranges.size()) == P, cfg, ": key 'stages': ", cc.layer_ranges.size(),
          " explicit layer ranges for ", P, " stages");
    int next = 0;
    for (int s = 0; s < P; ++s) {
      const parallel::LayerRange& r = cc.layer_ranges[s];
      CHECK(r.first == next && r.last > r.first, cfg, ": key 'stages[", s,
            "]': expected a non-empty range starting at layer ", next, s == 0 ? "" : " (the previous range's last)",
            ", found [", r.first, ", ", r.last, "]");
      next = r.last;
    }
    CHECK(next == L, cfg, ": key 'stages': expected layer ranges covering layers [0, ", L, ") of model config ",
          mc.source, " (num_hidden_layers = ", L, "), found ranges ending at ", next);
    return cc.layer_ranges;
  }

  // Balanced by parameters. With GLM-5.2's IndexShare, over groups of a full-indexer layer and the
  // shared layers after it when that costs little (a group stays on one stage, so no top-k crosses
  // a pipeline hop), else layer by layer (a stage that begins with a shared layer gets its donor's
  // top-k with the hidden states): groups unless their largest stage is 10 % above the other's.
  std::vector<double> cost(static_cast<size_t>(L));
  std::vector<int> group_first;
  std::vector<double> group_cost;
  for (int l = 0; l < L; ++l) {
    cost[size_t(l)] = layer_parameters(mc, l);
    if (l == 0 || mc.has_indexer(l)) {
      group_first.push_back(l);
      group_cost.push_back(0);
    }
    group_cost.back() += cost[size_t(l)];
  }
  std::vector<parallel::LayerRange> stages = parallel::balance_layers(cost, P);
  if (int(group_cost.size()) == L || P > int(group_cost.size())) return stages;
  std::vector<parallel::LayerRange> grouped = parallel::balance_layers(group_cost, P);
  group_first.push_back(L);
  for (parallel::LayerRange& r : grouped) r = {group_first[size_t(r.first)], group_first[size_t(r.last)]};
  auto largest = [&](const std::vector<parallel::LayerRange>& v) {
    double m = 0;
    for (const parallel::LayerRange& r : v)
      m = std::max(m, std::accumulate(cost.begin() + r.first, cost.begin() + r.last, 0.0));
    return m;
  };
  return largest(grouped) <= 1.1 * largest(stages) ? grouped : stages;
}

// Whether mpirun_args choose a binding themselves (--bind-to, the hwloc binding policy, CPU sets,
// CPUs per rank, or PE=N in --map-by, which binds to cores).
static bool user_binds(const std::vector<std::string>& args) {
  for (const std::string& a : args)
    if (a.rfind("--bind-to", 0) == 0 || a.rfind("-bind-to", 0) == 0 ||
        a.find("hwloc_base_binding_policy") != std::string::npos || a.rfind("--cpu-set", 0) == 0 ||
        a.rfind("--cpus-per-", 0) == 0 || a.find("PE=") != std::string::npos)
      return true;
  return false;
}

// Open MPI binds each rank to one core when the job has at most 2 ranks (to a package beyond):
// a CPU rank's OpenMP threads (the host's cores / its ranks) would then share that one core,
// halving a one-rank job. CPU ranks stay unbound unless mpirun_args bind; GPU jobs keep Open
// MPI's default (a rank near its GPU).
static std::vector<std::string> binding_args(const ClusterConfig& cc) {
  if (cc.backend != "cpu" || user_binds(cc.mpirun_args)) return {};
  return {"--bind-to", "none"};
}

size_t stage_kv_bytes_per_token(const ClusterConfig& cc, const runtime::ModelConfig& mc,
                                const std::vector<parallel::LayerRange>& stages, size_t s) {
  const bool mtp = s + 1 == stages.size() && cc.speculative_tokens > 0;
  return runtime::KvPool::bytes_per_token(mc, stages[s].first, stages[s].last + (mtp ? 1 : 0), cc.kv_cache_dtype());
}

size_t kv_bytes_per_token(const ClusterConfig& cc, const runtime::ModelConfig& mc,
                          const std::vector<parallel::LayerRange>& stages) {
  size_t most = 0;
  for (size_t s = 0; s < stages.size(); ++s) most = std::max(most, stage_kv_bytes_per_token(cc, mc, stages, s));
  return most;
}

runtime::ModelShard rank_shard(const ClusterConfig& cc, const std::vector<parallel::LayerRange>& stages, int rank) {
  const parallel::Grid g = cc.grid();
  const int s = g.stage_of(rank);
  runtime::ModelShard shard;
  shard.first_layer = stages[size_t(s)].first;
  shard.last_layer = stages[size_t(s)].last;
  shard.embedding = s == 0;
  shard.head = s == g.stages - 1;
  shard.expert_parallel = g.expert_parallel;
  shard.column = g.column_of(rank);
  shard.mtp = shard.head && cc.speculative_tokens > 0;
  return shard;
}

std::vector<std::string> launch_command(const ClusterConfig& cc, const std::string& glm5_path,
                                        const std::vector<std::string>& glm5_args, bool as_root) {
  for (const std::string& a : glm5_args)
    CHECK(a != "--cluster" && a.rfind("--cluster=", 0) != 0, "glm5 launch: found '", a,
          "' in the glm5 arguments; expected none: the launcher appends --cluster ",
          cc.source.empty() ? "FILE" : cc.source, " itself");
  const int n = cc.world_size();
  std::vector<std::string> cmd = {"mpirun", "-np", std::to_string(n)};
  if (as_root) cmd.push_back("--allow-run-as-root");

  bool oversubscribe = false;
  if (!cc.hosts.empty()) {
    int64_t slots = 0;
    for (const HostSlots& h : cc.hosts) slots += h.slots;
    oversubscribe = slots < n;
  } else {
    unsigned cpus = std::max(1u, std::thread::hardware_concurrency());
    oversubscribe = unsigned(n) > cpus;
  }
  if (oversubscribe) cmd.push_back("--oversubscribe");

  if (!cc.hosts.empty()) {
    std::string list;
    for (const HostSlots& h : cc.hosts) list += (list.empty() ? "" : ",") + h.host + ":" + std::to_string(h.slots);
    cmd.push_back("--host");
    cmd.push_back(list);
  }
  cmd.insert(cmd.end(), cc.mpirun_args.begin(), cc.mpirun_args.end());
  for (const std::string& a : binding_args(cc)) cmd.push_back(a);
  for (const auto& [k, v] : cc.env) {
    cmd.push_back("-x");
    cmd.push_back(k + "=" + v);
  }
  cmd.push_back(glm5_path);
  cmd.insert(cmd.end(), glm5_args.begin(), glm5_args.end());
  if (!cc.source.empty()) {
    cmd.push_back("--cluster");
    cmd.push_back(cc.source);
  }
  return cmd;
}

std::string slurm_script(const ClusterConfig& cc, const std::string& glm5_path,
                         const std::vector<std::string>& glm5_args, bool srun) {
  const std::vector<std::string> mpirun = launch_command(cc, glm5_path, glm5_args, false);  // checks the args
  const int n = cc.world_size();
  std::string out = "#!/bin/bash\n# glm5 on " + (cc.source.empty() ? std::string("the default cluster") : cc.source) +
                    ": " + std::to_string(cc.stages) + " stage(s) x " + std::to_string(cc.expert_parallel) +
                    " expert-parallel column(s). Submit with: sbatch THIS_FILE\n";
  out += "#SBATCH --job-name=glm5\n#SBATCH --ntasks=" + std::to_string(n) + "\n";
  if (cc.hosts.empty()) {
    out += "#SBATCH --nodes=1\n";
  } else {
    int most = 0;
    std::string list;
    for (const HostSlots& h : cc.hosts) {
      most = std::max(most, h.slots);
      list += (list.empty() ? "" : ",") + h.host;
    }
    out += "#SBATCH --nodes=" + std::to_string(cc.hosts.size()) +
           "\n#SBATCH --ntasks-per-node=" + std::to_string(most) + "\n#SBATCH --nodelist=" + list + "\n";
  }
  out += "set -euo pipefail\n";
  for (const auto& [k, v] : cc.env) out += "export " + shell_join({k + "=" + v}) + "\n";
  std::vector<std::string> cmd;
  if (srun) {
    cmd = {"srun", "--mpi=pmix", "--ntasks=" + std::to_string(n)};
    if (cc.backend == "cpu" && !cc.env.count("SLURM_CPU_BIND")) cmd.push_back("--cpu-bind=none");  // as binding_args
  } else {  // mpirun takes the allocation's hosts: no --host, no --oversubscribe
    cmd = {"mpirun", "-np", std::to_string(n)};
    cmd.insert(cmd.end(), cc.mpirun_args.begin(), cc.mpirun_args.end());
    for (const std::string& a : binding_args(cc)) cmd.push_back(a);
    for (const auto& [k, v] : cc.env) cmd.insert(cmd.end(), {"-x", k});
  }
  // glm5 and its arguments: the tail of the mpirun line (from the glm5 path on).
  cmd.insert(cmd.end(), std::find(mpirun.begin(), mpirun.end(), glm5_path), mpirun.end());
  return out + shell_join(cmd) + "\n";
}

std::string shell_join(const std::vector<std::string>& argv) {
  std::string out;
  for (const std::string& a : argv) {
    if (!out.empty()) out += ' ';
    bool plain = !a.empty();
    for (char c : a)
      plain = plain && (std::isalnum(static_cast<unsigned char>(c)) || (c != '\0' && std::strchr("_@%+=:,./-", c)));
    if (plain) {
      out += a;
      continue;
    }
    out += '\'';
    for (char c : a) {
      if (c == '\'')
        out += "'\\''";
      else
        out += c;
    }
    out += '\'';
  }
  return out;
}

}  // namespace glm5::launcher
