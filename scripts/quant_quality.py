#!/usr/bin/env python3
"""What quantization costs, measured with glm5 itself: each model converted with `glm5 convert` to
int8 / int4 (group 32, 64, 128) / fp8 and compared with its BF16 original on

  - a fixed token stream (256 tokens, fewer if the context is shorter, sampled from the BF16 model at temperature 1, seed 7), run
    teacher-forced through each model: mean KL(bf16 || quantized) of the next-token
    distributions, top-1 agreement, and the perplexity of the stream under each model;
  - 256 greedy steps from the same prompt: the share of steps whose token equals BF16's, and the
    first step where they differ.

Usage: scripts/quant_quality.py --glm5 build/glm5 --work /tmp/quality MODEL_DIR...   (numpy only)
Prints a Markdown table. Random-weight models have no outlier channels, so they understate what
quantization costs a trained model."""
import argparse
import json
import os
import re
import subprocess
import sys

import numpy as np

from ref_forward_f64 import read_safetensors  # numpy only: F32 -> float64, I32 -> int

QUANTS = [
    ("int8 g128", ["--quant", "int8", "--group-size", "128"]),
    ("int4 g128", ["--quant", "int4", "--group-size", "128"]),
    ("int4 g64", ["--quant", "int4", "--group-size", "64"]),
    ("int4 g32", ["--quant", "int4", "--group-size", "32"]),
    ("fp8 experts", ["--quant", "fp8"]),
    ("fp8 (GLM-5-FP8 roles)", ["--quant", "fp8", "--quantize", "attention,indexer,dense,experts,shared"]),
]
STEPS = 256


def glm5(args, *cmd):
    r = subprocess.run([args.glm5, *cmd], capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"glm5 {' '.join(cmd)} failed:\n{r.stderr}")
    return r.stdout + r.stderr


def run(args, model, prompt, dump, new_tokens, temperature="0", seed="0"):
    glm5(args, "generate", "--model", model, "--prompt-ids", ",".join(map(str, prompt)), "--max-new-tokens",
         str(new_tokens), "--temperature", temperature, "--seed", seed, "--ignore-eos", "--dump-logits", dump)
    return read_safetensors(dump)


def log_softmax(x):
    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--glm5", default="build/glm5")
    ap.add_argument("--work", default="/tmp/glm5-quality")
    ap.add_argument("models", nargs="+")
    args = ap.parse_args()
    os.makedirs(args.work, exist_ok=True)
    print("| model | weights | matrices converted | KL(bf16 ‖ q) mean | top-1 agreement | perplexity (bf16 → q) | greedy agreement | first divergence |")
    print("|---|---|---|---|---|---|---|---|")
    for model in args.models:
        name = os.path.basename(os.path.normpath(model))
        config = json.load(open(os.path.join(model, "config.json")))
        vocab = config["vocab_size"]
        prompt = [1 + (7 * i) % (vocab - 1) for i in range(8)]
        steps = min(STEPS, config["max_position_embeddings"] - len(prompt) - 1)
        # The token stream: sampled from the BF16 model.
        sampled = run(args, model, prompt, f"{args.work}/{name}-stream.st", steps, temperature="1", seed="7")
        stream = prompt + [int(t) for t in sampled["decode_tokens"]]
        base_tf = run(args, model, stream, f"{args.work}/{name}-bf16-tf.st", 1)["prefill_logits"]
        base_greedy = run(args, model, prompt, f"{args.work}/{name}-bf16-greedy.st", steps)["decode_tokens"]
        targets = np.array(stream[1:])
        lp_base = log_softmax(base_tf[:-1])
        ppl_base = float(np.exp(-lp_base[np.arange(len(targets)), targets].mean()))
        for label, flags in QUANTS:
            out = f"{args.work}/{name}-" + "".join(ch if ch.isalnum() else "-" for ch in label)
            if not os.path.exists(os.path.join(out, "model.safetensors.index.json")):
                log = glm5(args, "convert", "--no-progress", "--model", model, "--out", out, *flags)
                open(os.path.join(out, "convert.log"), "w").write(log)
            m = re.search(r"(\d+) of (\d+) tensors converted", open(os.path.join(out, "convert.log")).read())
            converted = f"{m.group(1)} of {m.group(2)}" if m else "?"
            tf = run(args, out, stream, f"{out}/tf.st", 1)["prefill_logits"]
            greedy = run(args, out, prompt, f"{out}/greedy.st", steps)["decode_tokens"]
            lp = log_softmax(tf[:-1])
            kl = float((np.exp(lp_base) * (lp_base - lp)).sum(axis=-1).mean())
            top1 = float((lp_base.argmax(-1) == lp.argmax(-1)).mean())
            ppl = float(np.exp(-lp[np.arange(len(targets)), targets].mean()))
            same = base_greedy == greedy
            first = int(np.argmin(same)) if not same.all() else steps
            print(f"| {name} | {label} | {converted} | {kl:.2e} | {100 * top1:.1f} % | {ppl_base:.3f} → {ppl:.3f} "
                  f"({ppl - ppl_base:+.3f}) | {100 * same.mean():.1f} % of {steps} | {'none' if first == steps else first} |",
                  flush=True)


if __name__ == "__main__":
    main()
