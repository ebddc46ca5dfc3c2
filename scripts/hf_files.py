"""The files of a Hugging Face safetensors checkpoint, for the scripts that rewrite one."""
import json
import os
import re


def natural_key(name):
    """Sort key that orders model.layers.10 after model.layers.9."""
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def shards(model_dir):
    """{file name: [tensor names]} of a single-file or sharded checkpoint, in the index's order
    (a single model.safetensors maps to None: all of its tensors)."""
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if not os.path.exists(index):
        return {"model.safetensors": None}
    files = {}
    for name, file in json.load(open(index))["weight_map"].items():
        files.setdefault(file, []).append(name)
    return files


def write_index(out_dir, layout, weight_map, total_size):
    """model.safetensors.index.json for a rewritten checkpoint, when the input had one (its shards()
    layout was not the single model.safetensors): weight_map {tensor: file}, sorted by name."""
    if layout == {"model.safetensors": None}:
        return
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
        json.dump(index, f, indent=2)
        f.write("\n")
