#!/usr/bin/env python3
# A trained checkpoint (tests/data/glm5-kjv) against Hugging Face transformers' GlmMoeDsaForCausalLM (float32,
# CPU, the pinned version): logits on a real-text prompt longer than index_topk (so the indexer drops keys),
# and perplexity over a text file with the windows `glm5 perplexity` uses (launcher/perplexity/perplexity.h).
#
#   golden:      writes <model>/golden.safetensors, compact: prompt_ids I32 [P] (the first P tokens of the
#                text), logit_rows I32 [R], logits F32 [R, vocab] (HF's prefill logits at those rows),
#                decode_tokens I32 [N], decode_logits F32 [N, vocab] (greedy through HF's cache, golden
#                convention of tests/data/tiny-a). Rows whose indexer selection is a near tie in some layer
#                (k-th and (k+1)-th score within a relative 1e-4) are left out: float32 rounding may pick
#                either key there. Exact ties (keys every indexer head's ReLU zeroes) are broken as glm5
#                breaks them (the lower index first): torch.topk leaves their order unspecified.
#   check:       runs `glm5 generate --dump-logits` and `glm5 perplexity --json` (the binary given by
#                --glm5) and compares: prefill logits within 1e-4 (absolute) of HF's on every row that is
#                not a near tie, perplexity within a relative 1e-4. Exit 1 otherwise.
#
# Pinned: scripts/requirements.txt (torch 2.15.0, transformers 5.13.0, tokenizers 0.22.1, numpy 2.4.6).
# Exit code 77 when torch or transformers is missing (ctest reports the test as skipped).

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile

try:
    import numpy as np
    import torch
    import transformers  # noqa: F401
    from transformers import AutoModelForCausalLM
except ImportError as e:  # the test is skipped where torch is absent
    print(f"skipped: {e}", file=sys.stderr)
    sys.exit(77)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_hf_golden import Recorder  # noqa: E402  (the indexer-score hooks)

NEAR_TIE = 1e-4


def load(model_dir, threads):
    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    return model


def text_tokens(model_dir, path):
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    with open(path, encoding="utf-8") as f:
        return tok.encode(f.read(), add_special_tokens=False).ids


def tie_rows(rec, n_layers, P, k):
    """Rows (positions) whose top-k boundary is a near tie in some layer: the k-th and (k+1)-th scores
    differ, but by less than NEAR_TIE relative, so that float32 rounding may order them either way.
    Exact ties (mostly keys every head's ReLU zeroes) are broken by the rule both sides share."""
    bad = set()
    for i in range(n_layers):
        sc = rec.scores[i][0].double().numpy()  # [P, P], mask added
        for p in range(k, P):
            s = np.sort(sc[p, : p + 1])[::-1]
            gap = s[k - 1] - s[k]
            if 0 < gap / max(abs(s[k - 1]), abs(s[k]), 1e-30) < NEAR_TIE:
                bad.add(p)
    return bad


def stable_topk(x, k, dim=-1, largest=True, sorted=True):
    """torch.topk with glm5's tie rule (kernels/ops.h): larger value first, equal values to the lower index.
    torch.topk's order among equal values is unspecified; the indexer's ReLU makes exact ties common (keys
    that every head scores <= 0), so both sides must break them the same way to be compared."""
    assert largest
    idx = torch.sort(x, dim=dim, descending=True, stable=True).indices.narrow(dim, 0, k)
    return torch.return_types.topk((x.gather(dim, idx), idx))


def hf_prefill(model, ids):
    rec = Recorder(torch, model)
    rec._orig_topk = rec._orig_tensor_topk = stable_topk  # the indexer's top-k only (Recorder's wrappers)
    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids]), use_cache=True)
    cfg = model.config
    ties = tie_rows(rec, cfg.num_hidden_layers, len(ids), cfg.index_topk)
    return out, ties


def write_golden(args):
    from safetensors.numpy import save_file
    model = load(args.model, args.threads)
    ids = text_tokens(args.model, args.text)[: args.prompt_len]
    out, ties = hf_prefill(model, ids)
    logits = out.logits[0].numpy()
    P = len(ids)
    rows = sorted({r for r in list(range(0, P, args.every)) + list(range(P - args.last, P)) if r not in ties})
    cache, tok, dec_tokens, dec_logits = out.past_key_values, int(np.argmax(logits[-1])), [], []
    with torch.no_grad():
        for i in range(args.decode_steps):
            dec_tokens.append(tok)
            o = model(input_ids=torch.tensor([[tok]]), past_key_values=cache, use_cache=True,
                      position_ids=torch.tensor([[P + i]]))
            cache = o.past_key_values
            dec_logits.append(o.logits[0, -1].numpy())
            tok = int(np.argmax(dec_logits[-1]))
    save_file({"prompt_ids": np.asarray(ids, np.int32), "logit_rows": np.asarray(rows, np.int32),
               "logits": np.ascontiguousarray(logits[rows], np.float32),
               "decode_tokens": np.asarray(dec_tokens, np.int32),
               "decode_logits": np.stack(dec_logits).astype(np.float32)},
              os.path.join(args.model, "golden.safetensors"),
              metadata={"producer": f"scripts/check_trained_vs_hf.py golden (transformers "
                                    f"{transformers.__version__}, torch {torch.__version__}, float32, eager)",
                        "prompt": f"first {P} tokens of {os.path.basename(args.text)}",
                        "near_tie_rows_left_out": str(sorted(ties))})
    print(f"golden: {P} prompt tokens, {len(rows)} logit rows, {len(ties)} near-tie rows left out, "
          f"{args.decode_steps} decode steps")


def hf_perplexity(model, ids, ctx, stride, chunks):
    """The windows of launcher/perplexity/perplexity.h: start every stride, length ctx, score the last
    min(stride, ctx - ctx/2 - 1) (llama-perplexity's count for stride = ctx)."""
    score = min(stride, ctx - ctx // 2 - 1)
    nll = []
    starts = list(range(0, len(ids) - ctx + 1, stride))
    if chunks:
        starts = starts[:chunks]
    with torch.no_grad():
        for s in starts:
            w = ids[s:s + ctx]
            lp = torch.log_softmax(model(input_ids=torch.tensor([w])).logits[0].double(), -1).numpy()
            nll += [-lp[p - 1, w[p]] for p in range(ctx - score, ctx)]
    return math.exp(float(np.mean(nll))), len(nll)


def run_json(cmd):
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stderr[-2000:]}")
    return r.stdout


def check(args):
    from safetensors.numpy import load_file
    model = load(args.model, args.threads)
    ids = text_tokens(args.model, args.text)[: args.prompt_len]
    out, ties = hf_prefill(model, ids)
    hf = out.logits[0].numpy()
    with tempfile.TemporaryDirectory() as tmp:
        dump = os.path.join(tmp, "dump.safetensors")
        run_json([args.glm5, "generate", "--model", args.model, "--prompt-ids", ",".join(map(str, ids)),
                  "--max-new-tokens", "1", "--temperature", "0", "--dump-logits", dump])
        ours = load_file(dump)["prefill_logits"]
    rows = [r for r in range(len(ids)) if r not in ties]
    diff = float(np.max(np.abs(ours[rows] - hf[rows])))
    ok = diff < 1e-4
    print(f"logits: {len(ids)}-token prompt, {len(rows)} rows compared ({len(ties)} near ties left out), "
          f"max |glm5 - HF| = {diff:.3g} ({'ok' if ok else 'FAIL'}, limit 1e-4)")
    all_ids = text_tokens(args.model, args.text)
    hf_ppl, n = hf_perplexity(model, all_ids, args.ctx, args.stride or args.ctx, args.chunks)
    cmd = [args.glm5, "perplexity", "--model", args.model, "--file", args.text, "--ctx", str(args.ctx), "--json"]
    if args.stride:
        cmd += ["--stride", str(args.stride)]
    if args.chunks:
        cmd += ["--chunks", str(args.chunks)]
    ours_ppl = json.loads(run_json(cmd).strip().splitlines()[-1])
    rel = abs(ours_ppl["perplexity"] - hf_ppl) / hf_ppl
    ok_ppl = rel < 1e-4 and ours_ppl["tokens_scored"] == n
    print(f"perplexity: HF {hf_ppl:.6f}, glm5 {ours_ppl['perplexity']:.6f} over {n} tokens "
          f"(relative difference {rel:.3g}, {'ok' if ok_ppl else 'FAIL'}, limit 1e-4)")
    sys.exit(0 if ok and ok_ppl else 1)


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("mode", choices=["golden", "check"])
    ap.add_argument("--model", required=True)
    ap.add_argument("--text", required=True, help="text file (held-out text)")
    ap.add_argument("--prompt-len", type=int, default=1100)
    ap.add_argument("--every", type=int, default=32, help="golden: every n-th logit row")
    ap.add_argument("--last", type=int, default=16, help="golden: and the last n rows")
    ap.add_argument("--decode-steps", type=int, default=8)
    ap.add_argument("--glm5", help="check: the glm5 binary")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--stride", type=int, default=0)
    ap.add_argument("--chunks", type=int, default=0, help="check: only the first n windows (0: all)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    if transformers.__version__ != "5.13.0":
        print(f"skipped: transformers {transformers.__version__}, the check needs the pinned 5.13.0", file=sys.stderr)
        sys.exit(77)
    write_golden(args) if args.mode == "golden" else check(args)


if __name__ == "__main__":
    main()
