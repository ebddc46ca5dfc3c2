#!/usr/bin/env python3
"""The longest C++ functions of the tree: name, file:line and length in lines, longest first.

    scripts/longest_functions.py                    # the top 20 of runtime/, parallel/, launcher/, kernels/cpu/
    scripts/longest_functions.py --top 50           # more of them; --top 0 lists every function
    scripts/longest_functions.py --max 120          # also exit 1 when any function is longer than 120 lines
    scripts/longest_functions.py tests/runtime      # the default folders plus these files / folders
    scripts/longest_functions.py --only kernels/cuda   # only the given files / folders

A measuring tool (python3 standard library only, no compiler or compile database). Each source
(.cpp .cc .cxx .h .hpp .cu .cuh) is read with its comments, string and character literals and
preprocessor lines blanked out (line numbers kept), then scanned by brace matching: at namespace
scope and in class / struct / union bodies, a `{` whose declaration ends in a parameter list (and
qualifiers: const, noexcept, override, a trailing return type, a constructor's initializer list)
opens a function body, which runs to its matching `}`. Nested classes are followed; lambdas and
local classes count as part of the function that holds them. Names: out-of-class definitions as
written (`Engine::exchange`), in-class ones prefixed with their class, namespaces left out, a
macro-made function (all caps, e.g. gtest's TEST) with its arguments.

lines = from the declaration's first line (template or return type) to the closing brace, both
included; file:line points at the function's name. Code the preprocessor would drop is scanned as
written, so an #if whose branches open braces differently would confuse it.
"""
import argparse
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_PATHS = ["runtime", "parallel", "launcher", "kernels/cpu"]
EXTENSIONS = (".cpp", ".cc", ".cxx", ".h", ".hpp", ".cu", ".cuh")
IDENT_START = re.compile(r"[A-Za-z_]")
IDENT_CHAR = re.compile(r"[A-Za-z0-9_]")


def blank_out(src):
    """src with comments, string / char literals (their quotes kept) and preprocessor lines
    replaced by spaces; newlines kept, so offsets and line numbers stay those of the file."""
    out = list(src)
    n = len(src)

    def wipe(a, b):
        for k in range(a, min(b, n)):
            if out[k] != "\n":
                out[k] = " "

    i = 0
    line_start = True  # only whitespace since the last newline
    while i < n:
        c = src[i]
        if c == "\n":
            line_start = True
            i += 1
            continue
        if c in " \t\r\f\v":
            i += 1
            continue
        if c == "#" and line_start:  # a preprocessor directive, with its continuation lines
            j = i
            while j < n:
                e = src.find("\n", j)
                if e < 0:
                    e = n
                if e > 0 and src[e - 1] == "\\" and e < n:
                    j = e + 1
                    continue
                break
            wipe(i, e)
            i = e
            continue
        line_start = False
        if src.startswith("//", i):
            e = src.find("\n", i)
            e = n if e < 0 else e
            wipe(i, e)
            i = e
        elif src.startswith("/*", i):
            e = src.find("*/", i + 2)
            e = n if e < 0 else e + 2
            wipe(i, e)
            i = e
        elif c == '"':
            m = re.search(r"(?:u8|[uUL])?R$", src[max(0, i - 3):i])
            if m and (i - len(m.group(0)) == 0 or not IDENT_CHAR.match(src[i - len(m.group(0)) - 1])):
                p = src.find("(", i + 1)  # raw string: R"delim( ... )delim"
                delim = src[i + 1:p] if p >= 0 else ""
                e = src.find(")" + delim + '"', p + 1) if p >= 0 else -1
                e = n if e < 0 else e + len(delim) + 2
                wipe(i + 1, e - 1)
                i = e
            else:
                j = i + 1
                while j < n and src[j] != '"' and src[j] != "\n":
                    j += 2 if src[j] == "\\" else 1
                wipe(i + 1, j)
                i = j + 1
        elif c == "'":
            k = i - 1  # a digit separator (1'000) belongs to a number token
            while k >= 0 and (IDENT_CHAR.match(src[k]) or src[k] in "'."):
                k -= 1
            if i > 0 and k + 1 < i and src[k + 1].isdigit():
                i += 1
                continue
            j = i + 1
            while j < n and src[j] != "'" and src[j] != "\n":
                j += 2 if src[j] == "\\" else 1
            wipe(i + 1, j)
            i = j + 1
        else:
            i += 1
    return "".join(out)


TOKEN = re.compile(r"\s*(?:([A-Za-z_][A-Za-z0-9_]*)|(::|->|\.\.\.|&&|<<=|>>=|<=>|[-+*/%^&|!=<>]=?|.))", re.S)


def tokenize(text):
    """(token, offset) pairs of a declaration; `operator` and its symbol become one token."""
    toks = []
    pos = 0
    while True:
        m = TOKEN.match(text, pos)
        if not m or m.end() == pos:
            break
        t = m.group(1) or m.group(2)
        if t is None or not t.strip():
            pos = m.end()
            continue
        toks.append([t, m.start(1) if m.group(1) else m.start(2)])
        pos = m.end()
    merged = []
    i = 0
    while i < len(toks):
        t, off = toks[i]
        if t == "operator":
            j = i + 1
            if j + 1 < len(toks) and toks[j][0] == "(" and toks[j + 1][0] == ")":
                sym, j = "()", j + 2
            else:
                parts = []
                while j < len(toks) and toks[j][0] != "(":
                    parts.append(toks[j][0])
                    j += 1
                sym = " ".join(parts) if parts and IDENT_START.match(parts[0]) else "".join(parts)
            merged.append(["operator" + ("" if not sym or not IDENT_START.match(sym) else " ") + sym, off])
            i = j
        else:
            merged.append([t, off])
            i += 1
    return merged


def is_ident(t):  # identifiers, and the merged `operator...` tokens
    return bool(IDENT_START.match(t))


QUALIFIERS = {"const", "volatile", "noexcept", "override", "final", "&", "&&", "mutable", "throw", "try",
              "[", "]", "(", ")"}
NOT_NAMES = {"if", "for", "while", "switch", "return", "sizeof", "decltype", "alignas", "static_assert",
             "noexcept", "throw", "requires", "catch", "__attribute__", "alignof"}


def strip_template_prefix(toks):
    """toks without leading `template <...>` clauses (several for member templates)."""
    while len(toks) >= 2 and toks[0][0] == "template" and toks[1][0] == "<":
        depth, k = 0, 1
        while k < len(toks):
            t = toks[k][0]
            if t == "(":
                p = 1
                k += 1
                while k < len(toks) and p:
                    p += {"(": 1, ")": -1}.get(toks[k][0], 0)
                    k += 1
                continue
            if t == "<":
                depth += 1
            elif t == ">":
                depth -= 1
            elif t == ">>":
                depth -= 2
            k += 1
            if depth <= 0:
                break
        toks = toks[k:]
    return toks



def skip_template_args(toks, j):
    """toks[j] is the '>' closing a template argument list: the index of the token before its '<'."""
    d = 0
    while j >= 0:
        d += (toks[j][0] == ">") - (toks[j][0] == "<")
        j -= 1
        if d == 0:
            break
    return j

def function_name(toks):
    """The name of the function whose body follows this declaration, or None when it is not one
    (a variable, a lambda, an initializer). Also says whether the declaration is in the middle of
    a constructor's initializer list."""
    # Top-level paren groups (outside <...> too, counted only outside parens).
    groups = []  # (open index, close index)
    depth_p = depth_a = 0
    cut = len(toks)
    init_list = False
    for k, (t, _) in enumerate(toks):
        if t == "(":
            if depth_p == 0 and depth_a <= 0:
                open_k = k
            depth_p += 1
        elif t == ")":
            depth_p -= 1
            if depth_p == 0 and depth_a <= 0:
                groups.append((open_k, k))
        elif depth_p == 0:
            if t == "<" and k > 0 and (is_ident(toks[k - 1][0]) or toks[k - 1][0] == ">"):
                depth_a += 1
            elif t == ">" and depth_a > 0:
                depth_a -= 1
            elif t == ">>" and depth_a > 0:
                depth_a = max(0, depth_a - 2)
            elif depth_a <= 0 and groups and t in ("->", ":"):
                cut = k
                init_list = t == ":"
                break
            elif depth_a <= 0 and t == "=" and not groups:
                return None, False  # an initialized variable (a lambda, a braced value)
    groups = [g for g in groups if g[1] < cut and (g[0] == 0 or toks[g[0] - 1][0] not in NOT_NAMES)]
    if not groups:
        return None, False
    p_open, p_close = groups[-1]
    # What follows the parameter list up to the cut: qualifiers only (anything after `requires`).
    k = p_close + 1
    while k < cut:
        t = toks[k][0]
        if t == "requires":
            break
        if t == "(" or t == "[":  # noexcept(...), throw(...), [[attributes]]
            close = ")" if t == "(" else "]"
            d = 0
            while k < cut:
                d += (toks[k][0] == t) - (toks[k][0] == close)
                k += 1
                if d == 0:
                    break
            continue
        if t not in QUALIFIERS:
            return None, False
        k += 1
    # The (qualified) name before the parameter list.
    j = p_open - 1
    if j >= 0 and toks[j][0] == ">":  # an explicit specialization f<int>(...)
        j = skip_template_args(toks, j)
    parts = []
    expect_ident = True
    while j >= 0:
        t = toks[j][0]
        if expect_ident and is_ident(t) and t not in NOT_NAMES:
            parts.insert(0, t)
            j -= 1
            if j >= 0 and toks[j][0] == "~":
                parts[0] = "~" + parts[0]
                j -= 1
            expect_ident = False
        elif not expect_ident and t == "::":
            parts.insert(0, "::")
            j -= 1
            if j >= 0 and toks[j][0] == ">":  # Foo<T>::bar: the template arguments are dropped
                j = skip_template_args(toks, j)
            expect_ident = True
        else:
            break
    if not parts or parts[-1] == "::":
        return None, False
    name = "".join(parts).lstrip(":")
    if re.fullmatch(r"[A-Z][A-Z0-9_]{2,}", name) and p_close > p_open + 1:  # TEST(Suite, Name)
        name += "(" + ", ".join(join_tokens(toks[a:b]) for a, b in split_args(toks, p_open, p_close)) + ")"
    return (name, toks[p_open - 1][1] if p_open > 0 else toks[0][1]), init_list


def join_tokens(toks):
    out = ""
    for t, _ in toks:
        if out and IDENT_CHAR.match(out[-1]) and IDENT_CHAR.match(t[0]):
            out += " "
        out += t
    return out


def split_args(toks, p_open, p_close):
    spans, start, d = [], p_open + 1, 0
    for k in range(p_open + 1, p_close):
        t = toks[k][0]
        d += (t in "([{<") - (t in ")]}>")
        if t == "," and d == 0:
            spans.append((start, k))
            start = k + 1
    spans.append((start, p_close))
    return spans


ACCESS = re.compile(r"^\s*(?:(?:public|private|protected|signals|slots)\s*:(?!:)\s*)+")


class Scanner:
    def __init__(self, path, text):
        self.path = path
        self.text = text
        self.n = len(text)
        self.line_starts = [0] + [m.end() for m in re.finditer("\n", text)]
        self.found = []

    def line_of(self, off):
        lo, hi = 0, len(self.line_starts) - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.line_starts[mid] <= off:
                lo = mid
            else:
                hi = mid - 1
        return lo + 1

    def skip_balanced(self, pos, open_c, close_c):
        """Offset just past the bracket that closes the one at pos."""
        d = 0
        while pos < self.n:
            c = self.text[pos]
            if c == open_c:
                d += 1
            elif c == close_c:
                d -= 1
                if d == 0:
                    return pos + 1
            pos += 1
        return self.n

    def scope(self, pos, classes):
        """Scans a namespace (classes == []) or class body from pos; returns the offset just past
        the `}` that closes it (or the end of the file)."""
        head = pos
        while pos < self.n:
            c = self.text[pos]
            if c == ";":
                head = pos + 1
            elif c == "}":
                return pos + 1
            elif c == "(":
                pos = self.skip_balanced(pos, "(", ")")
                continue
            elif c == "{":
                decl = self.text[head:pos]
                m = ACCESS.match(decl)
                base = head + (m.end() if m else 0)
                decl = self.text[base:pos]
                toks = strip_template_prefix(tokenize(decl))
                words = [t for t, _ in toks]
                if not toks:  # a bare block
                    pos = self.skip_balanced(pos, "{", "}")
                    head = pos
                    continue
                if words[0] in ("namespace", "inline") and "namespace" in words[:2] or \
                        words[0] == "extern" and len(words) <= 3 and '"' in words:
                    pos = self.scope(pos + 1, classes)
                    head = pos
                    continue
                if words[0] == "enum":
                    pos = self.skip_balanced(pos, "{", "}")
                    continue
                if words[0] in ("class", "struct", "union") and "(" not in words:
                    cut = words.index(":") if ":" in words else len(words)
                    name_toks = [t for t in words[1:cut] if is_ident(t) and t != "final"]
                    pos = self.scope(pos + 1, classes + [name_toks[-1] if name_toks else "<anonymous>"])
                    head = pos
                    continue
                fn, init_list = function_name(toks)
                if fn and init_list:
                    prev = decl.rstrip()
                    if prev and (IDENT_CHAR.match(prev[-1]) or prev[-1] == ">"):
                        pos = self.skip_balanced(pos, "{", "}")  # a member's braced initializer
                        continue
                if fn:
                    name, name_off = fn
                    end = self.skip_balanced(pos, "{", "}")
                    first = base + len(decl) - len(decl.lstrip())
                    start_line = self.line_of(first)
                    end_line = self.line_of(end - 1)
                    if classes and re.match(r"[A-Z][A-Z0-9_]{2,}\(", name):  # a member, not a macro
                        name = name[:name.index("(")]
                    qual = "::".join(classes + [name]) if classes and "::" not in name else name
                    self.found.append((end_line - start_line + 1, qual, self.path,
                                       self.line_of(base + name_off)))
                    pos = end
                    head = pos
                    continue
                pos = self.skip_balanced(pos, "{", "}")  # an initializer, a lambda's body, ...
                continue
            pos += 1
        return pos


def sources(paths):
    for p in paths:
        full = os.path.abspath(p) if os.path.exists(p) else os.path.join(ROOT, p)
        if os.path.isfile(full):
            yield full
        elif os.path.isdir(full):
            for dirpath, dirnames, filenames in os.walk(full):
                dirnames.sort()
                for f in sorted(filenames):
                    if f.endswith(EXTENSIONS):
                        yield os.path.join(dirpath, f)
        else:
            sys.exit(f"longest_functions.py: no such file or folder: {p}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("paths", nargs="*", help="more files or folders (relative to here or to the repository root)")
    ap.add_argument("--only", action="store_true", help="scan only the given paths, not the default folders")
    ap.add_argument("--top", type=int, default=20, help="how many to print (0: all; default 20)")
    ap.add_argument("--max", type=int, metavar="N",
                    help="exit 1 when any function scanned is longer than N lines (and list those)")
    args = ap.parse_args()
    defaults = [os.path.join(ROOT, p) for p in DEFAULT_PATHS]
    paths = args.paths if args.only else defaults + args.paths
    if not paths:
        ap.error("--only needs paths")
    found = []
    seen = set()
    for f in sources(paths):
        if f in seen:
            continue
        seen.add(f)
        with open(f, encoding="utf-8", errors="replace") as fh:
            text = blank_out(fh.read())
        s = Scanner(os.path.relpath(f, ROOT), text)
        pos = 0
        while pos < len(text):  # past a stray `}`, the rest of the file is still scanned
            pos = s.scope(pos, [])
        found.extend(s.found)
    found.sort(key=lambda r: (-r[0], r[2], r[3]))
    shown = found if args.top <= 0 else found[:args.top]
    width = max([len(r[1]) for r in shown] + [8])
    print(f"{'lines':>6}  {'function':<{width}}  file:line")
    for lines, name, path, line in shown:
        print(f"{lines:>6}  {name:<{width}}  {path}:{line}")
    print(f"({len(found)} functions in {len(seen)} files)")
    if args.max is not None:
        over = [r for r in found if r[0] > args.max]
        if over:
            print(f"{len(over)} function(s) longer than {args.max} lines:", file=sys.stderr)
            for lines, name, path, line in over:
                print(f"  {lines:>5}  {name}  {path}:{line}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
