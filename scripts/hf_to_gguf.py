#!/usr/bin/env python3
# Convert a GLM-5 (glm_moe_dsa) checkpoint in the Hugging Face layout (BF16 safetensors, as written by
# gen_tiny_model.py) to an F32 GGUF that llama.cpp's `glm-dsa` architecture loads, so that llama.cpp can
# be measured beside glm5 on the same weights. Quantize the result with llama.cpp's own tool:
#   llama-quantize OUT.f32.gguf OUT.Q8_0.gguf Q8_0      (or Q4_K_M, BF16)
#
# numpy + the `gguf` package only (no torch; pinned in scripts/requirements-gguf.txt). Tensors are read
# through memory maps and written one at a time, so the model never sits in memory as a whole.
# Leaves out: NextN/MTP layers (layers >= num_hidden_layers), tokenizers (the GGUF says "no_vocab":
# llama-bench feeds token ids), FP8 checkpoints, DeepSeek-V3.2 configs.
"""Convert a GLM-5 HF checkpoint to an F32 GGUF for llama.cpp (glm-dsa).

Usage:
  python3 scripts/hf_to_gguf.py MODEL_DIR OUT.gguf
"""

import argparse
import json
import os
import struct
import sys

import numpy as np

import gguf

ARCH = gguf.MODEL_ARCH.GLM_DSA
ARCH_NAME = gguf.MODEL_ARCH_NAMES[ARCH]  # "glm-dsa"

# ---------------------------------------------------------------------------------------------
# Reading safetensors without torch


class Checkpoint:
    """Every tensor of a (sharded) safetensors checkpoint, by name, as memory-mapped numpy views."""

    def __init__(self, model_dir):
        index = os.path.join(model_dir, "model.safetensors.index.json")
        if os.path.exists(index):
            with open(index) as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
        else:
            files = ["model.safetensors"]
        self.entries = {}  # name -> (memmap of the file's data, dtype, shape, begin, end)
        for fname in files:
            path = os.path.join(model_dir, fname)
            with open(path, "rb") as f:
                (header_len,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(header_len))
            data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + header_len)
            for name, meta in header.items():
                if name == "__metadata__":
                    continue
                begin, end = meta["data_offsets"]
                self.entries[name] = (data, meta["dtype"], tuple(meta["shape"]), begin, end)

    def names(self):
        return self.entries.keys()

    def shape(self, name):
        return self.entries[name][2]

    def f32(self, name):
        """The tensor as float32 (BF16 widened exactly)."""
        data, dtype, shape, begin, end = self.entries[name]
        raw = data[begin:end]
        if dtype == "BF16":
            return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(shape)
        if dtype == "F16":
            return raw.view(np.float16).astype(np.float32).reshape(shape)
        if dtype == "F32":
            return np.array(raw.view(np.float32).reshape(shape))
        raise SystemExit(f"{name}: dtype {dtype} is not supported (BF16, F16, F32 only)")


# ---------------------------------------------------------------------------------------------
# Metadata


def write_metadata(w, c):
    """The keys llama.cpp's glm-dsa loader reads (src/models/glm-dsa.cpp and llama-model.cpp)."""
    L = c["num_hidden_layers"]
    rope = c["qk_rope_head_dim"]
    kv_lora = c["kv_lora_rank"]
    rope_theta = (c.get("rope_parameters") or {}).get("rope_theta", c.get("rope_theta"))
    if rope_theta is None:
        raise SystemExit("config.json has no rope_theta (nor rope_parameters.rope_theta)")

    w.add_name(c.get("_name_or_path") or "glm5")
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_block_count(L)
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(c["num_attention_heads"])
    w.add_head_count_kv(1)  # MLA is run as MQA over the latent
    w.add_rope_freq_base(float(rope_theta))
    w.add_rope_dimension_count(rope)
    w.add_layer_norm_rms_eps(float(c["rms_norm_eps"]))
    w.add_vocab_size(c["vocab_size"])

    # MoE
    w.add_leading_dense_block_count(c["first_k_dense_replace"])
    w.add_expert_count(c["n_routed_experts"])
    w.add_expert_used_count(c["num_experts_per_tok"])
    w.add_expert_shared_count(c["n_shared_experts"])
    w.add_expert_feed_forward_length(c["moe_intermediate_size"])
    w.add_expert_group_count(c.get("n_group", 1))
    w.add_expert_group_used_count(c.get("topk_group", 1))
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    w.add_expert_weights_scale(float(c["routed_scaling_factor"]))
    w.add_expert_weights_norm(bool(c.get("norm_topk_prob", True)))

    # MLA: llama.cpp's "key/value length" is the latent (MQA) view; the _mla ones the per-head view
    w.add_q_lora_rank(c["q_lora_rank"])
    w.add_kv_lora_rank(kv_lora)
    w.add_key_length(kv_lora + rope)
    w.add_value_length(kv_lora)
    w.add_key_length_mla(c["qk_nope_head_dim"] + rope)
    w.add_value_length_mla(c["v_head_dim"])

    # DSA indexer: which layers run their own ("full", True); without this key llama.cpp takes a
    # context of >= 1M as GLM-5.2's shared-indexer layout. gguf 0.19 has no constant for it.
    types = c.get("indexer_types") or ["full"] * L
    if any(t != "full" for t in types[:L]):
        raise SystemExit("hf_to_gguf: indexer_types has shared layers (GLM-5.2 IndexShare): not converted")
    w.add_indexer_head_count(c["index_n_heads"])
    w.add_indexer_key_length(c["index_head_dim"])
    w.add_indexer_top_k(c["index_topk"])
    w.add_array(f"{ARCH_NAME}.attention.indexer.types", [True] * L)

    w.add_tokenizer_model("no_vocab")  # token ids only; llama.cpp makes vocab_size dummy tokens


# ---------------------------------------------------------------------------------------------
# Tensors


def tensor_plan(ckpt, c):
    """[(gguf name, numpy shape, function returning the float32 array)], in file order."""
    L = c["num_hidden_layers"]
    H = c["num_attention_heads"]
    nope, v = c["qk_nope_head_dim"], c["v_head_dim"]
    E = c["n_routed_experts"]
    names = gguf.get_tensor_name_map(ARCH, L)
    plan = []

    def add(gguf_name, shape, fn):
        plan.append((gguf_name, tuple(shape), fn))

    def layer_of(hf):
        return int(hf.split(".")[2]) if hf.startswith("model.layers.") else -1

    for hf in sorted(ckpt.names(), key=lambda n: (layer_of(n), n)):
        if layer_of(hf) >= L:
            continue  # NextN/MTP layer: not converted
        if hf.endswith("weight_scale_inv"):
            raise SystemExit("FP8 checkpoints are not supported: convert from BF16")
        if ".mlp.experts." in hf:
            continue  # stacked below
        shape = ckpt.shape(hf)

        if hf.endswith("self_attn.kv_b_proj.weight"):
            # [H * (nope + v), kv_lora], per head [nope | v] rows -> k_b [H, kv_lora, nope], v_b [H, v, kv_lora]
            kv_lora = shape[1]
            base = hf[: -len(".kv_b_proj.weight")]
            k_name = names.get_name(base + ".k_b_proj.weight", try_suffixes=(".weight",))
            v_name = names.get_name(base + ".v_b_proj.weight", try_suffixes=(".weight",))

            def heads(n=hf, kv_lora=kv_lora):
                return ckpt.f32(n).reshape(H, nope + v, kv_lora)

            add(k_name, (H, kv_lora, nope), lambda heads=heads: heads()[:, :nope, :].transpose(0, 2, 1))
            add(v_name, (H, v, kv_lora), lambda heads=heads: heads()[:, nope:, :])
            continue

        if hf.endswith("mlp.gate.e_score_correction_bias"):
            # ...mlp.gate.e_score_correction -> blk.N.exp_probs_b, stored as its ".bias"
            gguf_name = names.get_name(hf[: -len("_bias")]) + ".bias"
        else:
            gguf_name = names.get_name(hf, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise SystemExit(f"no GGUF name for {hf}")
        add(gguf_name, shape, lambda n=hf: ckpt.f32(n))

    # Routed experts of each MoE layer, stacked into [E, out, in] (ffn_{gate,up,down}_exps).
    for layer in range(c["first_k_dense_replace"], L):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            parts = [f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight" for e in range(E)]
            name = names.get_name(f"model.layers.{layer}.mlp.experts.{proj}.weight", try_suffixes=(".weight",))
            add(name, (E,) + ckpt.shape(parts[0]), lambda parts=parts: np.stack([ckpt.f32(q) for q in parts]))
    return plan


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model_dir", help="HF-layout checkpoint directory (config.json + safetensors)")
    p.add_argument("out", help="output .gguf file (float32 tensors)")
    a = p.parse_args(argv)

    with open(os.path.join(a.model_dir, "config.json")) as f:
        c = json.load(f)
    if c.get("model_type") != "glm_moe_dsa":
        raise SystemExit(f"model_type {c.get('model_type')!r}: only glm_moe_dsa (GLM-5) is supported")
    rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise SystemExit(f"rope type {rope.get('rope_type', rope.get('type'))!r}: only the default RoPE is supported")

    if c["index_head_dim"] < 64 or c["index_head_dim"] != 2 * c["qk_rope_head_dim"]:
        # llama.cpp's glm-dsa graph views the indexer head's nope part at an offset of nope (not rope)
        # dims, and smaller heads fail too (tiny-a: GGML_ASSERT(ggml_can_mul_mat(a, b))). The file is
        # still written: it is llama.cpp's limit, not the checkpoint's.
        print(f"warning: index_head_dim {c['index_head_dim']} with qk_rope_head_dim {c['qk_rope_head_dim']}: "
              "llama.cpp (6ea215d) loads only index_head_dim = 2 x qk_rope_head_dim >= 64", file=sys.stderr)

    ckpt = Checkpoint(a.model_dir)
    plan = tensor_plan(ckpt, c)

    w = gguf.GGUFWriter(a.out, ARCH_NAME)
    write_metadata(w, c)
    for name, shape, _ in plan:
        w.add_tensor_info(name, shape, np.dtype(np.float32), int(np.prod(shape)) * 4)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for i, (name, shape, fn) in enumerate(plan):
        x = np.ascontiguousarray(fn(), dtype=np.float32)
        if x.shape != shape:
            raise SystemExit(f"{name}: shape {x.shape}, planned {shape}")
        w.write_tensor_data(x)
        if (i + 1) % 50 == 0 or i + 1 == len(plan):
            print(f"\r{i + 1}/{len(plan)} tensors", end="", file=sys.stderr, flush=True)
    w.close()
    n_params = sum(int(np.prod(s)) for _, s, _ in plan)
    print(f"\nwrote {a.out}: {ARCH_NAME}, {len(plan)} tensors, {n_params / 1e6:.2f} M params, float32")


if __name__ == "__main__":
    main()
