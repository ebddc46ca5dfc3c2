#!/usr/bin/env python3
# Trains a small GLM-5 (glm_moe_dsa) on the King James Bible and writes it in the Hugging Face layout.
#
# Every GLM-5 part is present and trained: q / kv LoRA with their norms, nope / rope / v head dims, the DSA
# lightning indexer (interleaved RoPE, rope slice first, LayerNorm'd key), a dense first layer, grouped
# sigmoid routing with e_score_correction_bias and routed_scaling_factor, a shared expert, and one MTP layer
# stored as layer num_hidden_layers. The equations are those of runtime/spec/glm5.md (sections 3.1-3.9);
# the names are the checkpoint's, so export is a rename-free state_dict dump.
#
# Recipe (DeepSeek-V3.2 for the indexer, DeepSeek-V3 for balance and MTP):
#   1. dense warm-up: attention is causal and dense; the indexer (its inputs detached) is fitted by KL
#      divergence to the main attention's head-summed distribution;
#   2. sparse training: each query row attends only to the index_topk keys its indexer picks, the indexer
#      still fitted by KL on the selected keys, inputs detached (the LM loss never reaches it);
#   expert balance by the auxiliary-loss-free bias update (e_score_correction_bias += gamma * sign(mean
#   load - load) after each step); MTP loss (weight mtp_weight) over mtp_depth chained draft steps, the
#   hidden state carried between steps through shared_head.norm (vllm PR #46075: the norm applies to the
#   carried state; acceptance at the second position collapses without it).
#
# Corpus: `bible -f` (Debian package bible-kjv), verse references stripped, one verse per line, chapters
# separated by a blank line. Held out: every chapter whose (book, chapter) hash falls in 1/20 -- never
# trained on, written to <out>/heldout.txt.
#
# Usage (PyTorch CPU; pins in scripts/requirements-train.txt):
#   python3 scripts/train_small_glm5.py --out tests/data/glm5-kjv --work /tmp/kjv-train --minutes 90
# Rerunning the same command resumes from the last checkpoint in --work (every --checkpoint-every steps,
# written atomically); --export-only writes the Hugging Face directory from the last checkpoint.

import argparse
import hashlib
import json
import math
import os
import re
import subprocess
import sys
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

# ---------------------------------------------------------------------------------------------------------
# The model's config (config.json as written). Small but every dimension distinct, so that a swapped slice
# cannot pass unnoticed.

CONFIG = {
    "architectures": ["GlmMoeDsaForCausalLM"],
    "model_type": "glm_moe_dsa",
    "vocab_size": 4096,
    "hidden_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 128,
    "kv_lora_rank": 64,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 16,
    "qk_head_dim": 48,
    "head_dim": 16,
    "v_head_dim": 40,
    "index_n_heads": 8,
    "index_head_dim": 32,
    "index_topk": 64,
    "indexer_rope_interleave": True,
    "rope_interleave": True,
    "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
    "max_position_embeddings": 2048,
    "intermediate_size": 768,
    "moe_intermediate_size": 128,
    "n_routed_experts": 16,
    "n_shared_experts": 1,
    "num_experts_per_tok": 4,
    "n_group": 4,
    "topk_group": 2,
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "num_nextn_predict_layers": 1,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-05,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "tie_word_embeddings": False,
    "initializer_range": 0.02,
    "use_cache": True,
    "ep_size": 1,
    "pretraining_tp": 1,
    "dtype": "bfloat16",
    "transformers_version": "5.13.0",
}

# GLM-5's special tokens, in its order, after the BPE tokens (spec section 4.1).
SPECIAL_TOKENS = ["<|endoftext|>", "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>", "<|system|>", "<|user|>",
                  "<|assistant|>", "<|observation|>", "<think>", "</think>", "<tool_call>", "</tool_call>",
                  "<tool_response>", "</tool_response>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"]
EOS_TOKENS = ["<|endoftext|>", "<|user|>", "<|observation|>"]

# GLM-4.x / GLM-5 pre-tokenizer split (spec section 4.1).
SPLIT_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")

# The GLM-4.7 / GLM-5 chat template, reduced to text turns (system, user, assistant, observation) and the
# thinking switch; tool definitions are not rendered.
CHAT_TEMPLATE = (
    "[gMASK]<sop>"
    "{%- for m in messages -%}"
    "{%- if m.role == 'system' -%}<|system|>{{ m.content }}"
    "{%- elif m.role == 'user' -%}<|user|>{{ m.content }}"
    "{%- elif m.role == 'assistant' -%}<|assistant|></think>{{ m.content }}"
    "{%- elif m.role == 'tool' or m.role == 'observation' -%}<|observation|><tool_response>{{ m.content }}"
    "</tool_response>"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|>"
    "{%- if enable_thinking is defined and enable_thinking -%}<think>{%- else -%}</think>{%- endif -%}"
    "{%- endif -%}")

LORA_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm (spec section 3.1)
K_NORM_EPS = 1e-6  # the indexer's k_norm LayerNorm (spec section 3.6)


# ---------------------------------------------------------------------------------------------------------
# Corpus and tokenizer.


def read_corpus():
    """[(book, chapter, text)] of the KJV: one verse per line, references stripped."""
    out = subprocess.run(["bible", "-f", "Gen1:1-Rev22:21"], check=True, capture_output=True, text=True).stdout
    chapters, key = [], None
    for line in out.splitlines():
        m = re.match(r"^(\w*?[A-Za-z]+)(\d+):(\d+) (.*)$", line)
        if not m:
            raise SystemExit(f"bible -f: unexpected line {line[:60]!r}")
        book, ch, text = m.group(1), int(m.group(2)), m.group(4).strip()
        if (book, ch) != key:
            chapters.append((book, ch, []))
            key = (book, ch)
        chapters[-1][2].append(text)
    return [(b, c, "\n".join(v)) for b, c, v in chapters]


def is_heldout(book, chapter):
    h = hashlib.sha256(f"{book}{chapter}".encode()).digest()
    return h[0] % 20 == 0


def build_tokenizer(train_text, vocab_size):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(SPECIAL_TOKENS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])
    tok.train_from_iterator([train_text], trainer=trainer)
    tok.add_special_tokens(SPECIAL_TOKENS)
    if tok.get_vocab_size() != vocab_size:
        raise SystemExit(f"tokenizer: {tok.get_vocab_size()} tokens, expected {vocab_size}")
    return tok


def write_tokenizer(tok, out):
    tok.save(os.path.join(out, "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    added = {str(ids[t]): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                           "single_word": False, "special": True} for t in SPECIAL_TOKENS}
    cfg = {"added_tokens_decoder": added, "clean_up_tokenization_spaces": False, "do_lower_case": False,
           "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>", "padding_side": "left",
           "extra_special_tokens": [t for t in SPECIAL_TOKENS if t not in ("<|endoftext|>",)],
           "model_max_length": CONFIG["max_position_embeddings"], "remove_space": False,
           "tokenizer_class": "TokenizersBackend", "chat_template": CHAT_TEMPLATE}
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
        f.write("\n")
    return [ids[t] for t in EOS_TOKENS], ids["<|endoftext|>"]


# ---------------------------------------------------------------------------------------------------------
# The model (spec section 3). Names follow the checkpoint: model.layers.{i}.self_attn.q_a_proj.weight etc.


class RMSNorm(nn.Module):
    def __init__(self, d, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def rope_interleaved(x, cos, sin):
    """x [..., T, d] with pairs (x[2i], x[2i+1]) rotated by angle pos * theta^(-2i/d); cos/sin [T, d/2]."""
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)


def linear(i, o):
    return nn.Linear(i, o, bias=False)


class Indexer(nn.Module):
    """DSA lightning indexer (spec 3.6): I[s,t] = sum_h w[s,h] d^-0.5 relu(qi[s,h] . ki[t])."""

    def __init__(self, c):
        super().__init__()
        self.nh, self.d, self.dr = c["index_n_heads"], c["index_head_dim"], c["qk_rope_head_dim"]
        self.wq_b = linear(c["q_lora_rank"], self.nh * self.d)
        self.wk = linear(c["hidden_size"], self.d)
        self.k_norm = nn.LayerNorm(self.d, eps=K_NORM_EPS)
        self.weights_proj = linear(c["hidden_size"], self.nh)

    def forward(self, a, c_q, cos, sin, rows=None):
        """I [B, R, T] for the query rows `rows` (all rows when None) against every key."""
        B, T, _ = a.shape
        qi = self.wq_b(c_q if rows is None else c_q[:, rows])
        R = qi.shape[1]
        qi = qi.view(B, R, self.nh, self.d).transpose(1, 2)  # [B, nh, R, d], per head [rope | nope]
        qc, qs = (cos, sin) if rows is None else (cos[rows], sin[rows])
        qi = torch.cat([rope_interleaved(qi[..., :self.dr], qc, qs), qi[..., self.dr:]], -1)
        ki = self.k_norm(self.wk(a))  # [B, T, d]
        ki = torch.cat([rope_interleaved(ki[..., :self.dr], cos, sin), ki[..., self.dr:]], -1)
        w = self.weights_proj(a if rows is None else a[:, rows]) * self.nh ** -0.5  # [B, R, nh]
        dots = F.relu(qi @ ki.unsqueeze(1).transpose(-1, -2))  # [B, nh, R, T]
        return (dots * w.transpose(1, 2).unsqueeze(-1)).sum(1) * self.d ** -0.5


class Attention(nn.Module):
    """MLA (spec 3.3-3.4) with the DSA selection (3.6)."""

    def __init__(self, c):
        super().__init__()
        H = c["hidden_size"]
        self.nh, self.dn, self.dr, self.dv = (c["num_attention_heads"], c["qk_nope_head_dim"],
                                              c["qk_rope_head_dim"], c["v_head_dim"])
        self.R, self.topk = c["kv_lora_rank"], c["index_topk"]
        self.q_a_proj = linear(H, c["q_lora_rank"])
        self.q_a_layernorm = RMSNorm(c["q_lora_rank"], LORA_NORM_EPS)
        self.q_b_proj = linear(c["q_lora_rank"], self.nh * (self.dn + self.dr))
        self.kv_a_proj_with_mqa = linear(H, self.R + self.dr)
        self.kv_a_layernorm = RMSNorm(self.R, LORA_NORM_EPS)
        self.kv_b_proj = linear(self.R, self.nh * (self.dn + self.dv))
        self.o_proj = linear(self.nh * self.dv, H)
        self.indexer = Indexer(c)
        self.scale = (self.dn + self.dr) ** -0.5

    def forward(self, a, cos, sin, causal, sparse, aux):
        B, T, _ = a.shape
        c_q = self.q_a_layernorm(self.q_a_proj(a))
        q = self.q_b_proj(c_q).view(B, T, self.nh, self.dn + self.dr).transpose(1, 2)  # [B, nh, T, dn+dr]
        q = torch.cat([q[..., :self.dn], rope_interleaved(q[..., self.dn:], cos, sin)], -1)
        kv = self.kv_a_proj_with_mqa(a)
        c_kv = self.kv_a_layernorm(kv[..., :self.R])
        k_pe = rope_interleaved(kv[..., self.R:], cos, sin).unsqueeze(1)  # [B, 1, T, dr], shared by heads
        kvb = self.kv_b_proj(c_kv).view(B, T, self.nh, self.dn + self.dv).transpose(1, 2)
        k = torch.cat([kvb[..., :self.dn], k_pe.expand(B, self.nh, T, self.dr)], -1)
        v = kvb[..., self.dn:]
        # Selection from the indexer's scores of every row (no gradient: top-k is not differentiable).
        allowed = causal
        if sparse and T > self.topk:
            with torch.no_grad():
                I = self.indexer(a, c_q, cos, sin).masked_fill(~causal, float("-inf"))  # [B, T, T]
                sel = torch.zeros(B, T, T, dtype=torch.bool)
                sel.scatter_(-1, I.topk(self.topk, dim=-1).indices, True)
            allowed = causal & sel  # rows with span <= topk keep every causal key (-inf picks are masked)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed.unsqueeze(1), scale=self.scale)
        # Indexer loss on a sample of query rows: KL(head-summed attention || softmax(I)) over the allowed
        # keys, the indexer's inputs detached so that only this loss trains it (DeepSeek-V3.2).
        rows = torch.randperm(T)[:aux["kl_rows"]].sort().values
        allow_r = allowed[:, rows] if allowed.shape[0] == B else allowed[:, rows].expand(B, -1, -1)
        with torch.no_grad():
            sc = (q[:, :, rows] @ k.transpose(-1, -2)) * self.scale
            target = torch.softmax(sc.masked_fill(~allow_r.unsqueeze(1), float("-inf")), -1).sum(1) / self.nh
        I_r = self.indexer(a.detach(), c_q.detach(), cos, sin, rows)
        logq = torch.log_softmax(I_r.masked_fill(~allow_r, float("-inf")), dim=-1)
        kl = torch.where(target > 0, target * (torch.log(target.clamp_min(1e-30)) - logq), torch.zeros_like(target))
        aux["indexer_kl"].append(kl.sum(-1).mean())
        return self.o_proj(o.transpose(1, 2).reshape(B, T, self.nh * self.dv))


class MLP(nn.Module):
    def __init__(self, H, inter):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = linear(H, inter), linear(H, inter), linear(inter, H)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Gate(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(c["n_routed_experts"], c["hidden_size"]))
        self.register_buffer("e_score_correction_bias", torch.zeros(c["n_routed_experts"]))


class MoE(nn.Module):
    """Sigmoid noaux_tc routing with groups (spec 3.8); load counted for the bias update."""

    def __init__(self, c):
        super().__init__()
        self.E, self.K = c["n_routed_experts"], c["num_experts_per_tok"]
        self.G, self.KG = c["n_group"], c["topk_group"]
        self.scaling = c["routed_scaling_factor"]
        self.gate = Gate(c)
        self.experts = nn.ModuleList(MLP(c["hidden_size"], c["moe_intermediate_size"]) for _ in range(self.E))
        self.shared_experts = MLP(c["hidden_size"], c["moe_intermediate_size"] * c["n_shared_experts"])

    def forward(self, m, aux):
        x = m.reshape(-1, m.shape[-1])
        s = torch.sigmoid(x @ self.gate.weight.t())  # [N, E] unbiased
        with torch.no_grad():
            b = s + self.gate.e_score_correction_bias
            g = b.view(-1, self.G, self.E // self.G)
            gscore = g.topk(2, dim=-1).values.sum(-1)  # [N, G]
            keep = torch.zeros_like(gscore, dtype=torch.bool).scatter_(1, gscore.topk(self.KG, dim=1).indices, True)
            b = b.masked_fill(~keep.repeat_interleave(self.E // self.G, dim=1), float("-inf"))
            idx = b.topk(self.K, dim=-1).indices  # [N, K]
        w = s.gather(1, idx)
        w = w / w.sum(-1, keepdim=True) * self.scaling
        y = self.shared_experts(x)
        counts = torch.bincount(idx.flatten(), minlength=self.E)
        aux["load"].append((self, counts))
        flat_e = idx.flatten()
        order = torch.argsort(flat_e)
        rows = order // self.K
        bounds = torch.cumsum(counts, 0).tolist()
        start = 0
        out = torch.zeros_like(x)
        for e, end in enumerate(bounds):
            if end > start:
                r = rows[start:end]
                ye = self.experts[e](x[r]) * w.flatten()[order[start:end]].unsqueeze(1)
                out = out.index_add(0, r, ye)
            start = end
        return (y + out).view_as(m)


class DecoderLayer(nn.Module):
    def __init__(self, c, moe):
        super().__init__()
        self.input_layernorm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])
        self.post_attention_layernorm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])
        self.self_attn = Attention(c)
        self.mlp = MoE(c) if moe else MLP(c["hidden_size"], c["intermediate_size"])
        self.is_moe = moe

    def forward(self, h, cos, sin, causal, sparse, aux):
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, causal, sparse, aux)
        m = self.post_attention_layernorm(h)
        return h + (self.mlp(m, aux) if self.is_moe else self.mlp(m))


class MTPLayer(DecoderLayer):
    """DeepSeek-V3 next-n module (spec 3.9): z = eh_proj [enorm(emb(t_{i+1})) | hnorm(h_i)], a decoder layer,
    logits = lm_head(shared_head.norm(z)). No embed_tokens / shared_head.head of its own."""

    def __init__(self, c):
        super().__init__(c, moe=c["n_routed_experts"] > 0)
        H = c["hidden_size"]
        self.enorm, self.hnorm = RMSNorm(H, c["rms_norm_eps"]), RMSNorm(H, c["rms_norm_eps"])
        self.eh_proj = linear(2 * H, H)
        self.shared_head = nn.Module()
        self.shared_head.norm = RMSNorm(H, c["rms_norm_eps"])


class Inner(nn.Module):
    def __init__(self, c):
        super().__init__()
        L = c["num_hidden_layers"]
        self.embed_tokens = nn.Embedding(c["vocab_size"], c["hidden_size"])
        layers = [DecoderLayer(c, moe=i >= c["first_k_dense_replace"]) for i in range(L)]
        self.layers = nn.ModuleList(layers + [MTPLayer(c)])
        self.norm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])


class SmallGlm5(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c = c
        self.kl_rows = 128  # query rows per sequence whose indexer KL is trained each step
        self.model = Inner(c)
        self.lm_head = linear(c["hidden_size"], c["vocab_size"])
        dr, theta = c["qk_rope_head_dim"], c["rope_parameters"]["rope_theta"]
        self.register_buffer("inv_freq", 1.0 / theta ** (torch.arange(0, dr, 2, dtype=torch.float64) / dr),
                             persistent=False)
        self.init_weights()

    def init_weights(self):
        std, L = self.c["initializer_range"], self.c["num_hidden_layers"]
        for name, p in self.named_parameters():
            if p.dim() == 2:
                s = std / math.sqrt(2 * (L + 1)) if name.endswith(("o_proj.weight", "down_proj.weight")) else std
                nn.init.normal_(p, 0.0, s)

    def rope(self, T):
        ang = torch.arange(T, dtype=torch.float64)[:, None] * self.inv_freq[None, :]
        return torch.cos(ang).float(), torch.sin(ang).float()

    def forward(self, ids, sparse, mtp_depth):
        """ids [B, T+1+mtp_depth]: the model sees ids[:, :T]; returns (main loss, [mtp losses], aux)."""
        c, L = self.c, self.c["num_hidden_layers"]
        T = ids.shape[1] - 1 - mtp_depth
        x, y = ids[:, :T], ids[:, 1:T + 1]
        cos, sin = self.rope(T)
        causal = torch.ones(T, T, dtype=torch.bool).tril().unsqueeze(0)
        aux = {"indexer_kl": [], "load": [], "kl_rows": self.kl_rows}
        h = self.model.embed_tokens(x)
        for layer in self.model.layers[:L]:
            h = layer(h, cos, sin, causal, sparse, aux)
        h = self.model.norm(h)  # the hidden state the MTP layer receives (after the final norm, as vLLM)
        loss = F.cross_entropy(self.lm_head(h).flatten(0, 1), y.flatten())
        mtp = self.model.layers[L]
        mtp_losses = []
        for j in range(1, mtp_depth + 1):
            # step j at position i: embedding of t_{i+j}, hidden carried from step j-1, predicts t_{i+j+1}
            e = mtp.enorm(self.model.embed_tokens(ids[:, j:T + j]))
            z = mtp.eh_proj(torch.cat([e, mtp.hnorm(h)], -1))
            z = mtp(z, cos, sin, causal, sparse, aux)
            h = mtp.shared_head.norm(z)
            mtp_losses.append(F.cross_entropy(self.lm_head(h).flatten(0, 1), ids[:, j + 1:T + j + 1].flatten()))
        return loss, mtp_losses, aux


# ---------------------------------------------------------------------------------------------------------
# Export: safetensors shards + index, config.json, generation_config.json.


def export(model, out, eos_ids, pad_id, shards=2):
    from safetensors.torch import save_file
    os.makedirs(out, exist_ok=True)
    sd = model.state_dict()
    tensors = {}
    for name, t in sd.items():
        if name.endswith("inv_freq"):
            continue
        keep_f32 = name.endswith("e_score_correction_bias")
        tensors[name] = t.detach().to(torch.float32 if keep_f32 else torch.bfloat16).contiguous()
    names = sorted(tensors)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    weight_map, parts, acc, cur = {}, [[]], 0, 0
    for n in names:  # split by bytes into `shards` files
        b = tensors[n].numel() * tensors[n].element_size()
        if acc + b > total / shards * (cur + 1) and parts[-1] and len(parts) < shards:
            parts.append([])
            cur += 1
        parts[-1].append(n)
        acc += b
    for i, part in enumerate(parts):
        fn = f"model-{i + 1:05d}-of-{len(parts):05d}.safetensors"
        save_file({n: tensors[n] for n in part}, os.path.join(out, fn), metadata={"format": "pt"})
        os.chmod(os.path.join(out, fn), 0o644)
        weight_map.update({n: fn for n in part})
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
        f.write("\n")
    cfg = dict(CONFIG, eos_token_id=eos_ids, pad_token_id=pad_id)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(dict(sorted(cfg.items())), f, indent=2)
        f.write("\n")
    gen = {"eos_token_id": eos_ids, "pad_token_id": pad_id, "temperature": 1.0, "top_p": 0.95,
           "transformers_version": CONFIG["transformers_version"]}
    with open(os.path.join(out, "generation_config.json"), "w") as f:
        json.dump(gen, f, indent=2)
        f.write("\n")


# ---------------------------------------------------------------------------------------------------------
# Training loop.


def lr_at(step, total, peak, warmup):
    if step < warmup:
        return peak * (step + 1) / warmup
    t = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))


@torch.no_grad()
def balance_update(aux, gamma):
    """DeepSeek-V3's auxiliary-loss-free balance: raise the bias of underloaded experts, lower overloaded."""
    for moe, counts in aux["load"]:
        load = counts.float()
        moe.gate.e_score_correction_bias += gamma * torch.sign(load.mean() - load)


@torch.no_grad()
def evaluate(model, data, ctx, sparse, n_windows=16):
    """Mean next-token loss over n_windows fixed windows of ctx held-out tokens."""
    model.eval()
    losses = []
    step = max(1, (len(data) - ctx - 1) // n_windows)
    for s in range(0, min(len(data) - ctx - 2, step * n_windows), step):
        ids = torch.tensor(data[s:s + ctx + 2], dtype=torch.long)[None]
        loss, _, _ = model(ids, sparse, mtp_depth=1)
        losses.append(loss.item())
    model.train()
    return float(np.mean(losses))


def save_checkpoint(path, model, opt, step, log):
    tmp = path + ".tmp"
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step, "log": log,
                "rng": torch.get_rng_state()}, tmp)
    os.replace(tmp, path)


def plot(log, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    st = [r["step"] for r in log]
    ax[0].plot(st, [r["loss"] for r in log], label="train LM loss", lw=0.8)
    ax[0].plot(st, [r["mtp"] for r in log], label="train MTP loss (step 1)", lw=0.8)
    ev = [r for r in log if "heldout" in r]
    ax[0].plot([r["step"] for r in ev], [r["heldout"] for r in ev], "o-", label="held-out LM loss")
    ax[0].set_xlabel("step")
    ax[0].set_ylabel("cross-entropy (nats/token)")
    ax[0].legend()
    ax[1].plot(st, [r["indexer_kl"] for r in log], lw=0.8)
    ax[1].set_xlabel("step")
    ax[1].set_ylabel("indexer KL (mean over layers)")
    sparse_from = next((r["step"] for r in log if r["sparse"]), None)
    for a in ax:
        if sparse_from is not None:
            a.axvline(sparse_from, color="gray", ls="--", lw=0.8)
    fig.suptitle("small GLM-5 on the KJV (dashed: dense warm-up ends, sparse attention begins)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", required=True, help="Hugging Face directory to write")
    ap.add_argument("--work", required=True, help="checkpoint / data directory (resume from here)")
    ap.add_argument("--steps", type=int, default=1200)
    ap.add_argument("--minutes", type=float, default=0, help="stop (and export) after this many minutes")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=40)
    ap.add_argument("--dense-steps", type=int, default=200, help="dense warm-up steps (then sparse)")
    ap.add_argument("--mtp-depth", type=int, default=2)
    ap.add_argument("--mtp-weight", type=float, default=0.3)
    ap.add_argument("--bias-gamma", type=float, default=2e-3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--checkpoint-every", type=int, default=25)
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--export-only", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    os.makedirs(args.work, exist_ok=True)
    os.makedirs(args.out, exist_ok=True)

    chapters = read_corpus()
    train_text = "\n\n".join(t for b, c, t in chapters if not is_heldout(b, c))
    held_text = "\n\n".join(t for b, c, t in chapters if is_heldout(b, c))
    with open(os.path.join(args.out, "heldout.txt"), "w") as f:
        f.write(held_text + "\n")
    tok_path = os.path.join(args.work, "tokenizer.json")
    if os.path.exists(tok_path):
        from tokenizers import Tokenizer
        tok = Tokenizer.from_file(tok_path)
    else:
        tok = build_tokenizer(train_text, CONFIG["vocab_size"])
        tok.save(tok_path)
    eos_ids, pad_id = write_tokenizer(tok, args.out)
    train_ids = np.array(tok.encode(train_text).ids, dtype=np.int32)
    held_ids = np.array(tok.encode(held_text).ids, dtype=np.int32)
    print(f"corpus: {len(train_ids)} train tokens, {len(held_ids)} held-out tokens", flush=True)

    model = SmallGlm5(CONFIG)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"parameters: {n_params / 1e6:.2f} M", flush=True)
    decay = [p for n, p in model.named_parameters() if p.dim() == 2]
    other = [p for n, p in model.named_parameters() if p.dim() != 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))
    ck = os.path.join(args.work, "checkpoint.pt")
    step, log = 0, []
    if os.path.exists(ck):
        st = torch.load(ck, weights_only=False)
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
        step, log = st["step"], st["log"]
        torch.set_rng_state(st["rng"])
        print(f"resumed at step {step}", flush=True)
    if args.export_only:
        export(model, args.out, eos_ids, pad_id)
        plot(log, os.path.join(args.out, "training.png"))
        return

    rng = np.random.default_rng(args.seed + step)
    need = args.ctx + 1 + args.mtp_depth
    t0 = time.time()
    while step < args.steps:
        if args.minutes and time.time() - t0 > args.minutes * 60:
            print("time limit reached", flush=True)
            break
        sparse = step >= args.dense_steps
        starts = rng.integers(0, len(train_ids) - need, size=args.batch)
        ids = torch.tensor(np.stack([train_ids[s:s + need] for s in starts]), dtype=torch.long)
        lr = lr_at(step, args.steps, args.lr, args.warmup)
        for g in opt.param_groups:
            g["lr"] = lr
        ts = time.time()
        loss, mtp_losses, aux = model(ids, sparse, args.mtp_depth)
        kl = torch.stack(aux["indexer_kl"]).mean()
        total = loss + args.mtp_weight * sum(mtp_losses) / max(1, len(mtp_losses)) + kl
        opt.zero_grad(set_to_none=True)
        total.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        balance_update(aux, args.bias_gamma)
        step += 1
        rec = {"step": step, "loss": loss.item(), "mtp": mtp_losses[0].item() if mtp_losses else 0.0,
               "indexer_kl": kl.item(), "sparse": sparse, "lr": lr, "sec": time.time() - ts}
        if step % args.eval_every == 0 or step == args.steps:
            rec["heldout"] = evaluate(model, held_ids, args.ctx, sparse)
        log.append(rec)
        print(json.dumps(rec), flush=True)
        if step % args.checkpoint_every == 0 or step == args.steps:
            save_checkpoint(ck, model, opt, step, log)
    save_checkpoint(ck, model, opt, step, log)
    export(model, args.out, eos_ids, pad_id)
    plot(log, os.path.join(args.out, "training.png"))
    print(f"exported step {step} to {args.out}", flush=True)


if __name__ == "__main__":
    main()
