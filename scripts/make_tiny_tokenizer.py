#!/usr/bin/env python3
"""Build the byte-level BPE tokenizer.json used by the project's tiny generated models.

Trains Hugging Face `tokenizers` (BpeTrainer) on a small built-in corpus (English, code, digits,
Chinese), with GLM-5's pre-tokenizer shape (one Split regex, then ByteLevel without prefix space or
regex) and a ByteLevel decoder, then appends the GLM special tokens as added special tokens with
the highest ids. With --vocab-size 512 the special ids are 503..511 and the last three are
<|endoftext|> 509, <|user|> 510, <|observation|> 511, the eos ids of tests/data/tiny-a.
The output is deterministic (same corpus, same trainer settings, one thread).

  pip install tokenizers==0.22.1
  python3 scripts/make_tiny_tokenizer.py --vocab-size 512 --out tests/data/tiny-tokenizer/tokenizer.json
"""
# requirements: tokenizers==0.22.1

import argparse
import json
import os
import random

os.environ.setdefault("RAYON_NUM_THREADS", "1")  # keep training single-threaded

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402

# GLM-4.5 / GLM-5 style split (llama.cpp's "glm4" pre-tokenizer; cl100k-like).
GLM_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
             r"|\s*[\r\n]+|\s+(?!\S)|\s+")

# Lowest id first; the last three are the stop tokens of the GLM chat format.
SPECIAL_TOKENS = ["[gMASK]", "<sop>", "<|system|>", "<|assistant|>", "<think>", "</think>",
                  "<|endoftext|>", "<|user|>", "<|observation|>"]

ENGLISH = """The quick brown fox jumps over the lazy dog. It's a small model, and it can't say much,
but we'll test it anyway. Tokenizers split text into pieces; the pieces become ids. Numbers like
2024, 3.14159 and 1,000,000 are split into groups of at most three digits. A mixture of experts
routes each token to a few experts. Attention looks back over the context; the indexer picks the
keys that matter. Hello world! How are you today? I am fine, thank you. This is the end."""

CODE = """def forward(self, x):
    h = self.embed(x)
    for layer in self.layers:
        h = layer(h) + h
    return self.norm(h)

int main(int argc, char** argv) {
  std::vector<int> ids = {1, 2, 3};
  for (size_t i = 0; i < ids.size(); ++i) printf("%d\\n", ids[i]);
  return 0;
}
{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"}
"""

CHINESE = "你好世界。这是一个小模型，用来测试分词器。我们的模型有专家混合和注意力机制。数字一二三四五六七八九十。"

WORDS = ("the of and to in is that for it as with was on be by this are or at from an have not "
         "which but all were when we there can been one do their if will each about how up out "
         "them then she many some so these would other into has more her two like him see time "
         "could no make than first water been call who its now find long down day did get come "
         "made may part model token expert layer attention cache rank stage batch").split()


def corpus():
    rng = random.Random(1234)
    lines = []
    for _ in range(40):
        lines.append(ENGLISH)
        lines.append(CODE)
        lines.append(CHINESE)
    for _ in range(3000):
        n = rng.randint(3, 14)
        words = [rng.choice(WORDS) for _ in range(n)]
        if rng.random() < 0.3:
            words.insert(rng.randint(0, n), str(rng.randint(0, 99999)))
        s = " ".join(words)
        lines.append(s[0].upper() + s[1:] + rng.choice([".", "!", "?", ",", ";", ":"]))
    return lines


def build(vocab_size):
    n_base = vocab_size - len(SPECIAL_TOKENS)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(GLM_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=n_base, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=[])
    tok.train_from_iterator(corpus(), trainer)
    got = tok.get_vocab_size(with_added_tokens=False)
    if got != n_base:
        raise SystemExit(f"trained vocab has {got} tokens, wanted {n_base}: enlarge the corpus")
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    for i, t in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(t) == n_base + i, (t, tok.token_to_id(t))
    return tok


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vocab-size", type=int, default=512, help="total ids including special tokens")
    ap.add_argument("--out", required=True, help="tokenizer.json to write")
    args = ap.parse_args()
    if args.vocab_size < 256 + len(SPECIAL_TOKENS) + 1:
        raise SystemExit(f"--vocab-size must be at least {256 + len(SPECIAL_TOKENS) + 1}")
    tok = build(args.vocab_size)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    # Re-serialise indented, with a trailing newline, so the file diffs well.
    data = json.loads(tok.to_str())
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(data, f, ensure_ascii=False, indent=1, sort_keys=False)
        f.write("\n")
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    print(f"wrote {args.out}: {tok.get_vocab_size()} ids; special {ids}")


if __name__ == "__main__":
    main()
