#!/usr/bin/env python3
# Reference outputs for a checkpoint, computed by Hugging Face transformers (GlmMoeDsaForCausalLM, or
# DeepseekV32ForCausalLM for deepseek_v32) in float32 on the CPU: prefill logits, greedy decode
# through the KV cache, and the intermediate values the tiny-a golden carries (layer outputs,
# indexer and expert selections), in the tensor names and conventions of tests/data/tiny-a.
# Leaves out: the MTP layer (HF does not build it), bf16 paths, batch > 1.
#
# Pinned (see scripts/requirements.txt):
#   transformers==5.13.0  first PyPI release with huggingface/transformers#46842 (GLM indexer RoPE
#                         interleaved); it also has #46372 (MLA RoPE interleaved)
#   torch==2.15.0         PyPI wheel, used on the CPU only
#   numpy==2.4.6
"""Write golden.safetensors + golden.json for a glm_moe_dsa / deepseek_v32 checkpoint.

Example (from the repository root):
  python3 scripts/make_hf_golden.py --model tests/data/tiny-b --prompt-len 100 --prompt-seed 2000 \
      --decode-steps 12
  python3 scripts/make_hf_golden.py --model tests/data/tiny-a --prompt-len 64 --prompt-seed 1000 \
      --decode-steps 16 --out /tmp/hf-tiny-a --compare tests/data/tiny-a/golden.safetensors

Conventions (as tests/data/tiny-a/README.md): the prompt is
numpy.random.default_rng(prompt_seed).integers(0, vocab_size, size=prompt_len), prefilled from
position 0 with no BOS; decode_tokens[0] = argmax(prefill_logits[-1]), decode_tokens[i+1] =
argmax(decode_logits[i]); decode_logits[i] = logits after feeding decode_tokens[i] at position
prompt_len + i through HF's cache; EOS is ignored. Index sets are sorted ascending, -1 padded.
"""

import argparse
import hashlib
import inspect
import json
import os
import platform
import re
import struct
import sys
import time

import numpy as np

PINS = {"transformers": "5.13.0", "torch": "2.15.0", "numpy": "2.4.6"}
NEAR_TIE = 1e-3  # relative gap below which a selection is listed as a near tie


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="checkpoint directory (config.json + shards + index)")
    p.add_argument("--out", help="output directory for golden.safetensors / golden.json (default: --model)")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--prompt-seed", type=int, default=1000)
    p.add_argument("--decode-steps", type=int, default=16)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    p.add_argument("--compare", help="an existing golden.safetensors: print and record the max abs "
                                     "difference of every tensor both files have")
    p.add_argument("--allow-other-versions", action="store_true",
                   help="run even if transformers/torch differ from the pinned versions")
    p.add_argument("--no-write", action="store_true", help="compute and compare only")
    return p.parse_args(argv)


# ---------------------------------------------------------------------------------------------
# safetensors by hand (numpy): the checkpoint reader used for the weight check, and the writer


DT = {"F32": np.float32, "I32": np.int32, "I64": np.int64, "F64": np.float64}


def read_safetensors(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, m in header.items():
        if name == "__metadata__":
            continue
        a, b = m["data_offsets"]
        buf = data[a:b]
        if m["dtype"] == "BF16":
            x = (np.frombuffer(buf, "<u2").astype(np.uint32) << 16).view(np.float32)
        else:
            x = np.frombuffer(buf, np.dtype(DT[m["dtype"]]).newbyteorder("<"))
        out[name] = x.reshape(m["shape"])
    return out


def write_safetensors(path, tensors):
    names = sorted(tensors)
    header = {"__metadata__": {"format": "pt"}}
    blobs, off = [], 0
    for n in names:
        x = np.ascontiguousarray(tensors[n])
        dt = {np.dtype(np.float32): "F32", np.dtype(np.int32): "I32"}[x.dtype]
        b = x.astype(x.dtype.newbyteorder("<")).tobytes()
        header[n] = {"dtype": dt, "shape": list(x.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    hj = json.dumps(header, separators=(",", ":")).encode()
    hj += b" " * (-len(hj) % 8)
    with open(path, "wb") as f:
        f.write(len(hj).to_bytes(8, "little"))
        f.write(hj)
        for b in blobs:
            f.write(b)


def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------
# Capturing HF intermediates without changing HF's computation


class Recorder:
    """Forward hooks on the decoder layers, the final norm, every indexer and every router.
    The indexer's scores are taken from the argument of its final topk call (torch.topk and
    Tensor.topk are wrapped only while an indexer runs)."""

    def __init__(self, torch, model):
        self.torch = torch
        self.layers = model.model.layers
        self.reset()
        self.in_indexer = None
        self._orig_topk = torch.topk
        self._orig_tensor_topk = torch.Tensor.topk
        rec = self

        def topk_fn(x, *a, **kw):
            if rec.in_indexer is not None:
                rec.scores[rec.in_indexer] = x.detach().float().clone()
            return rec._orig_topk(x, *a, **kw)

        def tensor_topk(x, *a, **kw):
            if rec.in_indexer is not None:
                rec.scores[rec.in_indexer] = x.detach().float().clone()
            return rec._orig_tensor_topk(x, *a, **kw)

        self._topk_fn, self._tensor_topk = topk_fn, tensor_topk
        self.moe_layers = []
        self.donor = {}  # "shared" indexer layer (GLM-5.2 IndexShare) -> the full layer whose top-k it uses
        for i, layer in enumerate(self.layers):
            layer.register_forward_hook(self._layer_hook(i))
            idx = layer.self_attn.indexer
            if idx is None:
                self.donor[i] = self.donor.get(i - 1, i - 1)
            else:
                idx.register_forward_pre_hook(self._indexer_pre(i))
                idx.register_forward_hook(self._indexer_post(i))
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None and hasattr(gate, "e_score_correction_bias"):
                self.moe_layers.append(i)
                gate.register_forward_hook(self._router_hook(i))
        model.model.norm.register_forward_hook(self._norm_hook)

    def reset(self):
        self.layer_out, self.final_hidden = {}, None
        self.topk, self.scores, self.router = {}, {}, {}

    def share(self):
        """After a forward: a shared layer's selection (and its scores) are its donor's."""
        for i, d in self.donor.items():
            self.topk[i], self.scores[i] = self.topk[d], self.scores[d]

    def _layer_hook(self, i):
        def hook(mod, inp, out):
            h = out[0] if isinstance(out, tuple) else out
            self.layer_out[i] = h.detach()[0].float().clone()
        return hook

    def _norm_hook(self, mod, inp, out):
        self.final_hidden = out.detach()[0].float().clone()

    def _indexer_pre(self, i):
        def hook(mod, inp):
            self.in_indexer = i
            self.torch.topk = self._topk_fn
            self.torch.Tensor.topk = self._tensor_topk
        return hook

    def _indexer_post(self, i):
        def hook(mod, inp, out):
            self.in_indexer = None
            self.torch.topk = self._orig_topk
            self.torch.Tensor.topk = self._orig_tensor_topk
            self.topk[i] = out.detach()[0].long().clone()  # [S, min(index_topk, T)]
        return hook

    def _router_hook(self, i):
        def hook(mod, inp, out):
            logits, _, idx = out
            self.router[i] = (logits.detach().float().clone(), idx.detach().long().clone(),
                              mod.e_score_correction_bias.detach().float().clone())
        return hook


def index_sets(topk_rows, positions, k):
    """HF's raw top-k rows [S, <=k] -> sorted causal sets [S, k], -1 padded."""
    out = np.full((len(positions), k), -1, np.int32)
    for r, p in enumerate(positions):
        s = sorted(int(t) for t in topk_rows[r] if t <= p)
        out[r, : len(s)] = s
    return out


# ---------------------------------------------------------------------------------------------
# Margins (how far each selection is from flipping)


def indexer_margins(scores_rows, positions, k):
    """scores_rows [S, T] with HF's mask already added. One entry per row that really drops keys."""
    res = []
    for r, p in enumerate(positions):
        s = np.asarray(scores_rows[r][: p + 1], np.float64)
        if len(s) <= k:
            continue
        srt = np.sort(s)[::-1]
        gap = srt[k - 1] - srt[k]
        res.append({"position": int(p), "abs_gap": float(gap),
                    "rel_to_kth": float(gap / max(abs(srt[k - 1]), abs(srt[k]), 1e-30)),
                    "rel_to_row_max": float(gap / max(np.max(np.abs(s)), 1e-30))})
    return res


def router_margins(logits, bias, n_group, topk_group, top_k):
    """logits [T, E] (float32 from HF) -> per token (expert_gap, group_gap or None)."""
    s = 1.0 / (1.0 + np.exp(-np.asarray(logits, np.float64))) + np.asarray(bias, np.float64)
    T, E = s.shape
    out = []
    for t in range(T):
        b = s[t].copy()
        ggap = None
        if n_group > 1:
            g = np.sort(b.reshape(n_group, E // n_group), axis=1)[:, ::-1][:, :2].sum(1)
            order = np.argsort(-g, kind="stable")
            if topk_group < n_group:
                ggap = float(g[order[topk_group - 1]] - g[order[topk_group]])
            keep = np.zeros(n_group, bool)
            keep[order[:topk_group]] = True
            b = np.where(np.repeat(keep, E // n_group), b, -np.inf)
        srt = np.sort(b)[::-1]
        egap = float(srt[top_k - 1] - srt[top_k]) if np.isfinite(srt[top_k]) else float("inf")
        out.append((egap, ggap, float(srt[top_k - 1])))
    return out


def summarize_indexer(entries):
    if not entries:
        return {"count": 0}
    worst = min(entries, key=lambda e: e["rel_to_kth"])
    return {
        "count": len(entries),
        "min_rel_to_kth": min(e["rel_to_kth"] for e in entries),
        "min_rel_to_row_max": min(e["rel_to_row_max"] for e in entries),
        "min_abs": min(e["abs_gap"] for e in entries),
        f"n_rel_to_kth_below_{NEAR_TIE}": sum(e["rel_to_kth"] < NEAR_TIE for e in entries),
        f"n_rel_to_row_max_below_{NEAR_TIE}": sum(e["rel_to_row_max"] < NEAR_TIE for e in entries),
        "worst_layer_pos": [worst["layer"], worst["position"]],
    }


# ---------------------------------------------------------------------------------------------


def rope_kind(fn):
    """Which RoPE helper an installed HF forward() calls (read from its source)."""
    src = inspect.getsource(fn)
    if "apply_rotary_pos_emb_interleave(" in src:
        return "interleaved (apply_rotary_pos_emb_interleave)"
    if "apply_rotary_pos_emb(" in src:
        return "half-split (apply_rotary_pos_emb)"
    return "unknown"


def check_weights(model, model_dir, n_layers):
    """Every parameter/buffer HF loaded equals the checkpoint tensor (upcast to F32).
    Returns (n_checked, skipped checkpoint names)."""
    idx = json.load(open(os.path.join(model_dir, "model.safetensors.index.json")))
    ckpt = {}
    for f in sorted(set(idx["weight_map"].values())):
        ckpt.update(read_safetensors(os.path.join(model_dir, f)))
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    used, checked, problems = set(), 0, []
    for k, v in sd.items():
        m = re.fullmatch(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)", k)
        if m:
            P = f"model.layers.{m.group(1)}.mlp.experts"
            for e in range(v.shape[0]):
                if m.group(2) == "gate_up_proj":
                    names = [f"{P}.{e}.gate_proj.weight", f"{P}.{e}.up_proj.weight"]
                    ref = np.concatenate([ckpt[n] for n in names], axis=0)
                else:
                    names = [f"{P}.{e}.down_proj.weight"]
                    ref = ckpt[names[0]]
                if not np.array_equal(v[e], ref):
                    problems.append(f"{k}[{e}]")
                used.update(names)
                checked += 1
            continue
        if k not in ckpt:
            problems.append(f"{k}: not in the checkpoint")
            continue
        if v.shape != ckpt[k].shape or not np.array_equal(v, ckpt[k].astype(np.float32)):
            problems.append(f"{k}: differs from the checkpoint")
        used.add(k)
        checked += 1
    if problems:
        raise SystemExit("HF did not load the checkpoint as stored:\n  " + "\n  ".join(problems[:20]))
    skipped = sorted(set(ckpt) - used)
    for n in skipped:
        m = re.match(r"model\.layers\.(\d+)\.", n)
        if not (m and int(m.group(1)) >= n_layers):
            raise SystemExit(f"checkpoint tensor {n} was not loaded by HF")
    return checked, skipped


def compute(args):
    """Run HF on args.model; returns (tensors, golden.json dict). Loads torch/transformers lazily."""
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    versions = {"transformers": transformers.__version__, "torch": torch.__version__.split("+")[0],
                "numpy": np.__version__}
    bad = {k: v for k, v in versions.items() if v != PINS[k]}
    if bad and not args.allow_other_versions:
        raise SystemExit(f"pinned {PINS}, found {versions}: install scripts/requirements.txt "
                         f"or pass --allow-other-versions")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg_json = json.load(open(os.path.join(args.model, "config.json")))
    mt = cfg_json["model_type"]
    if mt not in ("glm_moe_dsa", "deepseek_v32"):
        raise SystemExit(f"{args.model}/config.json: model_type {mt!r}, expected glm_moe_dsa or deepseek_v32")

    t0 = time.time()
    config = AutoConfig.from_pretrained(args.model)
    model, load_info = AutoModelForCausalLM.from_pretrained(
        args.model, config=config, dtype=torch.float32, attn_implementation="eager", output_loading_info=True)
    model.eval()
    L = config.num_hidden_layers
    V = config.vocab_size
    K = config.index_topk
    n_checked, skipped = check_weights(model, args.model, L)
    missing = sorted(load_info.get("missing_keys", []))
    if missing:
        raise SystemExit(f"HF reports missing weights: {missing[:10]}")

    # Semantics HF actually uses, read from the instantiated modules.
    a0 = model.model.layers[0].self_attn
    semantics = {
        "model_class": type(model).__name__,
        "attn_implementation": "eager",
        "eps": {
            "input_layernorm / post_attention_layernorm": model.model.layers[0].input_layernorm.variance_epsilon,
            "model.norm": model.model.norm.variance_epsilon,
            "q_a_layernorm": a0.q_a_layernorm.variance_epsilon,
            "kv_a_layernorm": a0.kv_a_layernorm.variance_epsilon,
            "indexer.k_norm (LayerNorm with bias)": a0.indexer.k_norm.eps,
        },
        "mla_softmax_scale": a0.scaling,
        "rope_inv_freq": [float(x) for x in model.model.rotary_emb.inv_freq],
        "rope_attention_scaling": float(model.model.rotary_emb.attention_scaling),
        "indexer_rope": rope_kind(type(a0.indexer).forward),
        "mla_rope": rope_kind(type(a0).forward),
        "indexer": "scores = relu(q.k * index_head_dim^-0.5), weighted by weights_proj(x) * index_n_heads^-0.5, "
                   "summed over heads, causal mask added, torch.topk(min(index_topk, T)); no Hadamard, no FP8",
        "router": "sigmoid(fp32 logits) + e_score_correction_bias for selection (groups: top-2 sum), "
                  "unbiased weights / (sum + 1e-20) * routed_scaling_factor",
        "mla_path": "non-absorbed (k_nope, v expanded per head) in prefill and decode; DynamicCache",
        "mtp_layer": "not built by HF; its tensors are reported as unexpected keys and not used",
    }
    want_indexer = "interleaved" if mt == "glm_moe_dsa" else "half-split"
    if not semantics["indexer_rope"].startswith(want_indexer) or not semantics["mla_rope"].startswith("interleaved"):
        raise SystemExit(f"installed transformers applies {semantics['indexer_rope']} RoPE in the indexer and "
                         f"{semantics['mla_rope']} in MLA; {mt} needs {want_indexer} / interleaved "
                         f"(huggingface/transformers#46842, #46372)")
    # The spec gives the eps of these norms explicitly; flag any difference from the spec.
    spec_eps = {"q_a_layernorm": 1e-6, "kv_a_layernorm": 1e-6, "indexer.k_norm (LayerNorm with bias)": 1e-6,
                "model.norm": cfg_json["rms_norm_eps"],
                "input_layernorm / post_attention_layernorm": cfg_json["rms_norm_eps"]}
    eps_diff = {k: [semantics["eps"][k], v] for k, v in spec_eps.items() if abs(semantics["eps"][k] - v) > 1e-12}

    rec = Recorder(torch, model)
    prompt = np.random.default_rng(args.prompt_seed).integers(0, V, size=args.prompt_len).astype(np.int32)
    P, N = args.prompt_len, args.decode_steps

    idx_entries = {"prefill": [], "decode": [], "last": []}
    router_entries = []
    with torch.no_grad():
        out = model(input_ids=torch.tensor(prompt[None].astype(np.int64)), use_cache=True)
        rec.share()
        prefill_logits = out.logits[0].float().numpy().copy()
        cache = out.past_key_values
        positions = list(range(P))
        layer_out = np.stack([rec.layer_out[i].numpy() for i in range(L)])
        final_hidden = rec.final_hidden.numpy().copy()
        prefill_topk = np.stack([index_sets(rec.topk[i].numpy(), positions, K) for i in range(L)])
        scores_last = np.stack([rec.scores[i][0, -1].numpy() for i in range(L)])
        for i in range(L):
            if i in rec.donor:  # its donor's margins are counted once
                continue
            sc = rec.scores[i][0].numpy()
            for e in indexer_margins(sc, positions, K):
                idx_entries["prefill"].append(dict(e, layer=i, phase="prefill"))
            for e in indexer_margins(sc[-1:], [P - 1], K):
                idx_entries["last"].append(dict(e, layer=i, phase="prefill"))
        moe_experts = []
        for i in rec.moe_layers:
            logits, idx, bias = rec.router[i]
            moe_experts.append(np.sort(idx.numpy(), axis=1).astype(np.int32))
            for t, (eg, gg, sel) in enumerate(router_margins(logits.numpy(), bias.numpy(), config.n_group,
                                                             config.topk_group, config.num_experts_per_tok)):
                router_entries.append({"phase": "prefill", "layer": i, "position": t, "expert_gap": eg,
                                       "group_gap": gg, "selected_min": sel})

        decode_tokens = np.zeros(N, np.int32)
        decode_logits = np.zeros((N, V), np.float32)
        decode_topk = np.full((N, L, K), -1, np.int32)
        greedy_gaps = []
        last = prefill_logits[-1]
        for step in range(N):
            srt = np.sort(last)[::-1]
            greedy_gaps.append(float(srt[0] - srt[1]))
            tok = int(np.argmax(last))
            decode_tokens[step] = tok
            rec.reset()
            out = model(input_ids=torch.tensor([[tok]]), past_key_values=cache, use_cache=True)
            rec.share()
            cache = out.past_key_values
            last = out.logits[0, -1].float().numpy().copy()
            decode_logits[step] = last
            pos = P + step
            for i in range(L):
                decode_topk[step, i] = index_sets(rec.topk[i].numpy(), [pos], K)[0]
                if i in rec.donor:
                    continue
                for e in indexer_margins(rec.scores[i][0].numpy(), [pos], K):
                    idx_entries["decode"].append(dict(e, layer=i, phase="decode"))
            for i in rec.moe_layers:
                logits, _, bias = rec.router[i]
                for eg, gg, sel in router_margins(logits.numpy(), bias.numpy(), config.n_group,
                                                  config.topk_group, config.num_experts_per_tok):
                    router_entries.append({"phase": "decode", "layer": i, "position": pos, "expert_gap": eg,
                                           "group_gap": gg, "selected_min": sel})

        # Cross-check of HF's own cache path: the whole sequence in one uncached forward.
        full = np.concatenate([prompt, decode_tokens]).astype(np.int64)
        rec.reset()
        nocache = model(input_ids=torch.tensor(full[None]), use_cache=False).logits[0].float().numpy()
    # Row P + i of the uncached forward sees decode_tokens[i] at position P + i, as decode_logits[i].
    cache_vs_nocache = {
        "prompt_rows_max_abs": float(np.abs(nocache[:P] - prefill_logits).max()),
        "decode_rows_max_abs": float(np.abs(nocache[P: P + N] - decode_logits).max()) if N else 0.0,
    }

    tensors = {
        "prompt_ids": prompt,
        "prefill_logits": prefill_logits,
        "decode_tokens": decode_tokens,
        "decode_logits": decode_logits,
        "prefill_layer_output": layer_out.astype(np.float32),
        "prefill_final_hidden": final_hidden.astype(np.float32),
        "prefill_indexer_topk": prefill_topk,
        "decode_indexer_topk": decode_topk,
        "indexer_topk_last": prefill_topk[:, -1, :].copy(),
        "indexer_scores_last": scores_last.astype(np.float32),
    }
    if rec.moe_layers:
        tensors["prefill_moe_experts"] = np.stack(moe_experts)

    compare = None
    if args.compare:
        other = read_safetensors(args.compare)
        compare = {"file": os.path.relpath(args.compare), "tensors": {}}
        for k in sorted(set(other) & set(tensors)):
            a, b = tensors[k], other[k]
            if a.shape != tuple(b.shape):
                compare["tensors"][k] = {"shape_mismatch": [list(a.shape), list(b.shape)]}
            elif a.dtype == np.int32:
                compare["tensors"][k] = {"equal": bool(np.array_equal(a, b)),
                                         "n_differing": int((a != b).sum())}
            else:
                compare["tensors"][k] = {"max_abs": float(np.abs(a - b).max())}
        compare["only_in_other"] = sorted(set(other) - set(tensors))

    egaps = [r["expert_gap"] for r in router_entries]
    ggaps = [r["group_gap"] for r in router_entries if r["group_gap"] is not None]
    near = [e for ph in ("prefill", "decode") for e in idx_entries[ph]
            if e["rel_to_kth"] < NEAR_TIE or e["rel_to_row_max"] < NEAR_TIE]
    near_router = [r for r in router_entries if r["expert_gap"] < NEAR_TIE
                   or (r["group_gap"] is not None and r["group_gap"] < NEAR_TIE)]
    margins = {
        "indexer_last_prompt_row": summarize_indexer(idx_entries["last"]),
        "indexer_all_prefill_rows": summarize_indexer(idx_entries["prefill"]),
        "indexer_decode_rows": summarize_indexer(idx_entries["decode"]),
        "router_decisions": len(router_entries),
        "router_min_expert_gap": min(egaps) if egaps else None,
        f"router_n_expert_gap_below_{NEAR_TIE}": sum(g < NEAR_TIE for g in egaps),
        "router_min_group_gap": min(ggaps) if ggaps else None,
        f"router_n_group_gap_below_{NEAR_TIE}": sum(g < NEAR_TIE for g in ggaps),
        "router_min_selected_score_plus_bias": min((r["selected_min"] for r in router_entries), default=None),
        "greedy_min_top1_top2_logit_gap": min(greedy_gaps) if greedy_gaps else None,
    }
    shards = sorted(set(json.load(open(os.path.join(args.model, "model.safetensors.index.json")))["weight_map"].values()))
    meta = {
        "format": 1,
        "producer": "scripts/make_hf_golden.py (Hugging Face transformers, float32, CPU, eager attention)",
        "command": "python3 " + " ".join([os.path.relpath(sys.argv[0])] + sys.argv[1:]),
        "versions": dict(versions, python=platform.python_version()),
        "pinned": PINS,
        "checkpoint": {
            "config": cfg_json,
            "sha256": {f: sha256_file(os.path.join(args.model, f)) for f in ["config.json"] + shards},
            "hf_weights_checked_equal": n_checked,
            "tensors_not_used": len(skipped),
            "tensors_not_used_rule": "the MTP layer (layer index >= num_hidden_layers)",
            "hf_unexpected_keys": len(load_info.get("unexpected_keys", [])),
        },
        "hf_semantics": semantics,
        "differences_from_spec": {
            "eps": eps_diff or "none: HF uses the eps values of spec section 3 and tests/data/tiny-a",
            "notes": [
                "HF skips the indexer's Hadamard rotation and FP8 quantisation (exact in float32 up to rounding).",
                "HF masks with finfo(float32).min instead of -inf; with at least one key per row this changes nothing.",
                "HF does not build the MTP layer; its _keys_to_ignore_on_load_unexpected is "
                f"{getattr(type(model), '_keys_to_ignore_on_load_unexpected', None)}, so the MTP layer of a "
                "checkpoint with another layer count is reported as unexpected keys, and ignored all the same.",
                "HF computes RoPE cos/sin in float32 from inv_freq = 1/theta^(2i/d) (float32).",
            ],
        },
        "run": {
            "prompt_len": P,
            "prompt_seed": args.prompt_seed,
            "prompt_rule": "numpy.random.default_rng(prompt_seed).integers(0, vocab_size, size=prompt_len)",
            "decode_steps": N,
            "batch": 1,
            "start_pos_of_prompt": 0,
            "decode": "greedy: decode_tokens[0] = argmax(prefill_logits[-1]); decode_tokens[i] = "
                      "argmax(decode_logits[i-1]); decode_logits[i] = logits after feeding decode_tokens[i] at "
                      "position prompt_len + i (one token per step, HF DynamicCache). EOS ignored.",
            "threads": args.threads,
            "seconds": round(time.time() - t0, 2),
        },
        "tensors": {k: {"dtype": "I32" if v.dtype == np.int32 else "F32", "shape": list(v.shape)}
                    for k, v in sorted(tensors.items())},
        "tensor_meanings": {
            "prefill_layer_output": "residual stream after each decoder layer (prefill)",
            "prefill_final_hidden": "after the final RMSNorm, before lm_head",
            "prefill_indexer_topk": "per layer and prompt row, the indexer's chosen key positions, sorted "
                                    "ascending, -1 where fewer than index_topk causal keys exist",
            "decode_indexer_topk": "the same at each decode step [step, layer, k]",
            "indexer_topk_last": "prefill_indexer_topk of the last prompt row",
            "indexer_scores_last": "per layer, every key's index score for the last prompt row",
            "prefill_moe_experts": "routed experts per prompt token for the MoE layers "
                                   f"{rec.moe_layers}, sorted",
        },
        "margins": margins,
        "margin_definitions": {
            "indexer rel_to_kth": "(s_k - s_k+1) / max(|s_k|, |s_k+1|), s_k = k-th largest causal score of a row",
            "indexer rel_to_row_max": "(s_k - s_k+1) / max_t |s_t| over the row's causal candidates",
            "router expert_gap": "sigmoid(logit)+e_score_correction_bias: last chosen minus first rejected "
                                 "expert (after group masking)",
            "router group_gap": "group scores (sum of the 2 best biased scores): last kept minus first dropped",
            "greedy": "top1 - top2 logit at every greedy decision",
        },
        "near_ties_below_threshold": {"threshold": NEAR_TIE, "indexer": near, "router": near_router},
        "deltas_observed": {"hf_cache_path_vs_uncached_forward": cache_vs_nocache},
        "recommended_tolerances": {
            "decode_tokens": "exact",
            "indexer_topk (all *_topk tensors)": "exact set equality",
            "prefill_moe_experts": "exact",
            "prefill_logits / decode_logits (float32 runtime)": {"max_abs": 1e-4},
            "prefill_layer_output / prefill_final_hidden (float32 runtime)": {"max_abs": 1e-4},
        },
    }
    if compare is not None:
        meta["compared_with"] = compare

    return tensors, meta


def main(argv=None):
    args = parse_args(argv)
    tensors, meta = compute(args)
    print(json.dumps({k: meta[k] for k in ("versions", "margins", "deltas_observed")}, indent=1))
    print("eps differences from the spec:", meta["differences_from_spec"]["eps"])
    if "compared_with" in meta:
        print(json.dumps(meta["compared_with"], indent=1))
    if not args.no_write:
        out_dir = args.out or args.model
        os.makedirs(out_dir, exist_ok=True)
        write_safetensors(os.path.join(out_dir, "golden.safetensors"), tensors)
        with open(os.path.join(out_dir, "golden.json"), "w") as f:
            json.dump(meta, f, indent=1)
            f.write("\n")
        print(f"wrote {out_dir}/golden.safetensors and golden.json")


if __name__ == "__main__":
    main(sys.argv[1:])
