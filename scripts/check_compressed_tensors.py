#!/usr/bin/env python3
"""Check glm5's int dequantization against the compressed-tensors package itself.

    python3 scripts/check_compressed_tensors.py --packed DIR --dequantized DIR

For every `X.weight_packed` in --packed (a compressed-tensors `pack-quantized` checkpoint), decompress it
with compressed-tensors (PackedQuantizationCompressor.decompress_weight, QuantizationArgs of the config
group whose targets match X), widen to float32 and compare bit for bit (NaN == NaN) with the F32
`X.weight` in --dequantized, e.g. what `glm5 convert --quant f32` writes from --packed. Exit status 1
on any difference, or when --packed holds no packed weight. Needs scripts/requirements-quant.txt.
"""
import argparse
import json
import os
import sys

import torch
from compressed_tensors.compressors import PackedQuantizationCompressor
from compressed_tensors.quantization import QuantizationConfig
from compressed_tensors.utils import is_match
from safetensors import safe_open


class Checkpoint:
    """Tensors of a single-file or sharded safetensors checkpoint, by name."""

    def __init__(self, d):
        index = os.path.join(d, "model.safetensors.index.json")
        if os.path.exists(index):
            files = {n: os.path.join(d, f) for n, f in json.load(open(index))["weight_map"].items()}
        else:
            with safe_open(os.path.join(d, "model.safetensors"), "pt") as f:
                files = dict.fromkeys(f.keys(), os.path.join(d, "model.safetensors"))
        self.files, self.open = files, {}

    def names(self):
        return sorted(self.files)

    def __contains__(self, name):
        return name in self.files

    def __getitem__(self, name):
        file = self.files[name]
        if file not in self.open:
            self.open[file] = safe_open(file, "pt")
        return self.open[file].get_tensor(name)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--packed", required=True, help="compressed-tensors pack-quantized checkpoint")
    ap.add_argument("--dequantized", required=True, help="F32 checkpoint with the dequantized weights")
    a = ap.parse_args()

    config = json.load(open(os.path.join(a.packed, "config.json"))).get("quantization_config")
    if config is None:
        print(f"no quantization_config in {a.packed}/config.json")
        return 1
    qconfig = QuantizationConfig.model_validate(config)
    groups = list(qconfig.config_groups.values())
    linear = torch.nn.Linear(1, 1, device="meta")  # every packed weight belongs to a Linear
    compressor = PackedQuantizationCompressor(config=qconfig)
    packed, deq = Checkpoint(a.packed), Checkpoint(a.dequantized)

    tensors = elements = bad = 0
    for name in packed.names():
        if not name.endswith(".weight_packed"):
            continue
        module = name.removesuffix(".weight_packed")
        matching = [g for g in groups if is_match(module, linear, g.targets)]
        if not matching and len(groups) == 1:
            matching = groups  # fall back to the only group
        if len(matching) != 1 or (matching[0].format or qconfig.format) != "pack-quantized":
            print(f"{module}: {len(matching)} matching pack-quantized config groups")
            bad += 1
            continue
        data = {p: packed[f"{module}.{p}"] for p in compressor.compression_param_names if f"{module}.{p}" in packed}
        want = compressor.decompress_weight(data, quantization_args=matching[0].weights).float()
        got = deq[f"{module}.weight"] if f"{module}.weight" in deq else None
        tensors, elements = tensors + 1, elements + want.numel()
        if is_match(module, linear, qconfig.ignore):
            print(f"{module}: packed, but in the config's ignore list")
            bad += 1
        elif got is None or got.dtype != torch.float32 or got.shape != want.shape:
            what = "missing" if got is None else f"{got.dtype} {list(got.shape)}"
            print(f"{module}.weight: {what} in --dequantized, expected torch.float32 {list(want.shape)}")
            bad += 1
        else:
            same = (got.view(torch.int32) == want.view(torch.int32)) | (got.isnan() & want.isnan())
            if not same.all():
                diff = (got.double() - want.double()).abs()[~same]
                print(f"{module}.weight: {int((~same).sum())} elements differ, max abs diff {diff.max().item():.6g}")
                bad += 1
    if tensors == 0:
        print(f"no *.weight_packed tensor in {a.packed}")
        return 1
    print(f"{tensors} tensors, {elements} elements: " + (f"{bad} tensors differ" if bad else "all equal"))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
