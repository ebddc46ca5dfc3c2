#!/usr/bin/env python3
"""Reference token ids from Hugging Face `tokenizers` for tests/runtime/tokenizer/test_tokenizer.cpp.

Writes, under tests/data/tokenizer/:
  deepseek_v3_reference.jsonl  one line per string: {"text", "ids"} plus, where they differ from
                               the defaults, "ids_plain" (encode_special_tokens=True, i.e.
                               parse_special=false; default: ids), "decoded" (decode(ids);
                               default: text) and "decoded_skip" (decode with
                               skip_special_tokens=True; default: decoded)
  variants/<name>.json         tokenizer.json variants of tests/data/tiny-tokenizer/tokenizer.json
                               that exercise the other supported components (Split behaviours,
                               invert, Digits, ByteLevel prefix space and regex, added-token flags,
                               normalizers, Oniguruma's \\w and \\s, merges as strings,
                               ignore_merges, unk and byte fallback without a byte-level stage,
                               no decoder)
  variants_reference.jsonl     the same fields plus "variant", for those

The strings are generated deterministically (fixed seed): English, Chinese, code, digits, emoji,
whitespace runs, special tokens inside text, mixed scripts, long words, random Unicode 14 chars
(Unicode 14 is what Python 3.11's unicodedata and Debian 12's PCRE2 know; newer chars may be
classified differently by the regex engines and are left out). The same Python minor version
regenerates the same strings.

  pip install tokenizers==0.22.1
  python3 scripts/make_tiny_tokenizer.py --out tests/data/tiny-tokenizer/tokenizer.json  # first
  python3 scripts/make_tokenizer_reference.py
"""
# requirements: tokenizers==0.22.1

import argparse
import copy
import json
import os
import random
import sys
import unicodedata

import tokenizers
from tokenizers import Tokenizer

PINNED = "0.22.1"

WORDS = ("the of and to in is that for it as with was on be by this are or at from an have not which "
         "but all were when we there can been one do their if will each about how up out them then she "
         "many some so these would other into has more her two like him see time could no make than "
         "first water call who its now find long down day did get come made may part model token "
         "expert layer attention cache rank stage batch Tokenizer Hello World GLM DeepSeek").split()
CONTRACTIONS = ["it's", "don't", "I'LL", "they'RE", "we've", "she'd", "I'm", "can't", "won't",
                "O'Neil", "'s", "'t", "rock'n'roll", "'quoted'", "y'all"]
CHINESE = ("的一是在不了有和人这中大为上个国我以要他时来用们生到作地于出就分对成会可主发年动同工也能下过子说"
           "产种面而方后多定行学法所民得经十三之进着等部度家电力里如水化高自二理起小物现实加量都两体制机当"
           "使点从业本去把性好应开它合还因由其些然前外天政四日那社义事平形相全表间样与关各重新线内数正心反你"
           "明看原又么利比或但质气第向道命此变条只没结解问意建月公无系军很情者最立代想已通并提直题党程展五果"
           "料象员革位入常文总次品式活设及管特件长求老头基资边流路级少图山统接知较将组见计别她手角期根论运农"
           "指几九区强放决西被干做必战先回则任取据处府研质世界模型专家混合参数量注意力机制分词器")
CN_PUNCT = "，。！？；：“”‘’（）《》、…—·【】"
MIXED = ["Привет, мир! Как дела?", "Γειά σου Κόσμε", "مرحبا بالعالم ١٢٣", "שלום עולם", "नमस्ते दुनिया",
         "สวัสดีชาวโลก", "안녕하세요 세계", "こんにちは世界、カタカナとひらがな。", "Xin chào thế giới",
         "Tiếng Việt có dấu", "e\u0301cole cafe\u0301 n\u0303", "გამარჯობა", "Բարեւ", "வணக்கம்",
         "হ্যালো", "∑∫√≈≠≤≥∞", "┌─┬─┐│ │└─┘", "€£¥₹₿", "←↑→↓⇒", "Ⅻ ⅷ ½ ¾ ² ³", "ﬁ ﬂ ﬀ",
         "Ｆｕｌｌｗｉｄｔｈ　ＡＢＣ１２３", "ǅ ǈ ǋ", "İstanbul ıi", "Straße ẞ", "ŉ ǰ ΐ", "𝐀𝐁𝐂 𝔸𝔹ℂ",
         "𐍈𐌰𐌻", "ᚠᛇᚻ", "ꙮ", "ℌℑℜ", "Ꭰ Ꭱ Ꭲ"]
EMOJI = ["😀", "🚀", "👨‍👩‍👧‍👦", "👍🏽", "🇨🇳", "🇺🇸", "1️⃣", "❤️", "🏳️‍🌈", "🤖", "🧪", "✨", "🔥", "💯",
         "😂😂😂", "🙏🏻", "👩🏾‍💻", "☕", "⚡", "©", "®", "™", "🀄", "🃏"]
WHITESPACE = [" ", "  ", "   ", "\t", "\n", "\n\n", "\r\n", "\r", "\u00a0", "\u3000", "\u2003", "\u2009",
              "\u200b", "\u0085", "\u2028", "\u2029", "\u202f", "\u000b", "\u000c", "\u1680", "\u180e",
              "\ufeff", "\u205f", " \n ", "\t\t", "\n \n"]
PUNCT = ["...", "!!!", "?!", "--", "==>", "''", "\"", "'", "`", "```", "->", "::", "!=", "<=", ">=",
         "&&", "||", "#", "@", "$$", "%", "^", "*", "(", ")", "[", "]", "{", "}", "|", "\\", "/", "~",
         "_", "__init__", "<", ">", "</", "/>", "<!--", "-->", ".,;:", "、", "。", "！"]
CODE_LINES = [
    "def {f}(self, x, y=None):", "    return {f}(x) + {n}", "\tif ({v} != nullptr) {{", "}}",
    "#include <{v}.h>", "for (int i = 0; i < {n}; ++i) {{ {v}[i] = i * 2; }}",
    "const auto& {v} = std::vector<int>{{{n}, {n}}};", "<div class=\"{v}\">{f}</div>",
    "{{\"{v}\": [{n}, {n}], \"ok\": true, \"s\": \"{f}\"}}", "SELECT {v} FROM t WHERE id = {n};",
    "x = lambda {v}: {v} ** 2  # comment", "    // TODO({f}): fix {v}", "let {v}: Vec<u32> = vec![];",
    "if __name__ == \"__main__\":", "    print(f\"{{{v}!r}} = {{{n}}}\")", "$ ./{f} --flag={n} > out.txt",
    "https://example.com/{v}/{f}?q={n}&lang=zh-CN#top", "{v}_{f}.{v}({n}, '{f}')", "  - {v}: {n}",
]


def rnd_word(rng):
    return rng.choice(WORDS)


def english(rng):
    n = rng.randint(1, 30)
    out = []
    for _ in range(n):
        r = rng.random()
        w = rng.choice(CONTRACTIONS) if r < 0.1 else rnd_word(rng)
        if r > 0.9:
            w = w.upper()
        elif r > 0.8:
            w = w.capitalize()
        out.append(w)
        if rng.random() < 0.15:
            out[-1] += rng.choice([",", ".", "!", "?", ";", ":", ")", "\""])
    s = " ".join(out)
    if rng.random() < 0.3:
        s = rng.choice(["(", "\"", " ", "'", "- "]) + s
    return s


def chinese(rng):
    s = ""
    for _ in range(rng.randint(1, 12)):
        r = rng.random()
        if r < 0.6:
            s += "".join(rng.choice(CHINESE) for _ in range(rng.randint(1, 12)))
        elif r < 0.8:
            s += rng.choice(CN_PUNCT)
        elif r < 0.9:
            s += rng.choice([" ", ""]) + rnd_word(rng) + rng.choice([" ", ""])
        else:
            s += str(rng.randint(0, 10 ** rng.randint(1, 8)))
    return s


def code(rng):
    lines = []
    for _ in range(rng.randint(1, 8)):
        line = rng.choice(CODE_LINES).format(f=rnd_word(rng) + rnd_word(rng).capitalize(),
                                             v=rnd_word(rng), n=rng.randint(0, 100000))
        indent = rng.choice(["", "", "    ", "\t", "        ", "  "])
        lines.append(indent + line)
    return rng.choice(["\n", "\r\n", "\n\n"]).join(lines) + rng.choice(["", "\n"])


def digits(rng):
    parts = []
    for _ in range(rng.randint(1, 8)):
        r = rng.random()
        if r < 0.3:
            parts.append(str(rng.randint(0, 10 ** rng.randint(1, 25))))
        elif r < 0.45:
            parts.append(f"{rng.uniform(-1e6, 1e6):.{rng.randint(0, 8)}f}")
        elif r < 0.55:
            parts.append(f"{rng.randint(1, 999)},{rng.randint(0, 999):03d},{rng.randint(0, 999):03d}")
        elif r < 0.65:
            parts.append(rng.choice(["١٢٣٤٥", "١٠", "１２３４", "²³", "Ⅻ", "½", "۱۲۳", "๑๒๓", "१२३"]))
        elif r < 0.75:
            parts.append(rnd_word(rng) + str(rng.randint(0, 9999)) + rnd_word(rng))
        elif r < 0.85:
            parts.append(f"{rng.randint(1, 9)}e-{rng.randint(1, 30)}")
        else:
            parts.append(f"+{rng.randint(1, 99)} ({rng.randint(100, 999)}) {rng.randint(1000000, 9999999)}")
    return rng.choice([" ", "", ", ", "\n"]).join(parts)


def emoji(rng):
    s = ""
    for _ in range(rng.randint(1, 10)):
        s += rng.choice(EMOJI) if rng.random() < 0.6 else rng.choice([" ", rnd_word(rng), " " + rnd_word(rng) + " "])
    return s


def whitespace(rng):
    s = ""
    for _ in range(rng.randint(1, 10)):
        s += "".join(rng.choice(WHITESPACE) for _ in range(rng.randint(1, 4)))
        if rng.random() < 0.7:
            s += rng.choice([rnd_word(rng), "中文", "123", "😀", ".", "x"])
    return s


def punctuation(rng):
    return "".join(rng.choice(PUNCT + [" ", "a", "\n", rnd_word(rng)]) for _ in range(rng.randint(1, 15)))


def mixed(rng):
    parts = [rng.choice(MIXED) for _ in range(rng.randint(1, 4))]
    if rng.random() < 0.5:
        parts.append(english(rng))
    rng.shuffle(parts)
    return rng.choice([" ", "", "\n"]).join(parts)


def long_word(rng):
    r = rng.randrange(9)
    if r == 0:
        return rng.choice("ab中😀 ") * rng.randint(100, 3000)
    if r == 1:
        return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(50, 600)))
    if r == 2:
        return "".join(rng.choice("0123456789") for _ in range(rng.randint(50, 600)))
    if r == 3:
        return "https://" + "/".join(rnd_word(rng) for _ in range(rng.randint(5, 60))) + "?x=" + "9" * 50
    if r == 4:
        return "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/")
                       for _ in range(rng.randint(100, 800))) + "=="
    if r == 5:
        return "".join(rng.choice(CHINESE) for _ in range(rng.randint(100, 600)))
    if r == 6:
        return " " * rng.randint(100, 1000) + rnd_word(rng) + "\n" * rng.randint(10, 200)
    if r == 7:
        return "ab" * rng.randint(100, 1000)
    return "".join(rng.choice(EMOJI) for _ in range(rng.randint(50, 300)))


def assigned_chars():
    out = []
    for cp in list(range(0x20, 0x3000)) + list(range(0xA000, 0xFFFE)) + list(range(0x10000, 0x1FAFF)):
        c = chr(cp)
        if unicodedata.category(c) not in ("Cn", "Cs", "Co"):
            out.append(c)
    return out


def random_unicode(rng, pool):
    s = "".join(rng.choice(pool) for _ in range(rng.randint(1, 40)))
    if rng.random() < 0.3:
        s = s.replace(s[rng.randrange(len(s))], " ")
    return s


def with_added(rng, base_gen, added):
    """Added tokens inside text: whole, next to whitespace, doubled, and cut-off prefixes."""
    s = base_gen(rng)
    for _ in range(rng.randint(1, 4)):
        tok = rng.choice(added)
        r = rng.random()
        if r < 0.15:
            tok = tok[: rng.randint(1, max(1, len(tok) - 1))]
        elif r < 0.3:
            tok = tok + tok
        elif r < 0.5:
            tok = rng.choice([" ", "  ", "\n", "\t", " \n"]) + tok + rng.choice([" ", "", "\n", "  "])
        pos = rng.randint(0, len(s))
        s = s[:pos] + tok + s[pos:]
    return s


LITERALS = [
    "Hello, 世界! 12345 tokens 😀🚀 naïve café",
    "DeepSeek-V3 是一个混合专家模型，参数量为671B。",
    "  leading spaces\n\nnewlines\ttabs 3.14159 ",
    "<｜begin▁of▁sentence｜>hi<｜end▁of▁sentence｜>",
    "", " ", "\n", "a", "中", "😀", "<｜User｜>", "<think>", "</think>",
    "<｜begin▁of▁sentence｜>You are helpful.<｜User｜>1+1=?<｜Assistant｜><think>",
    "[gMASK]<sop><|system|>sys<|user|>hi<|assistant|><think>",
    "<mask> My name <mask> A<mask> <mask>ony <mask>", "[CLS] My name is Anthony [SEP]",
    "Hi <mask> there\t<mask>\t<mask>\u2000", "``quoted\" hello world  x", "tokenizer tokenizers",
]


def generate(rng, counts, added, pool):
    gens = {
        "english": english, "chinese": chinese, "code": code, "digits": digits, "emoji": emoji,
        "whitespace": whitespace, "punctuation": punctuation, "mixed": mixed, "long": long_word,
        "unicode": lambda r: random_unicode(r, pool),
    }
    out = list(LITERALS)
    for name, n in counts.items():
        for _ in range(n):
            if name == "added":
                out.append(with_added(rng, gens[rng.choice(list(gens))], added))
            else:
                out.append(gens[name](rng))
    return out


def reference_lines(tok, texts, extra=None):
    lines = []
    for t in texts:
        tok.encode_special_tokens = False
        ids = tok.encode(t, add_special_tokens=False).ids
        tok.encode_special_tokens = True
        plain = tok.encode(t, add_special_tokens=False).ids
        tok.encode_special_tokens = False
        rec = dict(extra or {})
        rec["text"] = t
        rec["ids"] = ids
        if plain != ids:
            rec["ids_plain"] = plain
        dec = tok.decode(ids, skip_special_tokens=False)
        if dec != t:  # normalizers, Removed splits and prefix spaces change the text
            rec["decoded"] = dec
        dec = tok.decode(ids, skip_special_tokens=True)
        if dec != rec.get("decoded", t):
            rec["decoded_skip"] = dec
        lines.append(json.dumps(rec, ensure_ascii=False))
    return lines


# ---- variants of the tiny tokenizer ------------------------------------------------------------

def bytelevel(prefix=False, regex=False):
    return {"type": "ByteLevel", "add_prefix_space": prefix, "trim_offsets": True, "use_regex": regex}


def split(pattern, behavior, invert=False, literal=False):
    return {"type": "Split", "pattern": {"String" if literal else "Regex": pattern},
            "behavior": behavior, "invert": invert}


def added(tid, content, special=False, lstrip=False, rstrip=False, single_word=False, normalized=None):
    return {"id": tid, "content": content, "single_word": single_word, "lstrip": lstrip,
            "rstrip": rstrip, "normalized": (not special) if normalized is None else normalized,
            "special": special}


def variants(base):
    v = {}
    v["tiny"] = copy.deepcopy(base)

    t = copy.deepcopy(base)
    t["pre_tokenizer"] = bytelevel(prefix=True, regex=True)
    v["gpt2_prefix"] = t

    t = copy.deepcopy(base)
    t["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [split(r"\s+", "MergedWithPrevious"),
                                                                 bytelevel()]}
    v["merged_previous"] = t

    t = copy.deepcopy(base)
    t["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        split(r"[\p{P}\s]", "MergedWithNext", invert=True), bytelevel(prefix=True)]}
    v["merged_next_invert"] = t

    t = copy.deepcopy(base)
    t["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        split(r"\p{P}", "Contiguous"), split(" ", "Removed", literal=True), bytelevel()]}
    v["contiguous_removed"] = t

    t = copy.deepcopy(base)
    t["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "Digits", "individual_digits": True}, bytelevel(regex=True)]}
    v["digits"] = t

    t = copy.deepcopy(base)
    t["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "Digits", "individual_digits": False}, bytelevel(prefix=True, regex=True)]}
    v["digit_runs"] = t

    t = copy.deepcopy(base)
    t["normalizer"] = {"type": "Sequence", "normalizers": [
        {"type": "Replace", "pattern": {"String": "``"}, "content": "\""},
        {"type": "Replace", "pattern": {"Regex": "\u00a0+"}, "content": " "}]}
    n = 512
    t["added_tokens"] += [
        added(n, "<mask>", special=True, lstrip=True, rstrip=True),
        added(n + 1, "ony", single_word=True),
        added(n + 2, "[CLS]", special=True), added(n + 3, "[SEP]", special=True),
        added(n + 4, "hello world"),
        added(n + 5, "\"quoted\""),
        added(n + 6, "<tab>", rstrip=True, normalized=False),
        added(n + 7, "<mask>x", special=True, normalized=False),
        added(n + 8, "name", lstrip=True, single_word=True),
        added(n + 9, "<sp>", special=True, single_word=True, normalized=False),
    ]
    v["added_flags"] = t

    t = copy.deepcopy(base)
    t["model"]["merges"] = [" ".join(m) for m in t["model"]["merges"]]
    t["model"]["ignore_merges"] = True
    t["model"]["vocab"]["Ġtokenizer"] = 512
    t["model"]["vocab"]["tokenizers"] = 513
    v["strings_ignore_merges"] = t

    t = copy.deepcopy(base)
    t["normalizer"] = {"type": "Sequence", "normalizers": [
        {"type": "Prepend", "prepend": "▁"},
        {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]}
    t["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [split("▁", "MergedWithNext", literal=True),
                                                                 bytelevel()]}
    v["prepend_replace"] = t

    # \w and \s with Oniguruma's meaning (PCRE2's own \w also takes numbers like ² and Ⅻ, its \s
    # U+180E); removing them makes a difference visible in the ids.
    t = copy.deepcopy(base)
    t["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        split(r"\w+|[^\w\s]+", "Isolated"), split(r"[\w\s]", "Removed"), bytelevel()]}
    v["word_removed"] = t

    # No byte-level stage: chars missing from the vocab become one fused <unk> per run.
    t = copy.deepcopy(base)
    t["pre_tokenizer"] = split(r"\s+|\p{P}", "Isolated")
    t["decoder"] = None
    t["model"]["vocab"]["<unk>"] = 512
    t["model"]["unk_token"] = "<unk>"
    t["model"]["fuse_unk"] = True
    v["unk_fused"] = t

    # No byte-level stage: missing chars fall back to <0xXX> byte tokens.
    t = copy.deepcopy(base)
    t["pre_tokenizer"] = None
    t["decoder"] = None
    for b in range(256):
        t["model"]["vocab"][f"<0x{b:02X}>"] = 512 + b
    t["model"]["byte_fallback"] = True
    v["byte_fallback"] = t
    return v


def main():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", default=os.path.join(root, "tests", "data"), help="tests/data directory")
    ap.add_argument("--seed", type=int, default=20250601)
    args = ap.parse_args()
    if tokenizers.__version__ != PINNED:
        print(f"warning: tokenizers {tokenizers.__version__} installed, references were made with {PINNED}",
              file=sys.stderr)

    out_dir = os.path.join(args.data, "tokenizer")
    rng = random.Random(args.seed)
    pool = assigned_chars()

    ds = Tokenizer.from_file(os.path.join(out_dir, "deepseek_v3", "tokenizer.json"))
    ds_added = [t.content for t in ds.get_added_tokens_decoder().values()]
    counts = {"english": 350, "chinese": 300, "code": 300, "digits": 250, "emoji": 200, "whitespace": 300,
              "punctuation": 150, "mixed": 300, "long": 60, "unicode": 300, "added": 450}
    texts = generate(rng, counts, ds_added, pool)
    lines = reference_lines(ds, texts)
    path = os.path.join(out_dir, "deepseek_v3_reference.jsonl")
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {path}: {len(lines)} lines, {os.path.getsize(path)} bytes")

    with open(os.path.join(args.data, "tiny-tokenizer", "tokenizer.json"), encoding="utf-8") as f:
        base = json.load(f)
    vdir = os.path.join(out_dir, "variants")
    os.makedirs(vdir, exist_ok=True)
    vlines = []
    small = {k: max(3, n // 40) for k, n in counts.items()}
    small["long"] = 2
    for name, spec in variants(base).items():
        text = json.dumps(spec, ensure_ascii=False, indent=1)
        with open(os.path.join(vdir, name + ".json"), "w", encoding="utf-8") as f:
            f.write(text + "\n")
        tok = Tokenizer.from_str(text)
        vadded = [t.content for t in tok.get_added_tokens_decoder().values()]
        vtexts = generate(random.Random(f"{args.seed}-{name}"), small, vadded, pool)
        vlines += reference_lines(tok, vtexts, extra={"variant": name})
    path = os.path.join(out_dir, "variants_reference.jsonl")
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(vlines) + "\n")
    print(f"wrote {path}: {len(vlines)} lines, {os.path.getsize(path)} bytes")


if __name__ == "__main__":
    main()
