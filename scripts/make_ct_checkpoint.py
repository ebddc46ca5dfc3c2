#!/usr/bin/env python3
"""Write a compressed-tensors `pack-quantized` (W4A16 / W8A16) checkpoint with compressed-tensors' own code.

    python3 scripts/make_ct_checkpoint.py --model DIR --out DIR --bits 4 --group-size 32

The routed and shared expert Linear weights (model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight
and model.layers.N.mlp.shared_experts.*) are quantized the way llm-compressor's round-to-nearest path
does it: per-group min/max in the weight's dtype -> calculate_qparams (symmetric int, scale dtype =
weight dtype) -> PackedQuantizationCompressor.compress_weight (quantize + pack_to_int32). Every other
tensor is copied unchanged, in the input's shard layout. config.json gets the quantization_config that
compressed-tensors' ModelCompressor.update_config writes (what llm-compressor's save_pretrained
writes): one group targeting "Linear", `ignore` listing every other Linear (2-D `.weight`, not an
embedding), the routers `mlp.gate` included. Needs scripts/requirements-quant.txt.
"""
import argparse
import glob
import json
import os
import re
import shutil

import torch
from compressed_tensors.compressors import ModelCompressor, PackedQuantizationCompressor
from compressed_tensors.quantization import (
    QuantizationArgs,
    QuantizationConfig,
    QuantizationScheme,
)
from compressed_tensors.quantization.utils import calculate_qparams
from safetensors import safe_open
from safetensors.torch import save_file

from hf_files import natural_key, shards, write_index

EXPERT = re.compile(r"model\.layers\.\d+\.mlp\.(experts\.\d+|shared_experts)\.(gate|up|down)_proj\.weight")
FORMAT = "pack-quantized"


def quantize(w, args, compressor):
    """compressed-tensors' symmetric group quantization of one [rows, cols] weight."""
    if w.ndim != 2 or w.shape[1] % args.group_size:
        raise SystemExit(f"cannot group-quantize a weight of shape {list(w.shape)} with group {args.group_size}")
    groups = w.unflatten(-1, (-1, args.group_size))  # what the min-max observer reduces over
    scale, zero_point = calculate_qparams(groups.amin(-1), groups.amax(-1), args)
    out = compressor.compress_weight(weight=w, scale=scale, zero_point=zero_point, quantization_args=args)
    out["weight_scale"] = scale  # the compressor keeps the scale as is; symmetric: no zero point stored
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="input (BF16) checkpoint directory")
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--bits", type=int, choices=(4, 8), default=4)
    ap.add_argument("--group-size", type=int, default=128)
    a = ap.parse_args()

    args = QuantizationArgs(num_bits=a.bits, type="int", symmetric=True, strategy="group", group_size=a.group_size)
    layout = shards(a.model)
    os.makedirs(a.out, exist_ok=True)
    compressor = PackedQuantizationCompressor()
    weight_map, total, linears = {}, 0, []
    for file, names in layout.items():
        tensors = {}
        with safe_open(os.path.join(a.model, file), "pt") as f:
            for name in names if names is not None else f.keys():
                w = f.get_tensor(name)
                if name.endswith(".weight") and w.ndim == 2 and not name.endswith("embed_tokens.weight"):
                    linears.append(name.removesuffix(".weight"))
                if EXPERT.fullmatch(name):
                    prefix = name.removesuffix("weight")
                    tensors.update({prefix + k: v for k, v in quantize(w, args, compressor).items()})
                else:
                    tensors[name] = w
        save_file(tensors, os.path.join(a.out, file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, file))
        total += sum(t.numel() * t.element_size() for t in tensors.values())
    write_index(a.out, layout, weight_map, total)

    quantized = {n.removesuffix(".weight_packed") for n in weight_map if n.endswith(".weight_packed")}
    if not quantized:
        raise SystemExit("no expert weights found to quantize")
    qconfig = QuantizationConfig(
        config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=args, format=FORMAT)},
        format=FORMAT,
        quantization_status="compressed",
        ignore=sorted((n for n in linears if n not in quantized), key=natural_key),
    )
    for extra in ["config.json", "generation_config.json", "special_tokens_map.json", "chat_template.jinja"]:
        if os.path.exists(os.path.join(a.model, extra)):
            shutil.copy(os.path.join(a.model, extra), a.out)
    for tok in glob.glob(os.path.join(a.model, "tokenizer*")):
        shutil.copy(tok, a.out)
    ModelCompressor(quantization_config=qconfig).update_config(a.out)  # adds quantization_config
    print(f"{len(quantized)} weights quantized to int{a.bits} (group {a.group_size}), "
          f"{len(qconfig.ignore)} Linear weights left as they were; wrote {a.out}")


if __name__ == "__main__":
    main()
