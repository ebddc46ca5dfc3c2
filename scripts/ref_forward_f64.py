#!/usr/bin/env python3
# A from-scratch float64 reference of the GLM-5 (glm_moe_dsa) / DeepSeek-V3.2 (deepseek_v32)
# forward pass, written to be read top to bottom and checked against the spec
# (the project's GLM-5 model specification, cited below as "spec §N"). numpy only; no cache, no weight
# absorption, no chunking of the model: the whole prompt goes through every layer in one causal
# pass ("full recompute"), and attention expands every key through kv_b_proj (spec §3.4, the
# plainly correct "naive" form). It is slow and that is fine; it exists to be obviously right.
#
# Pinned: numpy==2.4.6 (see scripts/requirements.txt). Python >= 3.11.
"""Float64 full-recompute reference forward pass for glm_moe_dsa / deepseek_v32 checkpoints.

Examples:
  # reference outputs for a prompt (logits [P, vocab] and the indexer top-k sets)
  python3 scripts/ref_forward_f64.py --model tests/data/real-dims \\
      --prompt-ids tests/data/real-dims/prompt.json --out /tmp/ref.npz
  # check this script against an upstream golden (prompt taken from the golden)
  python3 scripts/ref_forward_f64.py --model tests/data/tiny-a \\
      --check-golden tests/data/tiny-a/golden.safetensors

Output (--out, numpy .npz):
  prompt_ids      int32   [P]
  logits          float32 [P, vocab]       logits at every prompt position (computed in float64)
  topk_rows       int32   [R]              the prompt rows whose causal span (pos + 1) exceeds
                                           index_topk, i.e. where the indexer really drops keys
  topk            int32   [L, R, topk]     per layer, the selected key positions of those rows,
                                           sorted ascending (ties broken toward the lower index)
  topk_margin     float64 [L, R]           (s_k - s_{k+1}) / max(|s_k|, |s_{k+1}|) of each of those
                                           rows: how far the k-th kept key is from the first
                                           dropped one (a tiny margin = a selection that float32
                                           rounding could flip)
  router_margin   float64 [L]              per MoE layer the smallest gap between the last chosen
                                           and the first rejected biased router score (inf for
                                           dense layers)

Compact output (--compact, safetensors, what tests/launcher/cli/test_real_dims.cpp reads):
  prompt_ids      I32 [P]
  logit_rows      I32 [N]        rows 0, E, 2E, ... (E = --every) and the last --last rows, each
                                 near-tie row (indexer margin below --skip-ties in some layer)
                                 replaced by the nearest firm row
  logits          F32 [N, vocab] the logits of those rows
  topk_rows       I32 [R]        as above (rows whose causal span exceeds index_topk)
  topk_hash       I64 [L, R]     order-independent hash of each selected set:
                                 sum over the set of splitmix64(t), modulo 2^64
  topk_margin     F32 [L, R]     as above
  topk_full_rows  I32 [F]        --full-rows: rows whose whole sets are stored
  topk_full       I32 [L, F, k]  their sets, sorted ascending
"""

import argparse
import json
import math
import os
import sys

import numpy as np

# ---------------------------------------------------------------------------------------------
# Checkpoint reading: safetensors parsed by hand (spec §2). A file is an 8-byte little-endian
# header length N, N bytes of JSON {name: {dtype, shape, data_offsets: [begin, end]}} (offsets
# relative to the end of the header), then the raw little-endian tensor bytes.


def read_safetensors(path):
    """All tensors of one safetensors file as float64 / int arrays, by name."""
    with open(path, "rb") as f:
        blob = f.read()
    (n,) = np.frombuffer(blob[:8], dtype="<u8")
    header = json.loads(blob[8 : 8 + int(n)])
    base = 8 + int(n)
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        b, e = meta["data_offsets"]
        raw = blob[base + b : base + e]
        shape = meta["shape"]
        dt = meta["dtype"]
        if dt == "BF16":
            # bfloat16 is the upper half of a float32: shift the 16 bits up and reinterpret.
            bits = np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16
            arr = bits.view(np.float32).astype(np.float64)
        elif dt == "F32":
            arr = np.frombuffer(raw, dtype="<f4").astype(np.float64)
        elif dt == "F16":
            arr = np.frombuffer(raw, dtype="<f2").astype(np.float64)
        elif dt == "F64":
            arr = np.frombuffer(raw, dtype="<f8").copy()
        elif dt == "I32":
            arr = np.frombuffer(raw, dtype="<i4").copy()
        elif dt == "I64":
            arr = np.frombuffer(raw, dtype="<i8").copy()
        else:
            raise SystemExit(f"{path}: tensor {name}: dtype {dt} is not supported by this reference")
        out[name] = arr.reshape(shape)
    return out


def load_checkpoint(model_dir):
    """Every tensor of the checkpoint (resolved through model.safetensors.index.json, spec §2.1)."""
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    W = {}
    for fn in files:
        W.update(read_safetensors(os.path.join(model_dir, fn)))
    return W


# ---------------------------------------------------------------------------------------------
# Configuration (spec §1.1, §1.3, §7 item 1).


class Config:
    def __init__(self, model_dir):
        with open(os.path.join(model_dir, "config.json")) as f:
            c = json.load(f)
        self.raw = c
        self.model_type = c["model_type"]
        if self.model_type not in ("glm_moe_dsa", "deepseek_v32"):
            raise SystemExit(f"model_type {self.model_type!r}: expected glm_moe_dsa or deepseek_v32")
        g = c.get
        self.H = c["hidden_size"]
        self.L = c["num_hidden_layers"]  # the MTP layer (index L) is not used (spec §3.9)
        self.NH = c["num_attention_heads"]
        self.q_lora = c["q_lora_rank"]
        self.kv_lora = c["kv_lora_rank"]
        self.d_nope = c["qk_nope_head_dim"]
        self.d_rope = c["qk_rope_head_dim"]
        self.d_v = c["v_head_dim"]
        self.d_qk = self.d_nope + self.d_rope
        self.ix_heads = c["index_n_heads"]
        self.ix_dim = c["index_head_dim"]
        self.ix_topk = c["index_topk"]
        self.inter = c["intermediate_size"]
        self.moe_inter = c["moe_intermediate_size"]
        self.n_experts = g("n_routed_experts") or 0
        self.n_shared = g("n_shared_experts") or 0
        self.top_e = c["num_experts_per_tok"]
        self.n_group = g("n_group") or 1
        self.topk_group = g("topk_group") or 1
        self.norm_topk_prob = g("norm_topk_prob", True)
        self.scaling = g("routed_scaling_factor", 1.0)
        self.first_dense = g("first_k_dense_replace", 0)
        self.moe_freq = g("moe_layer_freq", 1)
        self.eps = g("rms_norm_eps", 1e-6)
        self.vocab = c["vocab_size"]
        if g("scoring_func", "sigmoid") != "sigmoid":
            raise SystemExit("only scoring_func sigmoid is implemented")
        # RoPE conventions (spec §3.2, §7.1): MLA interleaved unless rope_interleave is false;
        # the indexer interleaved for glm_moe_dsa, half-split for deepseek_v32, unless the
        # indexer_rope_interleave key says otherwise.
        self.rope_interleave = g("rope_interleave", True)
        self.ix_rope_interleave = g("indexer_rope_interleave", self.model_type == "glm_moe_dsa")
        # rope_theta / rope_scaling: transformers-v5 `rope_parameters`, or top-level keys.
        if "rope_parameters" in c:
            rp = c["rope_parameters"]
            self.theta = rp["rope_theta"]
            scaling = rp
        else:
            self.theta = c["rope_theta"]
            scaling = g("rope_scaling") or {}
        rtype = scaling.get("rope_type", scaling.get("type", "default"))
        self.yarn = None
        if rtype == "yarn":
            self.yarn = {
                "factor": scaling["factor"],
                "orig": scaling.get("original_max_position_embeddings", c["max_position_embeddings"]),
                "beta_fast": scaling.get("beta_fast", 32.0),
                "beta_slow": scaling.get("beta_slow", 1.0),
                "mscale": scaling.get("mscale", 1.0),
                "mscale_all_dim": scaling.get("mscale_all_dim", 0.0),
            }
        elif rtype != "default":
            raise SystemExit(f"rope type {rtype!r}: expected \"default\" or \"yarn\" (the RoPE kinds glm5 accepts)")

        # GLM-5.2's IndexShare: "shared" layers have no indexer and use the top-k of the full
        # layer before them (transformers' GlmMoeDsaConfig: indexer_types, else index_topk_pattern,
        # else index_topk_freq / index_skip_topk_offset).
        types = g("indexer_types")
        if types is None and g("index_topk_pattern") is not None:
            pat = g("index_topk_pattern")
            types = [{"F": "full", "S": "shared"}.get(x, x) for x in pat]  # a string of F / S, or a list
        if types is None:
            freq, off = max(g("index_topk_freq", 1), 1), g("index_skip_topk_offset", 2)
            types = ["full" if max(i - off + 1, 0) % freq == 0 else "shared" for i in range(self.L)]
        self.indexer_full = [t == "full" for t in types[: self.L]]

    def is_moe(self, l):
        return self.n_experts > 0 and l >= self.first_dense and l % self.moe_freq == 0


# ---------------------------------------------------------------------------------------------
# Norms (spec §3.1, §3.6). eps: input/post-attention/final norm use rms_norm_eps; q_a_layernorm
# and kv_a_layernorm 1e-6 (HF class default, spec §3.1); the indexer's k_norm is a LayerNorm
# with bias and eps 1e-6 (spec §3.6).

LORA_NORM_EPS = 1e-6
K_NORM_EPS = 1e-6


def rms_norm(x, w, eps):
    return w * (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps))


def layer_norm(x, w, b, eps):
    mu = np.mean(x, axis=-1, keepdims=True)
    var = np.mean((x - mu) ** 2, axis=-1, keepdims=True)  # biased variance
    return (x - mu) / np.sqrt(var + eps) * w + b


def silu(x):
    return x / (1.0 + np.exp(-x))


# ---------------------------------------------------------------------------------------------
# RoPE (spec §3.2; YaRN for DeepSeek-V3.2 as in §3.3 and the reference precompute_freqs_cis).


def yarn_get_mscale(factor, mscale):
    return 1.0 if factor <= 1.0 else 0.1 * mscale * math.log(factor) + 1.0


def rope_inv_freq(cfg):
    d = cfg.d_rope
    inv = 1.0 / cfg.theta ** (np.arange(0, d, 2, dtype=np.float64) / d)  # theta^(-2i/d)
    if cfg.yarn:
        y = cfg.yarn

        def correction_dim(rot):
            return d * math.log(y["orig"] / (rot * 2 * math.pi)) / (2 * math.log(cfg.theta))

        low = max(math.floor(correction_dim(y["beta_fast"])), 0)
        high = min(math.ceil(correction_dim(y["beta_slow"])), d - 1)
        if low == high:
            high += 0.001
        ramp = np.clip((np.arange(d // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
        inv = inv / y["factor"] * ramp + inv * (1.0 - ramp)
    return inv


def rope_cos_sin(cfg, positions):
    """cos, sin of shape [P, d_rope/2]: angle_i = pos * inv_freq_i (0-based absolute positions)."""
    ang = positions[:, None].astype(np.float64) * rope_inv_freq(cfg)[None, :]
    scale = 1.0
    if cfg.yarn:  # HF attention_factor; 1 when mscale == mscale_all_dim (all our checkpoints)
        y = cfg.yarn
        scale = yarn_get_mscale(y["factor"], y["mscale"]) / yarn_get_mscale(y["factor"], y["mscale_all_dim"])
    return np.cos(ang) * scale, np.sin(ang) * scale


def apply_rope(x, cos, sin, interleaved):
    """Rotate x [P, ..., d] by position. cos/sin are [P, d/2]; extra axes broadcast.

    interleaved (GPT-J): pairs (x[2i], x[2i+1]);  half-split (NeoX): pairs (x[i], x[i+d/2]).
    x'_a = x_a cos - x_b sin;  x'_b = x_a sin + x_b cos.
    """
    shape = (x.shape[0],) + (1,) * (x.ndim - 2) + (cos.shape[1],)
    c, s = cos.reshape(shape), sin.reshape(shape)
    out = np.empty_like(x)
    if interleaved:
        a, b = x[..., 0::2], x[..., 1::2]
        out[..., 0::2] = a * c - b * s
        out[..., 1::2] = a * s + b * c
    else:
        h = x.shape[-1] // 2
        a, b = x[..., :h], x[..., h:]
        out[..., :h] = a * c - b * s
        out[..., h:] = a * s + b * c
    return out


def softmax_scale(cfg):
    """qk_head_dim^-0.5, times m^2 under YaRN with mscale_all_dim (spec §3.3)."""
    scale = cfg.d_qk ** -0.5
    if cfg.yarn and cfg.yarn["mscale_all_dim"] and cfg.yarn["factor"] > 1.0:
        m = yarn_get_mscale(cfg.yarn["factor"], cfg.yarn["mscale_all_dim"])
        scale *= m * m
    return scale


# ---------------------------------------------------------------------------------------------
# Top-k with a deterministic tie rule: the k largest values, equal values taken in ascending
# index order (a stable sort of the negated scores).


def topk_indices(scores, k):
    order = np.argsort(-scores, kind="stable")
    return order[:k]


# ---------------------------------------------------------------------------------------------
# DSA lightning indexer (spec §3.6): for every query row the set of keys MLA may attend to.


def indexer(cfg, W, P_, a, c_q, cos, sin, record):
    """Returns sel: a list (one per row) of key positions, or None where the row keeps all
    causal keys (span <= index_topk: the reference's top-k then picks -inf slots that the causal
    mask removes again, i.e. dense causal attention). record receives the sets and margins.
    The upstream reference's Walsh-Hadamard rotation and FP8 scoring are left out: the rotation
    is orthogonal (q.k unchanged in exact arithmetic) and FP8 is a precision shortcut (spec §3.6)."""
    P = a.shape[0]
    nh, d, k = cfg.ix_heads, cfg.ix_dim, cfg.ix_topk
    dr = cfg.d_rope
    # queries from the q LoRA latent: [P, nh, d], per head [rope dr | nope d-dr] (rope FIRST)
    qi = (c_q @ W[P_ + "indexer.wq_b.weight"].T).reshape(P, nh, d)
    qi = np.concatenate([apply_rope(qi[..., :dr], cos, sin, cfg.ix_rope_interleave), qi[..., dr:]], axis=-1)
    # one key per token from the normalized hidden: LayerNorm with bias, then RoPE on [0, dr)
    ki = layer_norm(a @ W[P_ + "indexer.wk.weight"].T, W[P_ + "indexer.k_norm.weight"],
                    W[P_ + "indexer.k_norm.bias"], K_NORM_EPS)
    ki = np.concatenate([apply_rope(ki[:, :dr], cos, sin, cfg.ix_rope_interleave), ki[:, dr:]], axis=-1)
    # per-head weights w = weights_proj(a) * nh^-0.5; the dot product is scaled by d^-0.5
    w = (a @ W[P_ + "indexer.weights_proj.weight"].T) * nh ** -0.5  # [P, nh]
    sel = [None] * P
    sets, margins = [], []
    rows = np.arange(k, P)  # rows with span pos+1 > k, i.e. where keys are really dropped
    chunk = 64
    for s0 in range(k, P, chunk):
        s1 = min(P, s0 + chunk)
        # I[s, t] = sum_h w[s, h] * d^-0.5 * relu(qi[s, h] . ki[t]),  t <= s  (causal)
        dots = (qi[s0:s1].reshape(-1, d) @ ki[:s1].T).reshape(s1 - s0, nh, s1)  # [s, h, t]
        I = np.einsum("sht,sh->st", np.maximum(dots, 0.0), w[s0:s1]) * d ** -0.5
        for s in range(s0, s1):
            row = I[s - s0, : s + 1]  # the causal keys of row s
            order = np.argsort(-row, kind="stable")  # top-k, ties to the lower index
            chosen = np.sort(order[:k])
            sel[s] = chosen
            sets.append(chosen)
            sk, sk1 = row[order[k - 1]], row[order[k]]
            margins.append((sk - sk1) / max(abs(sk), abs(sk1), 1e-300))
    record["topk"].append(np.array(sets, dtype=np.int32).reshape(len(rows), k))
    record["topk_margin"].append(np.array(margins, dtype=np.float64))
    return sel


# ---------------------------------------------------------------------------------------------
# MLA attention, naive form (spec §3.3 projections, §3.4 attention, §3.6 the DSA mask).


def attention(cfg, W, l, a, cos, sin, record):
    P_ = f"model.layers.{l}.self_attn."
    P = a.shape[0]
    NH, dn, dr, dv, R = cfg.NH, cfg.d_nope, cfg.d_rope, cfg.d_v, cfg.kv_lora
    # queries through the q LoRA: c_q = RMSNorm(W_qa a), q = W_qb c_q, per head [nope | rope]
    c_q = rms_norm(a @ W[P_ + "q_a_proj.weight"].T, W[P_ + "q_a_layernorm.weight"], LORA_NORM_EPS)
    q = (c_q @ W[P_ + "q_b_proj.weight"].T).reshape(P, NH, dn + dr)
    q_nope, q_pe = q[..., :dn], apply_rope(q[..., dn:], cos, sin, cfg.rope_interleave)
    # keys/values: kv = W_kva a = [latent R | k_pe dr]; c_kv = RMSNorm(latent); one shared k_pe
    kv = a @ W[P_ + "kv_a_proj_with_mqa.weight"].T
    c_kv = rms_norm(kv[:, :R], W[P_ + "kv_a_layernorm.weight"], LORA_NORM_EPS)
    k_pe = apply_rope(kv[:, R:], cos, sin, cfg.rope_interleave)  # [P, dr]
    # expand EVERY key: kv_b rows per head [k_nope dn | v dv] (spec §3.3)
    kvb = (c_kv @ W[P_ + "kv_b_proj.weight"].T).reshape(P, NH, dn + dv)
    k_nope, v = kvb[..., :dn], kvb[..., dn:]
    # which keys each row may see: DSA top-k where the causal span exceeds index_topk; a "shared"
    # layer takes the previous full layer's (its sets are recorded again for it)
    if cfg.indexer_full[l]:
        sel = record["sel"] = indexer(cfg, W, P_, a, c_q, cos, sin, record)
    else:
        sel = record["sel"]
        record["topk"].append(record["topk"][-1])
        record["topk_margin"].append(record["topk_margin"][-1])
    mask = np.tril(np.ones((P, P), dtype=bool))  # causal: t <= s
    for s in range(cfg.ix_topk, P):
        mask[s, :] = False
        mask[s, sel[s]] = True
    scale = softmax_scale(cfg)
    out = np.empty((P, NH, dv))
    for h in range(NH):
        # score[s, t] = scale * ([q_nope | q_pe][s] . [k_nope | k_pe][t]), masked, softmax over t
        sc = (q_nope[:, h] @ k_nope[:, h].T + q_pe[:, h] @ k_pe.T) * scale
        sc = np.where(mask, sc, -np.inf)
        sc = sc - sc.max(axis=1, keepdims=True)
        p = np.exp(sc)
        p /= p.sum(axis=1, keepdims=True)
        out[:, h] = p @ v[:, h]
    return out.reshape(P, NH * dv) @ W[P_ + "o_proj.weight"].T


# ---------------------------------------------------------------------------------------------
# Feed-forward (spec §3.7 SwiGLU; §3.8 MoE router).


def swiglu(W, prefix, x):
    g = x @ W[prefix + "gate_proj.weight"].T
    u = x @ W[prefix + "up_proj.weight"].T
    return (silu(g) * u) @ W[prefix + "down_proj.weight"].T


def moe(cfg, W, l, m, record):
    """Sigmoid noaux_tc routing (spec §3.8), token by token: the bias picks the experts, the
    unbiased scores weight them (renormalized when norm_topk_prob, times routed_scaling_factor);
    the shared expert is always added."""
    P_ = f"model.layers.{l}.mlp."
    T, E, K = m.shape[0], cfg.n_experts, cfg.top_e
    s = 1.0 / (1.0 + np.exp(-(m @ W[P_ + "gate.weight"].T)))  # unbiased sigmoid scores [T, E]
    b = s + W[P_ + "gate.e_score_correction_bias"]  # biased: used ONLY to choose experts
    y = np.zeros_like(m)
    worst = math.inf
    record["experts"].append([])
    for t in range(T):
        bt = b[t].copy()
        if cfg.n_group > 1:
            # group score = sum of the top-2 biased scores of the group; keep topk_group groups
            g = bt.reshape(cfg.n_group, E // cfg.n_group)
            gscore = np.sort(g, axis=1)[:, -2:].sum(axis=1)
            keep = topk_indices(gscore, cfg.topk_group)
            drop = np.ones(cfg.n_group, dtype=bool)
            drop[keep] = False
            g[drop] = -np.inf
            bt = g.reshape(E)
        idx = topk_indices(bt, K)
        rest = np.sort(bt)[::-1]  # margin: last chosen minus first rejected biased score
        if np.isfinite(rest[K]):
            worst = min(worst, rest[K - 1] - rest[K])
        record["experts"][-1].append(np.sort(idx))
        wt = s[t, idx]  # gather UNBIASED scores
        if cfg.norm_topk_prob:
            wt = wt / wt.sum()
        wt = wt * cfg.scaling
        for j, e in enumerate(idx):
            y[t] += wt[j] * swiglu(W, f"{P_}experts.{e}.", m[t : t + 1])[0]
    if cfg.n_shared > 0:
        y += swiglu(W, P_ + "shared_experts.", m)  # weight 1
    record["router_margin"].append(worst)
    return y


# ---------------------------------------------------------------------------------------------
# The model (spec §3.1): embedding, pre-norm decoder layers, final norm, untied lm_head.


def forward(cfg, W, ids):
    ids = np.asarray(ids, dtype=np.int64)
    P = ids.size
    pos = np.arange(P)  # the prompt is prefilled from position 0
    cos, sin = rope_cos_sin(cfg, pos)
    record = {"topk": [], "topk_margin": [], "router_margin": [], "experts": [], "layer_output": []}
    h = W["model.embed_tokens.weight"][ids]  # no embedding scaling
    for l in range(cfg.L):
        P_ = f"model.layers.{l}."
        a = rms_norm(h, W[P_ + "input_layernorm.weight"], cfg.eps)
        h = h + attention(cfg, W, l, a, cos, sin, record)
        m = rms_norm(h, W[P_ + "post_attention_layernorm.weight"], cfg.eps)
        if cfg.is_moe(l):
            h = h + moe(cfg, W, l, m, record)
        else:
            h = h + swiglu(W, P_ + "mlp.", m)
            record["router_margin"].append(math.inf)
        record["layer_output"].append(h.copy())
        print(f"layer {l} done", file=sys.stderr, flush=True)
    final = rms_norm(h, W["model.norm.weight"], cfg.eps)
    logits = final @ W["lm_head.weight"].T  # no soft-capping, no logit scaling
    record["final_hidden"] = final
    return logits, record


# ---------------------------------------------------------------------------------------------
# Compact output for the test.


def splitmix64(x):
    """splitmix64 of a uint64 array (wrapping arithmetic), the per-key term of topk_hash."""
    z = x.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def set_hash(keys):
    return np.sum(splitmix64(np.asarray(keys)), dtype=np.uint64)


def write_safetensors(path, tensors, metadata):
    """tensors: list of (name, numpy array); dtypes I32, I64, F32, F64 by the array's dtype."""
    names = {np.dtype("<i4"): "I32", np.dtype("<i8"): "I64", np.dtype("<f4"): "F32", np.dtype("<f8"): "F64"}
    header, blobs, off = {"__metadata__": metadata}, [], 0
    for name, a in tensors:
        a = np.ascontiguousarray(a)
        b = a.astype(a.dtype.newbyteorder("<")).tobytes()
        header[name] = {"dtype": names[a.dtype.newbyteorder("<")], "shape": list(a.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    hj = json.dumps(header, separators=(",", ":")).encode()
    hj += b" " * (-len(hj) % 8)
    with open(path, "wb") as f:
        f.write(np.uint64(len(hj)).tobytes())
        f.write(hj)
        for b in blobs:
            f.write(b)


def write_compact(path, cfg, ids, logits, rows, topk, margins, every, last, full_rows, skip_ties, command):
    P, k = len(ids), cfg.ix_topk
    # A row whose selection (in any layer) is a near-tie, (s_k - s_{k+1}) relative below
    # skip_ties, is one where float32 rounding may legitimately keep another key; such a row is
    # replaced by the nearest following (else preceding) row that is not, so that the stored rows
    # test arithmetic, not coin flips.
    row_margin = np.full(P, np.inf)
    if rows.size:
        row_margin[rows] = margins.min(axis=0)
    lrows = []
    for r in sorted(set(range(0, P, every)) | set(range(max(0, P - last), P))):
        for c in list(range(r, P)) + list(range(r - 1, -1, -1)):
            if row_margin[c] >= skip_ties and c not in lrows:
                lrows.append(c)
                break
    lrows.sort()
    for r in full_rows:
        if r not in set(rows.tolist()):
            raise SystemExit(f"--full-rows: row {r} does not exceed index_topk (rows {rows[0]}..{rows[-1]})")
    at = {int(r): i for i, r in enumerate(rows)}
    hashes = np.array([[set_hash(topk[l, i]) for i in range(rows.size)] for l in range(cfg.L)], dtype=np.uint64)
    full = topk[:, [at[r] for r in full_rows], :] if full_rows else np.zeros((cfg.L, 0, cfg.ix_topk), np.int32)
    write_safetensors(path, [
        ("prompt_ids", np.asarray(ids, np.int32)),
        ("logit_rows", np.asarray(lrows, np.int32)),
        ("logits", logits[lrows].astype(np.float32)),
        ("topk_rows", rows.astype(np.int32)),
        ("topk_hash", hashes.view(np.int64)),
        ("topk_margin", margins.astype(np.float32)),
        ("topk_full_rows", np.asarray(full_rows, np.int32)),
        ("topk_full", full.astype(np.int32)),
    ], {"producer": "scripts/ref_forward_f64.py (numpy float64 full recompute)", "command": command})


# ---------------------------------------------------------------------------------------------
# Command line.


def check_golden(cfg, W, golden_path):
    """Runs the golden's prompt and prints the largest differences; exit 1 above 1e-4."""
    G = read_safetensors(golden_path)
    ids = G["prompt_ids"]
    logits, rec = forward(cfg, W, ids)
    P, k = ids.size, cfg.ix_topk
    d_logits = float(np.max(np.abs(logits - G["prefill_logits"])))
    d_final = float(np.max(np.abs(rec["final_hidden"] - G["prefill_final_hidden"]))) \
        if "prefill_final_hidden" in G else float("nan")
    d_layers = float(np.max(np.abs(np.stack(rec["layer_output"]) - G["prefill_layer_output"]))) \
        if "prefill_layer_output" in G else float("nan")
    sets_equal, sets_total = 0, 0
    if "prefill_indexer_topk" in G:
        gt = G["prefill_indexer_topk"]  # [L, P, k], sorted, -1 padded
        for l in range(cfg.L):
            for r, s in enumerate(range(k, P)):
                sets_total += 1
                sets_equal += int(np.array_equal(np.sort(gt[l, s]), rec["topk"][l][r]))
    experts_equal = None
    if "prefill_moe_experts" in G and rec["experts"]:
        experts_equal = bool(np.array_equal(np.array(rec["experts"]), G["prefill_moe_experts"]))
    print(json.dumps({
        "golden": golden_path, "rows": int(P),
        "prefill_logits_max_abs": d_logits, "prefill_final_hidden_max_abs": d_final,
        "prefill_layer_output_max_abs": d_layers,
        "indexer_sets_equal": f"{sets_equal}/{sets_total}", "moe_experts_equal": experts_equal,
        "argmax_equal": bool(np.array_equal(logits.argmax(1), G["prefill_logits"].argmax(1))),
    }, indent=1))
    return 0 if d_logits < 1e-4 and sets_equal == sets_total and experts_equal is not False else 1


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="checkpoint directory (HF layout)")
    ap.add_argument("--prompt-ids", help="JSON file: a list of token ids")
    ap.add_argument("--out", help="output .npz (everything)")
    ap.add_argument("--compact", help="output .safetensors with the rows the test needs (see above)")
    ap.add_argument("--every", type=int, default=50, help="--compact: logits of every N-th row (default 50)")
    ap.add_argument("--last", type=int, default=8, help="--compact: and of the last N rows (default 8)")
    ap.add_argument("--skip-ties", type=float, default=1e-4,
                    help="--compact: move a logit row whose indexer margin is below this to a firm neighbour (default 1e-4)")
    ap.add_argument("--full-rows", default="", help="--compact: comma-separated rows whose whole top-k sets are stored")
    ap.add_argument("--check-golden", help="a golden.safetensors: run its prompt_ids and compare")
    args = ap.parse_args(argv)
    cfg = Config(args.model)
    W = load_checkpoint(args.model)
    if args.check_golden:
        return check_golden(cfg, W, args.check_golden)
    if not (args.prompt_ids and (args.out or args.compact)):
        ap.error("give --prompt-ids and --out and/or --compact (or --check-golden)")
    with open(args.prompt_ids) as f:
        ids = json.load(f)
    if not ids or any(not isinstance(t, int) or t < 0 or t >= cfg.vocab for t in ids):
        raise SystemExit(f"{args.prompt_ids}: expected a non-empty list of ids in [0, {cfg.vocab})")
    logits, rec = forward(cfg, W, ids)
    P, k = len(ids), cfg.ix_topk
    rows = np.arange(k, P, dtype=np.int32)
    topk = np.stack(rec["topk"]) if rows.size else np.zeros((cfg.L, 0, k), np.int32)
    margins = np.stack(rec["topk_margin"]) if rows.size else np.zeros((cfg.L, 0))
    if args.out:
        np.savez_compressed(args.out, prompt_ids=np.asarray(ids, np.int32), logits=logits.astype(np.float32),
                            topk_rows=rows, topk=topk.astype(np.int32), topk_margin=margins,
                            router_margin=np.asarray(rec["router_margin"], np.float64))
    if args.compact:
        full_rows = [int(r) for r in args.full_rows.split(",") if r.strip()]
        command = " ".join(["python3", "scripts/ref_forward_f64.py"] + (argv if argv is not None else sys.argv[1:]))
        write_compact(args.compact, cfg, ids, logits, rows, topk, margins, args.every, args.last, full_rows, args.skip_ties, command)
    print(json.dumps({
        "rows": P, "indexer_rows_per_layer": int(rows.size),
        "indexer_min_margin": float(margins.min()) if rows.size else None,
        "indexer_rows_margin_below_1e-4": int((margins < 1e-4).sum()) if rows.size else 0,
        "router_min_margin": float(np.min(rec["router_margin"])),
        "logits_abs_max": float(np.abs(logits).max()), "logits_std": float(logits.std()),
    }, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
