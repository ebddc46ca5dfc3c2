#!/usr/bin/env python3
# Deterministic random-weight checkpoints in the Hugging Face layout of zai-org/GLM-5 (glm_moe_dsa)
# or deepseek-ai/DeepSeek-V3.2 (deepseek_v32), of any shape: config.json, generation_config.json,
# BF16 shards with the real tensor names, model.safetensors.index.json. numpy only; safetensors are
# written by hand, one tensor at a time, so a 1.5 GB model never sits in memory.
# Leaves out: FP8 checkpoints (weight_scale_inv), tokenizers (only copied with --tokenizer).
#
# Pinned: numpy==2.4.6 (see scripts/requirements.txt). Python >= 3.11.
"""Generate a tiny (or benchmark-sized) GLM-5 / DeepSeek-V3.2 checkpoint.

Examples:
  python3 scripts/gen_tiny_model.py --preset tiny-a-like --seed 1 --out /tmp/tiny
  python3 scripts/gen_tiny_model.py --preset bench --out /tmp/bench
  python3 scripts/gen_tiny_model.py --preset tiny-a-like --model-type deepseek_v32 \
      --rope-scaling-factor 4 --original-max-position-embeddings 64 --out /tmp/v32

Weight init (every tensor from its own numpy Generator seeded by (--seed, sha256(name)), so a
tensor does not depend on the shard layout or on the other tensors):
  embed_tokens                           N(0, 1)
  lm_head                                N(0, (2/sqrt(hidden))^2)       logits std ~2
  projections into a block               N(0, 1/fan_in)                 q_a, q_b, kv_a, kv_b,
                                                                        gate/up, router, indexer,
                                                                        eh_proj
  projections back into the residual     N(0, 0.25/fan_in)              o_proj, every down_proj
  RMSNorm / LayerNorm weights            1 + N(0, 0.05^2)
  indexer k_norm.bias                    N(0, 0.02^2)
  mlp.gate.e_score_correction_bias (F32) N(0, 0.05^2)
With these the residual stream stays O(1) through the layers, sigmoid router scores spread over
(0, 1) and indexer scores are O(1). Near-ties are still possible by chance: check the margins the
golden script reports and change --seed if a selection is too close.
"""

import argparse
import hashlib
import json
import os
import shutil
import sys

import numpy as np

# ---------------------------------------------------------------------------------------------
# Shapes

# Every shape parameter, its default (the tiny-a shape) and help text.
SHAPE_DEFAULTS = {
    "hidden_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "q_lora_rank": 64,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 16,
    "v_head_dim": 32,
    "index_n_heads": 8,
    "index_head_dim": 32,
    "index_topk": 16,
    "intermediate_size": 256,
    "moe_intermediate_size": 64,
    "n_routed_experts": 16,
    "n_shared_experts": 1,
    "num_experts_per_tok": 4,
    "n_group": 4,
    "topk_group": 2,
    "first_k_dense_replace": 1,
    "vocab_size": 512,
    "max_position_embeddings": 4096,
    "rope_theta": None,  # model-type default: 1e6 (GLM-5) or 1e4 (DeepSeek-V3.2)
    "routed_scaling_factor": 2.5,
    "rms_norm_eps": None,  # model-type default: 1e-5 (GLM-5) or 1e-6 (DeepSeek-V3.2)
    "model_type": "glm_moe_dsa",
    "num_nextn_predict_layers": 1,
    "shards": 2,
    "rope_scaling_factor": None,  # DeepSeek only: YaRN factor (absent = no rope_scaling)
    "original_max_position_embeddings": None,  # DeepSeek only, with --rope-scaling-factor
}

PRESETS = {
    # The shape of tests/data/tiny-a (the weights differ: tiny-a came from another generator).
    "tiny-a-like": {},
    # About 1.5 GB of BF16: real GLM-5 per-head MLA geometry (kv_lora 512 + rope 64 = the 576-wide
    # latent, nope/rope/v 192/64/256) and the real indexer (32 heads x 128, top-2048), 64 experts
    # top-8 without groups as GLM-5, 1 dense + 7 MoE layers, a small vocabulary, no MTP layer.
    "bench": {
        "hidden_size": 2048,
        "num_hidden_layers": 8,
        "first_k_dense_replace": 1,
        "num_attention_heads": 16,
        "q_lora_rank": 768,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 192,
        "qk_rope_head_dim": 64,
        "v_head_dim": 256,
        "index_n_heads": 32,
        "index_head_dim": 128,
        "index_topk": 2048,
        "intermediate_size": 6144,
        "moe_intermediate_size": 192,
        "n_routed_experts": 64,
        "n_shared_experts": 1,
        "num_experts_per_tok": 8,
        "n_group": 1,
        "topk_group": 1,
        "vocab_size": 16384,
        "max_position_embeddings": 202752,
        "num_nextn_predict_layers": 0,
        "shards": 4,
    },
}

NORM_STD = 0.05
KNORM_BIAS_STD = 0.02
SCORE_BIAS_STD = 0.05


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="output directory (created; existing model files are replaced)")
    p.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny-a-like",
                   help="base shape; every explicit shape option overrides it")
    p.add_argument("--tokenizer", help="a tokenizer.json file, or a directory whose tokenizer.json / "
                                       "tokenizer_config.json are copied into --out")
    p.add_argument("--indexer-types", help="GLM-5.2 IndexShare: F (full) or S (shared) per decoder layer, e.g. "
                                           "FFFSSSFS; shared layers get no indexer tensors (config indexer_types)")
    for key, default in SHAPE_DEFAULTS.items():
        flag = "--" + key.replace("_", "-")
        if key == "model_type":
            p.add_argument(flag, choices=["glm_moe_dsa", "deepseek_v32"], default=None,
                           help="default glm_moe_dsa")
        elif key in ("rope_theta", "routed_scaling_factor", "rms_norm_eps", "rope_scaling_factor"):
            p.add_argument(flag, type=float, default=None, help=f"default {default}")
        else:
            p.add_argument(flag, type=int, default=None, help=f"default {default}")
    args = p.parse_args(argv)

    cfg = dict(SHAPE_DEFAULTS)
    cfg.update(PRESETS[args.preset])
    for key in SHAPE_DEFAULTS:
        v = getattr(args, key)
        if v is not None:
            cfg[key] = v
    glm = cfg["model_type"] == "glm_moe_dsa"
    if cfg["rope_theta"] is None:
        cfg["rope_theta"] = 1e6 if glm else 1e4
    if cfg["rms_norm_eps"] is None:
        cfg["rms_norm_eps"] = 1e-5 if glm else 1e-6
    cfg["indexer_types"] = None
    if args.indexer_types is not None:
        t = args.indexer_types
        if len(t) != cfg["num_hidden_layers"] or set(t) - set("FS") or t[0] != "F" or not glm:
            p.error("--indexer-types: F or S per decoder layer, the first F (glm_moe_dsa only)")
        cfg["indexer_types"] = ["full" if ch == "F" else "shared" for ch in t]
    check_shape(cfg, p)
    return args, cfg


def check_shape(c, parser):
    def need(cond, msg):
        if not cond:
            parser.error(msg)

    for k, v in c.items():
        if isinstance(v, int) and k not in ("num_nextn_predict_layers", "first_k_dense_replace",
                                            "n_shared_experts", "original_max_position_embeddings"):
            need(v > 0, f"{k} must be > 0, got {v}")
    need(c["num_nextn_predict_layers"] in (0, 1), "num_nextn_predict_layers must be 0 or 1")
    need(0 <= c["first_k_dense_replace"] <= c["num_hidden_layers"], "first_k_dense_replace out of range")
    need(c["qk_rope_head_dim"] % 2 == 0, "qk_rope_head_dim must be even")
    need(c["index_head_dim"] >= c["qk_rope_head_dim"], "index_head_dim must be >= qk_rope_head_dim")
    need(c["n_routed_experts"] % c["n_group"] == 0, "n_routed_experts must be a multiple of n_group")
    need(c["n_routed_experts"] // c["n_group"] >= 2, "each expert group needs >= 2 experts (group score = top-2 sum)")
    need(c["topk_group"] <= c["n_group"], "topk_group must be <= n_group")
    need(c["num_experts_per_tok"] <= c["topk_group"] * (c["n_routed_experts"] // c["n_group"]),
         "num_experts_per_tok exceeds the experts in the kept groups")
    need(c["vocab_size"] >= 4, "vocab_size must be >= 4 (3 EOS ids at the top)")
    if c["model_type"] == "glm_moe_dsa":
        need(c["rope_scaling_factor"] is None, "--rope-scaling-factor is for deepseek_v32 (GLM-5 has no YaRN)")
    elif c["rope_scaling_factor"] is not None:
        need(c["original_max_position_embeddings"] is not None,
             "--rope-scaling-factor needs --original-max-position-embeddings")


# ---------------------------------------------------------------------------------------------
# Tensor inventory (spec section 2.1). Each entry: (name, shape, dtype, init, std_or_source)
#   init "normal": N(0, std^2); "norm": 1 + N(0, NORM_STD^2); "copy": same values as the named tensor.


def tensor_inventory(c):
    H = c["hidden_size"]
    nh = c["num_attention_heads"]
    qk_head = c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
    out = []

    def lin(name, rows, cols, residual=False):
        std = (0.5 if residual else 1.0) / np.sqrt(cols)
        out.append((name, [rows, cols], "BF16", "normal", std))

    def norm(name, n):
        out.append((name, [n], "BF16", "norm", NORM_STD))

    def mlp(prefix, inter):
        lin(f"{prefix}.gate_proj.weight", inter, H)
        lin(f"{prefix}.up_proj.weight", inter, H)
        lin(f"{prefix}.down_proj.weight", H, inter, residual=True)

    out.append(("model.embed_tokens.weight", [c["vocab_size"], H], "BF16", "normal", 1.0))
    n_layers = c["num_hidden_layers"] + c["num_nextn_predict_layers"]
    for i in range(n_layers):
        P = f"model.layers.{i}"
        norm(f"{P}.input_layernorm.weight", H)
        lin(f"{P}.self_attn.q_a_proj.weight", c["q_lora_rank"], H)
        norm(f"{P}.self_attn.q_a_layernorm.weight", c["q_lora_rank"])
        lin(f"{P}.self_attn.q_b_proj.weight", nh * qk_head, c["q_lora_rank"])
        lin(f"{P}.self_attn.kv_a_proj_with_mqa.weight", c["kv_lora_rank"] + c["qk_rope_head_dim"], H)
        norm(f"{P}.self_attn.kv_a_layernorm.weight", c["kv_lora_rank"])
        lin(f"{P}.self_attn.kv_b_proj.weight", nh * (c["qk_nope_head_dim"] + c["v_head_dim"]), c["kv_lora_rank"])
        lin(f"{P}.self_attn.o_proj.weight", H, nh * c["v_head_dim"], residual=True)
        shared = c["indexer_types"] is not None and i < c["num_hidden_layers"] and c["indexer_types"][i] == "shared"
        if not shared:  # a "shared" layer (IndexShare) uses the previous full layer's top-k
            lin(f"{P}.self_attn.indexer.wq_b.weight", c["index_n_heads"] * c["index_head_dim"], c["q_lora_rank"])
            lin(f"{P}.self_attn.indexer.wk.weight", c["index_head_dim"], H)
            norm(f"{P}.self_attn.indexer.k_norm.weight", c["index_head_dim"])
            out.append((f"{P}.self_attn.indexer.k_norm.bias", [c["index_head_dim"]], "BF16", "normal", KNORM_BIAS_STD))
            lin(f"{P}.self_attn.indexer.weights_proj.weight", c["index_n_heads"], H)
        norm(f"{P}.post_attention_layernorm.weight", H)
        if i < c["first_k_dense_replace"]:
            mlp(f"{P}.mlp", c["intermediate_size"])
        else:
            lin(f"{P}.mlp.gate.weight", c["n_routed_experts"], H)
            out.append((f"{P}.mlp.gate.e_score_correction_bias", [c["n_routed_experts"]], "F32", "normal",
                        SCORE_BIAS_STD))
            for e in range(c["n_routed_experts"]):
                mlp(f"{P}.mlp.experts.{e}", c["moe_intermediate_size"])
            if c["n_shared_experts"] > 0:
                mlp(f"{P}.mlp.shared_experts", c["moe_intermediate_size"] * c["n_shared_experts"])
        if i >= c["num_hidden_layers"]:  # the MTP layer
            lin(f"{P}.eh_proj.weight", H, 2 * H)
            norm(f"{P}.enorm.weight", H)
            norm(f"{P}.hnorm.weight", H)
            norm(f"{P}.shared_head.norm.weight", H)
            if c["model_type"] == "deepseek_v32":  # DeepSeek ships copies; GLM-5 does not
                out.append((f"{P}.embed_tokens.weight", [c["vocab_size"], H], "BF16", "copy",
                            "model.embed_tokens.weight"))
                out.append((f"{P}.shared_head.head.weight", [c["vocab_size"], H], "BF16", "copy", "lm_head.weight"))
    norm("model.norm.weight", H)
    out.append(("lm_head.weight", [c["vocab_size"], H], "BF16", "normal", 2.0 / np.sqrt(H)))
    return out


def nbytes(shape, dtype):
    return int(np.prod(shape)) * (2 if dtype == "BF16" else 4)


# ---------------------------------------------------------------------------------------------
# Values


def tensor_rng(seed, name):
    h = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little")
    return np.random.default_rng(np.random.SeedSequence([seed, h]))


def tensor_values(seed, entry, by_name):
    """float32 values of one tensor (before the BF16 rounding)."""
    name, shape, _, init, arg = entry
    if init == "copy":
        return tensor_values(seed, by_name[arg], by_name)
    rng = tensor_rng(seed, name)
    x = rng.standard_normal(int(np.prod(shape)), dtype=np.float32)
    if init == "norm":
        return np.float32(1.0) + np.float32(arg) * x
    return np.float32(arg) * x


def to_bf16_bytes(x):
    """float32 -> bfloat16 bit patterns, round to nearest even (no NaNs occur here)."""
    u = x.astype(np.float32, copy=False).view(np.uint32)
    u = u + (np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1)))
    return (u >> np.uint32(16)).astype("<u2").tobytes()


# ---------------------------------------------------------------------------------------------
# Shards


def shard_name(k, n, model_type):
    total = f"{n:05d}" if model_type == "glm_moe_dsa" else f"{n:06d}"
    return f"model-{k:05d}-of-{total}.safetensors"


def assign_shards(inventory, n_shards, seed):
    """Split the layer-ordered list into ~3 contiguous chunks per shard, shuffle the chunks
    (deterministically), and fill the shards in that order: tensors are not in layer order
    across shards, as in the real GLM-5 / DeepSeek releases. Returns lists of entries per shard."""
    total = sum(nbytes(e[1], e[2]) for e in inventory)
    n_chunks = min(len(inventory), 3 * n_shards)
    chunks, cur, acc = [], [], 0
    for e in inventory:
        cur.append(e)
        acc += nbytes(e[1], e[2])
        if acc >= total * (len(chunks) + 1) / n_chunks and len(chunks) < n_chunks - 1:
            chunks.append(cur)
            cur = []
    if cur:
        chunks.append(cur)
    order = np.random.default_rng(np.random.SeedSequence([seed, 0x5A4D])).permutation(len(chunks))
    flat = [e for i in order for e in chunks[i]]
    shards = [[] for _ in range(n_shards)]
    acc = 0
    for j, e in enumerate(flat):
        k = min(n_shards - 1, int(acc * n_shards // total))
        # keep every shard non-empty: leave at least one tensor per remaining shard
        k = max(k, n_shards - (len(flat) - j))
        shards[k].append(e)
        acc += nbytes(e[1], e[2])
    for k, s in enumerate(shards):
        if not s:
            raise SystemExit(f"shard {k + 1} would be empty: use fewer --shards")
    return shards


def write_shard(path, entries, seed, by_name):
    # F32 tensors first so they start 4-byte aligned (the header is padded to 8 bytes and the
    # format allows no gaps between tensors); then BF16 in assignment order.
    entries = [e for e in entries if e[2] == "F32"] + [e for e in entries if e[2] != "F32"]
    header = {"__metadata__": {"format": "pt"}}
    off = 0
    for name, shape, dtype, _, _ in entries:
        n = nbytes(shape, dtype)
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [off, off + n]}
        off += n
    hj = json.dumps(header, separators=(",", ":")).encode()
    hj += b" " * (-len(hj) % 8)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(len(hj).to_bytes(8, "little"))
        f.write(hj)
        for e in entries:
            x = tensor_values(seed, e, by_name)
            f.write(x.astype("<f4").tobytes() if e[2] == "F32" else to_bf16_bytes(x))
    os.replace(tmp, path)
    return off


# ---------------------------------------------------------------------------------------------
# Config files


def glm_config(c):
    V = c["vocab_size"]
    eos = [V - 3, V - 2, V - 1]
    cfg = {
        "architectures": ["GlmMoeDsaForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "dtype": "bfloat16",
        "eos_token_id": eos,
        "ep_size": 1,
        "first_k_dense_replace": c["first_k_dense_replace"],
        "head_dim": c["qk_rope_head_dim"],
        "hidden_act": "silu",
        "hidden_size": c["hidden_size"],
        "index_head_dim": c["index_head_dim"],
        "index_n_heads": c["index_n_heads"],
        "index_topk": c["index_topk"],
        "indexer_rope_interleave": True,
        "initializer_range": 0.02,
        "intermediate_size": c["intermediate_size"],
        "kv_lora_rank": c["kv_lora_rank"],
        "max_position_embeddings": c["max_position_embeddings"],
        "model_type": "glm_moe_dsa",
        "moe_intermediate_size": c["moe_intermediate_size"],
        "moe_layer_freq": 1,
        "n_group": c["n_group"],
        "n_routed_experts": c["n_routed_experts"],
        "n_shared_experts": c["n_shared_experts"],
        "norm_topk_prob": True,
        "num_attention_heads": c["num_attention_heads"],
        "num_experts_per_tok": c["num_experts_per_tok"],
        "num_hidden_layers": c["num_hidden_layers"],
        "num_key_value_heads": c["num_attention_heads"],
        "num_nextn_predict_layers": c["num_nextn_predict_layers"],
        "pad_token_id": eos[0],
        "pretraining_tp": 1,
        "q_lora_rank": c["q_lora_rank"],
        "qk_head_dim": c["qk_nope_head_dim"] + c["qk_rope_head_dim"],
        "qk_nope_head_dim": c["qk_nope_head_dim"],
        "qk_rope_head_dim": c["qk_rope_head_dim"],
        "rms_norm_eps": c["rms_norm_eps"],
        "rope_interleave": True,
        "rope_parameters": {"rope_theta": float(c["rope_theta"]), "rope_type": "default"},
        "routed_scaling_factor": c["routed_scaling_factor"],
        "scoring_func": "sigmoid",
        "tie_word_embeddings": False,
        "topk_group": c["topk_group"],
        "topk_method": "noaux_tc",
        "transformers_version": "5.0.2.dev0",
        "use_cache": True,
        "v_head_dim": c["v_head_dim"],
        "vocab_size": V,
    }
    if c.get("indexer_types"):
        cfg["indexer_types"] = c["indexer_types"]
    gen = {"eos_token_id": eos, "pad_token_id": eos[0], "temperature": 1.0, "top_p": 0.95,
           "transformers_version": "5.0.2.dev0"}
    return cfg, gen


def deepseek_config(c):
    cfg = {
        "architectures": ["DeepseekV32ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "ep_size": 1,
        "first_k_dense_replace": c["first_k_dense_replace"],
        "hidden_act": "silu",
        "hidden_size": c["hidden_size"],
        "index_head_dim": c["index_head_dim"],
        "index_n_heads": c["index_n_heads"],
        "index_topk": c["index_topk"],
        "initializer_range": 0.02,
        "intermediate_size": c["intermediate_size"],
        "kv_lora_rank": c["kv_lora_rank"],
        "max_position_embeddings": c["max_position_embeddings"],
        "model_type": "deepseek_v32",
        "moe_intermediate_size": c["moe_intermediate_size"],
        "moe_layer_freq": 1,
        "n_group": c["n_group"],
        "n_routed_experts": c["n_routed_experts"],
        "n_shared_experts": c["n_shared_experts"],
        "norm_topk_prob": True,
        "num_attention_heads": c["num_attention_heads"],
        "num_experts_per_tok": c["num_experts_per_tok"],
        "num_hidden_layers": c["num_hidden_layers"],
        "num_key_value_heads": c["num_attention_heads"],
        "num_nextn_predict_layers": c["num_nextn_predict_layers"],
        "q_lora_rank": c["q_lora_rank"],
        "qk_nope_head_dim": c["qk_nope_head_dim"],
        "qk_rope_head_dim": c["qk_rope_head_dim"],
        "rms_norm_eps": c["rms_norm_eps"],
        "rope_theta": c["rope_theta"] if c["rope_theta"] != int(c["rope_theta"]) else int(c["rope_theta"]),
        "routed_scaling_factor": c["routed_scaling_factor"],
        "scoring_func": "sigmoid",
        "tie_word_embeddings": False,
        "topk_group": c["topk_group"],
        "topk_method": "noaux_tc",
        "torch_dtype": "bfloat16",
        "transformers_version": "4.44.2",
        "use_cache": True,
        "v_head_dim": c["v_head_dim"],
        "vocab_size": c["vocab_size"],
    }
    if c["rope_scaling_factor"] is not None:
        f = c["rope_scaling_factor"]
        cfg["rope_scaling"] = {
            "beta_fast": 32,
            "beta_slow": 1,
            "factor": int(f) if f == int(f) else f,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "original_max_position_embeddings": c["original_max_position_embeddings"],
            "type": "yarn",
        }
    gen = {"_from_model_config": True, "bos_token_id": 0, "eos_token_id": 1, "transformers_version": "4.44.2"}
    return cfg, gen


def copy_tokenizer(src, out):
    files = [src] if os.path.isfile(src) else [
        os.path.join(src, f) for f in ("tokenizer.json", "tokenizer_config.json") if os.path.exists(os.path.join(src, f))]
    if not files:
        raise SystemExit(f"--tokenizer {src}: no tokenizer.json there")
    for f in files:
        dst = os.path.join(out, "tokenizer.json" if f == src else os.path.basename(f))
        shutil.copyfile(f, dst)


def main(argv=None):
    args, c = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    # Remove shards of an earlier run (another shard count would leave stale files).
    for f in os.listdir(args.out):
        if f.startswith("model-") and f.endswith(".safetensors"):
            os.remove(os.path.join(args.out, f))

    inventory = tensor_inventory(c)
    by_name = {e[0]: e for e in inventory}
    shards = assign_shards(inventory, c["shards"], args.seed)
    weight_map, total = {}, 0
    for k, entries in enumerate(shards, start=1):
        fname = shard_name(k, c["shards"], c["model_type"])
        total += write_shard(os.path.join(args.out, fname), entries, args.seed, by_name)
        for e in entries:
            weight_map[e[0]] = fname
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}

    cfg, gen = glm_config(c) if c["model_type"] == "glm_moe_dsa" else deepseek_config(c)
    for fname, obj in (("config.json", cfg), ("generation_config.json", gen),
                       ("model.safetensors.index.json", index)):
        with open(os.path.join(args.out, fname), "w") as f:
            json.dump(obj, f, indent=2, sort_keys=fname != "model.safetensors.index.json")
            f.write("\n")
    if args.tokenizer:
        copy_tokenizer(args.tokenizer, args.out)
    n_params = sum(int(np.prod(e[1])) for e in inventory)
    print(f"wrote {args.out}: {c['model_type']}, {len(inventory)} tensors, {n_params / 1e6:.2f} M params, "
          f"{total / 2**20:.1f} MiB in {c['shards']} shard(s), seed {args.seed}")


if __name__ == "__main__":
    main(sys.argv[1:])
