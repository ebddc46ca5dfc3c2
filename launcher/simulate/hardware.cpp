// Hardware YAML -> Hardware (yaml-cpp), with errors that name the file, the line and the key.
#include "launcher/simulate/hardware.h"

#include <cmath>
#include <fstream>
#include <set>
#include <sstream>

#include "kernels/core/check.h"
#include "launcher/cluster/yaml.h"
#include "runtime/tokenizer/utf8.h"

namespace glm5::launcher {

namespace {

// A name for tables and plots: valid UTF-8 without control characters, short (it also writes back
// as YAML exactly: hardware_yaml).
bool printable_name(const std::string& s) {
  if (s.empty() || s.size() > 200) return false;
  const auto* b = reinterpret_cast<const unsigned char*>(s.data());
  for (size_t i = 0; i < s.size();) {
    const size_t n = runtime::tok::utf8_valid_len(b, s.size(), i);
    if (n == 0 || (n == 1 && (b[i] < 0x20 || b[i] == 0x7f))) return false;
    i += n;
  }
  return true;
}

// What a key may hold: Amount >= 0 (required), Rate > 0 (required), Fraction in (0, 1] (optional,
// default 1), Optional >= 0 (0 or absent: the default the parser fills in).
enum class Kind { Amount, Rate, Fraction, Optional };

struct Field {
  const char* key;
  double Hardware::*value;
  double scale;  // file unit -> Hardware unit (us -> s)
  Kind kind;
};

const Field kNumbers[] = {
    {"memory_gb", &Hardware::memory_gb, 1, Kind::Amount},
    {"gemm_flops", &Hardware::gemm_flops, 1, Kind::Rate},
    {"gemm_efficiency", &Hardware::gemm_efficiency, 1, Kind::Fraction},
    {"gemm_flops_small", &Hardware::gemm_flops_small, 1, Kind::Optional},
    {"exact_gemm_cost", &Hardware::exact_gemm_cost, 1, Kind::Optional},
    {"attention_flops", &Hardware::attention_flops, 1, Kind::Rate},
    {"attention_efficiency", &Hardware::attention_efficiency, 1, Kind::Fraction},
    {"mem_bw_core", &Hardware::mem_bw_core, 1, Kind::Rate},
    {"mem_bw", &Hardware::mem_bw, 1, Kind::Rate},
    {"mem_bw_efficiency", &Hardware::mem_bw_efficiency, 1, Kind::Fraction},
    {"attention_mem_efficiency", &Hardware::attention_mem_efficiency, 1, Kind::Fraction},
    {"topk_rate", &Hardware::topk_rate, 1, Kind::Rate},
    {"op_overhead_us", &Hardware::op_overhead_s, 1e-6, Kind::Amount},
    {"intra_node_bw", &Hardware::intra_node_bw, 1, Kind::Rate},
    {"intra_node_latency_us", &Hardware::intra_node_latency_s, 1e-6, Kind::Amount},
    {"inter_node_bw", &Hardware::inter_node_bw, 1, Kind::Rate},
    {"inter_node_latency_us", &Hardware::inter_node_latency_s, 1e-6, Kind::Amount},
};

[[noreturn]] void bad(const std::string& source, const YAML::Node& n, const std::string& key,
                      const std::string& expected) {
  std::string found = !n.IsDefined() ? "nothing (the key is missing)"
                      : n.IsScalar() ? "'" + n.Scalar() + "'"
                                     : "a list or map";
  std::string line = n.IsDefined() && n.Mark().line >= 0 ? ", line " + std::to_string(n.Mark().line + 1) : "";
  GLM5_FAIL("hardware file ", source, line, ": key '", key, "': expected ", expected, ", found ", found);
}

double positive(const std::string& source, const YAML::Node& n, const std::string& key) {
  double x = 0;
  if (!n.IsScalar() || !YAML::convert<double>::decode(n, x) || !std::isfinite(x) || x < 0)
    bad(source, n, key, "a number >= 0");
  return x;
}

int count(const std::string& source, const YAML::Node& n, const std::string& key) {
  long long x = 0;
  if (!n.IsScalar() || !YAML::convert<long long>::decode(n, x) || x < 1 || x > 1 << 20)
    bad(source, n, key, "an integer >= 1");
  return int(x);
}

}  // namespace

namespace {

Hardware read_hardware(const std::string& text, const std::string& source) {
  YAML::Node root;
  try {
    root = YAML::Load(text);
  } catch (const YAML::Exception& e) {
    GLM5_FAIL("hardware file ", source, ": not valid YAML: ", e.what());
  }
  CHECK(root.IsMap(), "hardware file ", source, ": expected a map of keys (name, kind, gemm_flops, ...)");
  std::set<std::string> known = {"name", "kind", "cores", "devices_per_node", "glm5"};
  for (const Field& f : kNumbers) known.insert(f.key);
  for (const auto& kv : root) {
    if (!kv.first.IsScalar()) bad(source, kv.first, "(top level)", "a key name");
    const std::string key = kv.first.Scalar();
    if (!known.count(key)) {
      std::string list;
      for (const auto& k : known) list += (list.empty() ? "" : ", ") + k;
      bad(source, kv.first, key, "one of the keys " + list);
    }
  }
  Hardware hw;
  hw.source = source;
  if (!root["name"].IsScalar() || !printable_name(root["name"].Scalar()))
    bad(source, root["name"], "name", "a name of printable UTF-8 text, at most 200 bytes");
  hw.name = root["name"].Scalar();
  const YAML::Node kind = root["kind"];
  if (!kind.IsScalar() || (kind.Scalar() != "cpu" && kind.Scalar() != "gpu")) bad(source, kind, "kind", "cpu or gpu");
  hw.kind = kind.Scalar();
  hw.cores = root["cores"] ? count(source, root["cores"], "cores") : 1;
  hw.devices_per_node = root["devices_per_node"] ? count(source, root["devices_per_node"], "devices_per_node") : 1;
  for (const Field& f : kNumbers) {
    const YAML::Node n = root[f.key];
    if (!n && (f.kind == Kind::Fraction || f.kind == Kind::Optional)) continue;
    const double x = positive(source, n, f.key);
    if (f.kind == Kind::Rate && x <= 0) bad(source, n, f.key, "a rate > 0");
    if (f.kind == Kind::Fraction && (x <= 0 || x > 1)) bad(source, n, f.key, "a fraction in (0, 1]");
    hw.*f.value = x * f.scale;
  }
  if (hw.exact_gemm_cost < 1) bad(source, root["exact_gemm_cost"], "exact_gemm_cost", "a number >= 1");
  if (hw.gemm_flops_small <= 0) hw.gemm_flops_small = hw.gemm_flops;
  if (const YAML::Node g = root["glm5"]) {
    if (!g.IsMap()) bad(source, g, "glm5", "a map of measured_by and efficiency keys");
    hw.has_measured = true;
    const std::pair<const char*, double Hardware::Measured::*> keys[] = {
        {"gemm_efficiency", &Hardware::Measured::gemm},
        {"attention_efficiency", &Hardware::Measured::attention},
        {"mem_bw_efficiency", &Hardware::Measured::mem_bw},
        {"attention_mem_efficiency", &Hardware::Measured::attention_mem}};
    for (const auto& kv : g) {
      if (!kv.first.IsScalar()) bad(source, kv.first, "glm5", "a key name");
      const std::string key = kv.first.Scalar();
      if (key == "measured_by") {
        hw.measured.by = kv.second.Scalar();
        continue;
      }
      if (key == "exact_gemm_cost") {
        hw.measured.exact_gemm_cost = positive(source, kv.second, "glm5." + key);
        if (hw.measured.exact_gemm_cost < 1) bad(source, kv.second, "glm5." + key, "a number >= 1");
        continue;
      }
      bool found = false;
      for (const auto& [name, field] : keys)
        if (key == name) {
          const double x = positive(source, kv.second, "glm5." + key);
          if (x <= 0 || x > 1) bad(source, kv.second, "glm5." + key, "a fraction in (0, 1]");
          hw.measured.*field = x;
          found = true;
        }
      if (!found)
        bad(source, kv.first, "glm5." + key,
            "one of measured_by, gemm_efficiency, attention_efficiency, mem_bw_efficiency, attention_mem_efficiency, "
            "exact_gemm_cost");
    }
    if (hw.measured.by.empty()) bad(source, g["measured_by"], "glm5.measured_by", "the run that measured them");
    const Hardware::Measured& m = hw.measured;
    if (m.gemm <= 0 && m.attention <= 0 && m.mem_bw <= 0 && m.attention_mem <= 0)
      bad(source, g, "glm5", "at least one efficiency key beside measured_by");
  }
  return hw;
}

}  // namespace

Hardware parse_hardware(const std::string& text, const std::string& source) {
  try {
    return read_hardware(text, source);
  } catch (const YAML::Exception& e) {  // yaml-cpp throws on odd nodes (e.g. an alias to nothing)
    GLM5_FAIL("hardware file ", source, ", line ", e.mark.line + 1, ": ", e.msg);
  }
}

Hardware Hardware::as_measured() const {
  Hardware h = *this;
  if (measured.gemm > 0) h.gemm_efficiency = measured.gemm;
  if (measured.attention > 0) h.attention_efficiency = measured.attention;
  if (measured.mem_bw > 0) h.mem_bw_efficiency = measured.mem_bw;
  if (measured.attention_mem > 0) h.attention_mem_efficiency = measured.attention_mem;
  if (measured.exact_gemm_cost > 0) h.exact_gemm_cost = measured.exact_gemm_cost;
  return h;
}

Hardware load_hardware(const std::string& path) {
  std::ifstream f(path);
  CHECK(f.good(), "hardware file ", path, ": cannot open it");
  std::stringstream ss;
  ss << f.rdbuf();
  return parse_hardware(ss.str(), path);
}

std::string hardware_yaml(const Hardware& hw, const std::string& comment) {
  std::ostringstream o;
  std::istringstream c(comment);
  for (std::string line; std::getline(c, line);) o << "# " << line << "\n";
  YAML::Emitter name;  // quoted and escaped as YAML reads it back (a name may hold quotes, '#', newlines)
  name << YAML::DoubleQuoted << hw.name;
  o << "name: " << name.c_str() << "\nkind: " << hw.kind << "\ncores: " << hw.cores
    << "\ndevices_per_node: " << hw.devices_per_node << "\n";
  o.precision(4);
  for (const Field& f : kNumbers)
    if (f.kind != Kind::Fraction || hw.*f.value > 0) o << f.key << ": " << hw.*f.value / f.scale << "\n";
  return o.str();
}

}  // namespace glm5::launcher
