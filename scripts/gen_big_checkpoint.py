#!/usr/bin/env python3
"""A big random-weight glm_moe_dsa (GLM-5) BF16 checkpoint, fast: for conversion / loading benchmarks.

    python3 scripts/gen_big_checkpoint.py --out /tmp/big            # ~14.5 GB (13.5 GiB), 8 shards
    python3 scripts/gen_big_checkpoint.py --out /tmp/big --num-hidden-layers 3 --shards 4   # smaller

The tensor names, shapes, config.json and generation_config.json are scripts/gen_tiny_model.py's
(tensor_inventory, glm_config, assign_shards: the same HF layout, tensors not in layer order across
shards), for a bigger shape: by default hidden 4096, 6 layers (layer 0 dense, intermediate 12288),
32 heads with the real GLM-5 per-head MLA geometry (q_lora 1536, kv_lora 512, nope/rope/v
192/64/256), the real indexer (32 x 128, top-2048), 64 routed experts of 1536 (top-8, no groups),
1 shared expert, vocab 65536, no MTP layer. Every shape option of gen_tiny_model.py is accepted.

Values are not those of gen_tiny_model.py (that one draws every element from its own generator,
about 10x slower): each matrix gets N(0, std^2) values of the same std as gen_tiny_model.py's init,
made from a pool of 2^22 BF16 N(0, std^2) draws per std: every chunk of 2^20 elements is the pool
read from a random offset, its 4 low mantissa bits XORed with random bits (so values stay within
12 % of a normal draw, and chunks differ); norms and biases, which are small, are drawn element by
element. Deterministic for a --seed. Nothing bigger than one chunk (2 MiB) and the pools is ever
held; shards are written directly (safetensors header, then the tensors' bytes), as .tmp files
renamed when complete.
"""
import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gen_tiny_model as tiny  # noqa: E402

BIG = {
    "hidden_size": 4096,
    "num_hidden_layers": 6,
    "first_k_dense_replace": 1,
    "num_attention_heads": 32,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 192,
    "qk_rope_head_dim": 64,
    "v_head_dim": 256,
    "index_n_heads": 32,
    "index_head_dim": 128,
    "index_topk": 2048,
    "intermediate_size": 12288,
    "moe_intermediate_size": 1536,
    "n_routed_experts": 64,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "n_group": 1,
    "topk_group": 1,
    "vocab_size": 65536,
    "max_position_embeddings": 202752,
    "num_nextn_predict_layers": 0,
    "shards": 8,
}

POOL = 1 << 22
CHUNK = 1 << 20


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="output directory (created; existing shards are replaced)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokenizer", help="a tokenizer.json (or a directory holding one) to copy into --out")
    for key, default in tiny.SHAPE_DEFAULTS.items():
        if key in ("model_type", "rope_scaling_factor", "original_max_position_embeddings"):
            continue
        flag = "--" + key.replace("_", "-")
        typ = float if key in ("rope_theta", "routed_scaling_factor", "rms_norm_eps") else int
        p.add_argument(flag, type=typ, default=None, help=f"default {BIG.get(key, default)}")
    args = p.parse_args(argv)
    c = dict(tiny.SHAPE_DEFAULTS)
    c.update(BIG)
    for key in tiny.SHAPE_DEFAULTS:
        v = getattr(args, key, None)
        if v is not None:
            c[key] = v
    c["model_type"] = "glm_moe_dsa"
    c["rope_theta"] = c["rope_theta"] or 1e6
    c["rms_norm_eps"] = c["rms_norm_eps"] or 1e-5
    tiny.check_shape(c, p)
    return args, c


def bf16(x):
    """float32 -> bfloat16 bits, round to nearest even (finite values)."""
    u = x.astype(np.float32, copy=False).view(np.uint32)
    return ((u + (np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1)))) >> np.uint32(16)).astype("<u2")


class Values:
    def __init__(self, seed):
        self.seed = seed
        self.pools = {}
        self.noise = (np.random.default_rng([seed, 1]).integers(0, 1 << 16, 2 * POOL, dtype=np.uint16)
                      & np.uint16(0x000F))

    def pool(self, std):
        key = float(std)
        if key not in self.pools:
            rng = np.random.default_rng([self.seed, 2, int(key * 1e9)])
            z = rng.standard_normal(POOL + CHUNK, dtype=np.float32)
            self.pools[key] = bf16(np.float32(key) * z)
        return self.pools[key]

    def write(self, f, entry):
        """Writes one tensor's bytes to f."""
        name, shape, dtype, init, arg = entry
        n = int(np.prod(shape))
        rng = tiny.tensor_rng(self.seed, name)
        if init == "norm" or dtype == "F32" or n < CHUNK:  # small: element by element
            x = rng.standard_normal(n, dtype=np.float32)
            x = (np.float32(1.0) + np.float32(arg) * x) if init == "norm" else np.float32(arg) * x
            f.write(x.astype("<f4").tobytes() if dtype == "F32" else bf16(x).tobytes())
            return
        assert init == "normal" and dtype == "BF16", entry
        pool = self.pool(arg)
        done = 0
        while done < n:
            m = min(CHUNK, n - done)
            a, b = rng.integers(0, POOL, 2)
            f.write((pool[a:a + m] ^ self.noise[b:b + m]).tobytes())
            done += m


def write_shard(path, entries, values):
    entries = [e for e in entries if e[2] == "F32"] + [e for e in entries if e[2] != "F32"]
    header = {"__metadata__": {"format": "pt"}}
    off = 0
    for name, shape, dtype, _, _ in entries:
        nb = tiny.nbytes(shape, dtype)
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [off, off + nb]}
        off += nb
    hj = json.dumps(header, separators=(",", ":")).encode()
    hj += b" " * (-len(hj) % 8)
    tmp = path + ".tmp"
    with open(tmp, "wb", buffering=8 << 20) as f:
        f.write(len(hj).to_bytes(8, "little"))
        f.write(hj)
        for e in entries:
            values.write(f, e)
    os.replace(tmp, path)
    return off


def main(argv=None):
    args, c = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    for f in os.listdir(args.out):
        if f.startswith("model-") and (f.endswith(".safetensors") or f.endswith(".tmp")):
            os.remove(os.path.join(args.out, f))
    t0 = time.time()
    inventory = tiny.tensor_inventory(c)
    shards = tiny.assign_shards(inventory, c["shards"], args.seed)
    values = Values(args.seed)
    weight_map, total = {}, 0
    for k, entries in enumerate(shards, start=1):
        fname = tiny.shard_name(k, c["shards"], c["model_type"])
        total += write_shard(os.path.join(args.out, fname), entries, values)
        for e in entries:
            weight_map[e[0]] = fname
        print(f"  {fname}: {len(entries)} tensors, {total / 1e9:.2f} GB so far, {time.time() - t0:.0f} s", flush=True)
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    cfg, gen = tiny.glm_config(c)
    for fname, obj in (("config.json", cfg), ("generation_config.json", gen),
                       ("model.safetensors.index.json", index)):
        with open(os.path.join(args.out, fname), "w") as f:
            json.dump(obj, f, indent=2, sort_keys=fname != "model.safetensors.index.json")
            f.write("\n")
    if args.tokenizer:
        tiny.copy_tokenizer(args.tokenizer, args.out)
    biggest = max(inventory, key=lambda e: tiny.nbytes(e[1], e[2]))
    n_params = sum(int(np.prod(e[1])) for e in inventory)
    print(f"wrote {args.out}: {len(inventory)} tensors, {n_params / 1e9:.3f} B params, {total / 1e9:.3f} GB "
          f"({total / 2**30:.2f} GiB) in {c['shards']} shards, largest tensor {biggest[0]} "
          f"{tiny.nbytes(biggest[1], biggest[2]) / 2**20:.0f} MiB, {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main(sys.argv[1:])
