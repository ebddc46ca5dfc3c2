#!/usr/bin/env python3
"""Write a GLM-5-FP8 style (DeepSeek-V3 block FP8) checkpoint from a BF16 one, with torch's own FP8 cast.

    python3 scripts/make_fp8_checkpoint.py --model tests/data/tiny-a --out tests/data/tiny-a-fp8

Independent of `glm5 convert`: a second implementation of the layout of zai-org/GLM-5-FP8 (the
DeepSeek-V3 block-FP8 scheme; DeepSeek-V3.2-Exp's inference/model.py `weight_dequant` is the
reference), to test our loader and converter against.

Quantized (F8_E4M3 `X.weight` [out, in] + F32 `X.weight_scale_inv` [ceil(out/128), ceil(in/128)]),
in every layer, the MTP layer included: self_attn.{q_a_proj, q_b_proj, kv_a_proj_with_mqa, kv_b_proj,
o_proj}, self_attn.indexer.{wq_b, wk}, the dense MLP's {gate, up, down}_proj, every routed expert's
and the shared experts' {gate, up, down}_proj. Everything else is copied byte for byte: embeddings,
lm_head, every norm (and the indexer's k_norm weight and bias), the router mlp.gate.weight,
indexer.weights_proj, the MTP layer's eh_proj / enorm / hnorm / shared_head.norm (and DeepSeek's MTP
embed_tokens / shared_head.head copies), e_score_correction_bias in its own dtype.

Quantization, DeepSeek style, per 128 x 128 block (edge blocks partial, no padding stored), in float32:
    amax  = max |w| over the block                     (w = the BF16 weight widened to float32)
    scale = amax / 448      (1.0 for an all-zero block, so that q = 0 there)
    q     = (w / scale).to(torch.float8_e4m3fn)        (torch's cast: round to nearest even)
    stored: q, and scale as `weight_scale_inv`; the value is q.float() * scale (multiply).
|w / scale| <= 448 (up to one float32 rounding, which the cast still rounds to 448), so no NaN occurs;
the script checks it.

The input's shard layout is kept: each output shard holds the same tensors as the input shard of the
same name, each quantized weight with its `_scale_inv` beside it; model.safetensors.index.json maps
the new names. config.json is the input's plus the quantization_config of the FP8 release:
    {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
     "weight_block_size": [128, 128], "modules_to_not_convert": [...]}
with modules_to_not_convert built like the real list (the pattern of the GLM-5.2-FP8 audit, 541
entries there): per layer input_layernorm, post_attention_layernorm, self_attn.q_a_layernorm,
self_attn.kv_a_layernorm; per MoE layer mlp.gate and mlp.gate.e_score_correction_bias; per layer
with an indexer self_attn.indexers_proj (sic: the release's misspelling, it names no tensor; the
tensor meant is self_attn.indexer.weights_proj), self_attn.indexer.k_norm,
self_attn.indexer.k_norm.bias; for the MTP layer enorm, hnorm, eh_proj, shared_head.norm; then
model.embed_tokens, model.norm, lm_head. Other files of the model directory (tokenizer,
generation_config.json, chat template, ...) are copied, except README.md and golden.* (reference
outputs of the BF16 weights, wrong for these). Deterministic: a rerun gives the same bytes.

Needs torch and safetensors (scripts/requirements-quant.txt).
"""
import argparse
import json
import os
import re
import shutil

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from hf_files import natural_key, shards, write_index

BLOCK = 128
FP8_MAX = 448.0

QUANTIZED = re.compile(
    r"model\.layers\.\d+\.(?:"
    r"self_attn\.(?:q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj)"
    r"|self_attn\.indexer\.(?:wq_b|wk)"
    r"|mlp\.(?:gate_proj|up_proj|down_proj)"
    r"|mlp\.experts\.\d+\.(?:gate_proj|up_proj|down_proj)"
    r"|mlp\.shared_experts\.(?:gate_proj|up_proj|down_proj)"
    r")\.weight")
LAYER = re.compile(r"model\.layers\.(\d+)\.")
SKIP_FILES = {"config.json", "model.safetensors.index.json", "README.md"}


def block_scales(w):
    """w float32 [rows, cols] -> the per-block scale [ceil(rows/128), ceil(cols/128)] and its
    element-wise expansion [rows, cols]."""
    rows, cols = w.shape
    br, bc = -(-rows // BLOCK), -(-cols // BLOCK)
    padded = torch.zeros(br * BLOCK, bc * BLOCK, dtype=torch.float32)
    padded[:rows, :cols] = w.abs()
    amax = padded.view(br, BLOCK, bc, BLOCK).amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    full = scale.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:rows, :cols]
    return scale.contiguous(), full


def quantize(name, w):
    if w.ndim != 2:
        raise SystemExit(f"{name}: expected a 2-D weight, got shape {list(w.shape)}")
    if w.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise SystemExit(f"{name}: expected a BF16/F16/F32 weight, got {w.dtype} (already quantized?)")
    wf = w.to(torch.float32)
    scale, full = block_scales(wf)
    x = wf / full
    if not bool(torch.isfinite(x).all()) or float(x.abs().max()) > 464.0:
        raise SystemExit(f"{name}: non-finite or out-of-range quotient")
    q = x.to(torch.float8_e4m3fn)
    if bool(torch.isnan(q.float()).any()):
        raise SystemExit(f"{name}: NaN after the FP8 cast")
    return q, scale


def not_convert_list(names, n_main_layers):
    """modules_to_not_convert in the release's pattern, for the tensors present."""
    present = set(names)
    layers = sorted({int(m.group(1)) for n in names for m in [LAYER.match(n)] if m})
    out = []
    for i in layers:
        P = f"model.layers.{i}"
        for m in ("input_layernorm", "post_attention_layernorm", "self_attn.q_a_layernorm",
                  "self_attn.kv_a_layernorm"):
            if f"{P}.{m}.weight" in present:
                out.append(f"{P}.{m}")
        if f"{P}.mlp.gate.weight" in present:
            out += [f"{P}.mlp.gate", f"{P}.mlp.gate.e_score_correction_bias"]
        if f"{P}.self_attn.indexer.weights_proj.weight" in present:
            out += [f"{P}.self_attn.indexers_proj", f"{P}.self_attn.indexer.k_norm",
                    f"{P}.self_attn.indexer.k_norm.bias"]
        if i >= n_main_layers:
            for m in ("enorm", "hnorm", "eh_proj", "shared_head.norm"):
                if f"{P}.{m}.weight" in present:
                    out.append(f"{P}.{m}")
    for m in ("model.embed_tokens", "model.norm", "lm_head"):
        if f"{m}.weight" in present:
            out.append(m)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="input (BF16) checkpoint directory")
    ap.add_argument("--out", required=True, help="output directory (created)")
    a = ap.parse_args()
    if os.path.abspath(a.model) == os.path.abspath(a.out):
        raise SystemExit("--out must differ from --model")

    config = json.load(open(os.path.join(a.model, "config.json")))
    if "quantization_config" in config:
        raise SystemExit(f"{a.model}: already has a quantization_config")
    layout = shards(a.model)
    os.makedirs(a.out, exist_ok=True)
    weight_map, total, all_names, n_quant = {}, 0, [], 0
    for file, names in layout.items():
        tensors = {}
        with safe_open(os.path.join(a.model, file), "pt") as f:
            for name in names if names is not None else f.keys():
                w = f.get_tensor(name)
                all_names.append(name)
                if name.endswith("_scale_inv"):
                    raise SystemExit(f"{name}: the input is already FP8")
                if QUANTIZED.fullmatch(name):
                    q, scale = quantize(name, w)
                    tensors[name] = q
                    tensors[name + "_scale_inv"] = scale
                    n_quant += 1
                else:
                    tensors[name] = w
        save_file(tensors, os.path.join(a.out, file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, file))
        total += sum(t.numel() * t.element_size() for t in tensors.values())
    write_index(a.out, layout, weight_map, total)

    qc = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
          "weight_block_size": [BLOCK, BLOCK],
          "modules_to_not_convert": not_convert_list(sorted(all_names, key=natural_key),
                                                     int(config["num_hidden_layers"]))}
    keys = list(config)
    config["quantization_config"] = qc
    if keys == sorted(keys):  # HF writes sorted keys: keep it so
        config = dict(sorted(config.items()))
    with open(os.path.join(a.out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")

    shard_files = set(layout)
    for n in sorted(os.listdir(a.model)):
        p = os.path.join(a.model, n)
        if (not os.path.isfile(p) or n in SKIP_FILES or n in shard_files or n.startswith("golden")
                or n.startswith(".")):
            continue
        shutil.copyfile(p, os.path.join(a.out, n))
    print(f"{n_quant} weights quantized to FP8 E4M3 (128x128 blocks), {len(all_names) - n_quant} tensors "
          f"copied, {len(qc['modules_to_not_convert'])} modules_to_not_convert; {total / 2**20:.2f} MiB "
          f"in {len(layout)} shard(s); wrote {a.out}")


if __name__ == "__main__":
    main()
