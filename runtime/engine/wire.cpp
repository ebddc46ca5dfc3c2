#include "runtime/engine/wire.h"

namespace glm5::runtime::wire {

namespace {

// A list of logprob entries (prompt logprobs): count, then token, logprob and top list each.
void put_sampled(Writer& w, const std::vector<Sampled>& v) {
  w.put<int64_t>(int64_t(v.size()));
  for (const Sampled& x : v) {
    w.put(x.token);
    w.put(x.logprob);
    w.put_vec(x.top);
  }
}
std::vector<Sampled> get_sampled(Reader& rd) {
  std::vector<Sampled> v(static_cast<size_t>(rd.get<int64_t>()));
  for (Sampled& x : v) {
    x.token = rd.get<int32_t>();
    x.logprob = rd.get<float>();
    x.top = rd.get_vec<std::pair<int32_t, float>>();
  }
  return v;
}

}  // namespace

std::vector<char> recv_bytes(parallel::Comm& c, int src, int tag) {
  int64_t n = 0;
  c.recv(&n, sizeof n, src, tag);
  std::vector<char> b(static_cast<size_t>(n));
  if (n) c.recv(b.data(), b.size(), src, tag);
  return b;
}

void put_request(Writer& w, const Request& r) {
  w.put(r.index);
  w.put_vec(r.prompt);
  const SamplingParams& s = r.sampling;
  w.put(s.temperature);
  w.put(s.top_p);
  w.put(s.top_k);
  w.put(s.min_p);
  w.put(s.repetition_penalty);
  w.put(s.presence_penalty);
  w.put(s.frequency_penalty);
  w.put(s.seed);
  w.put(s.max_tokens);
  w.put(s.logprobs);
  w.put(s.ignore_eos);
  w.put<int64_t>(int64_t(s.stop.size()));
  for (auto& x : s.stop) w.put_str(x);
  w.put(r.want_prompt_logits);
  w.put(r.want_logits);
  w.put(r.extra_final_step);
  w.put(r.prompt_logprobs);
  w.put_str(r.error);
  w.put(r.stream);
  w.put(r.speculative);
  w.put_vec(r.generated);
}
Request get_request(Reader& rd) {
  Request r;
  r.index = rd.get<int64_t>();
  r.prompt = rd.get_vec<int32_t>();
  SamplingParams& s = r.sampling;
  s.temperature = rd.get<float>();
  s.top_p = rd.get<float>();
  s.top_k = rd.get<int32_t>();
  s.min_p = rd.get<float>();
  s.repetition_penalty = rd.get<float>();
  s.presence_penalty = rd.get<float>();
  s.frequency_penalty = rd.get<float>();
  s.seed = rd.get<uint64_t>();
  s.max_tokens = rd.get<int32_t>();
  s.logprobs = rd.get<int32_t>();
  s.ignore_eos = rd.get<bool>();
  int64_t ns = rd.get<int64_t>();
  for (int64_t i = 0; i < ns; ++i) s.stop.push_back(rd.get_str());
  r.want_prompt_logits = rd.get<bool>();
  r.want_logits = rd.get<bool>();
  r.extra_final_step = rd.get<bool>();
  r.prompt_logprobs = rd.get<int32_t>();
  r.error = rd.get_str();
  r.stream = rd.get<bool>();
  r.speculative = rd.get<bool>();
  r.generated = rd.get_vec<int32_t>();
  return r;
}

void put_result(Writer& w, const Result& r) {
  w.put(r.index);
  w.put_vec(r.tokens);
  w.put_vec(r.logprobs);
  w.put<int64_t>(int64_t(r.top_logprobs.size()));
  for (auto& t : r.top_logprobs) w.put_vec(t);
  w.put_str(r.finish_reason);
  w.put_str(r.error);
  w.put_vec(r.prompt_logits);
  w.put_vec(r.decode_logits);
  put_sampled(w, r.prompt_logprobs);
}
Result get_result(Reader& rd) {
  Result r;
  r.index = rd.get<int64_t>();
  r.tokens = rd.get_vec<int32_t>();
  r.logprobs = rd.get_vec<float>();
  int64_t n = rd.get<int64_t>();
  for (int64_t i = 0; i < n; ++i) r.top_logprobs.push_back(rd.get_vec<std::pair<int32_t, float>>());
  r.finish_reason = rd.get_str();
  r.error = rd.get_str();
  r.prompt_logits = rd.get_vec<float>();
  r.decode_logits = rd.get_vec<float>();
  r.prompt_logprobs = get_sampled(rd);
  return r;
}

void put_step(Writer& w, const Step& s) {
  w.put(s.stop);
  w.put<int64_t>(int64_t(s.seqs.size()));
  for (auto& q : s.seqs) w.put(q);
  w.put_vec(s.released);
  w.put<int64_t>(int64_t(s.added.size()));
  for (auto& r : s.added) put_request(w, r);
  w.put_vec(s.blocks);
}
Step get_step(Reader& rd) {
  Step s;
  s.stop = rd.get<bool>();
  int64_t n = rd.get<int64_t>();
  for (int64_t i = 0; i < n; ++i) s.seqs.push_back(rd.get<StepSeq>());
  s.released = rd.get_vec<int64_t>();
  n = rd.get<int64_t>();
  for (int64_t i = 0; i < n; ++i) s.added.push_back(get_request(rd));
  s.blocks = rd.get_vec<int32_t>();
  return s;
}

void put_backs(Writer& w, const std::vector<Back>& backs) {
  w.put<int64_t>(int64_t(backs.size()));
  for (auto& b : backs) {
    w.put(b.req);
    put_sampled(w, b.tokens);
    w.put_vec(b.drafts);
    w.put_vec(b.logits);
    w.put_str(b.error);
    put_sampled(w, b.prompt_logprobs);
  }
}
std::vector<Back> get_backs(Reader& rd) {
  std::vector<Back> backs(static_cast<size_t>(rd.get<int64_t>()));
  for (Back& b : backs) {
    b.req = rd.get<int64_t>();
    b.tokens = get_sampled(rd);
    b.drafts = rd.get_vec<int32_t>();
    b.logits = rd.get_vec<float>();
    b.error = rd.get_str();
    b.prompt_logprobs = get_sampled(rd);
  }
  return backs;
}

}  // namespace glm5::runtime::wire
