#!/usr/bin/env python3
"""Fails when development-history wording appears in the product outside CHANGELOG.md.

The product text (README, docs, file names, code comments) is reference: it says what the
system is and why it is built so, for a reader who never saw it being built. Labels of work
periods and runs ("session 24", "call 3", "run 10", run tags such as "S18", "issue 47",
"#47") mean nothing to that reader; CHANGELOG.md is where dated history lives.

Checked:
  * every Markdown file (whole text), except CHANGELOG.md;
  * every path (file and folder names);
  * comments of C++/CUDA/proto sources (// and /* */), and of Python, shell, CMake and YAML
    files (# comments; Python docstrings too).

  check_history.py [--root DIR] [--list]     exit 0 when clean, 1 with one line per finding

Exceptions are listed in ALLOWED below, each with its reason.
"""
import argparse
import os
import re
import subprocess
import sys

# (name, pattern, flags). Matched against prose (Markdown) and comments.
PATTERNS = [
    ("work-period label", r"(?<!-)\bsessions? \d+", re.I),
    ("work-period label", r"\bsession-\d+", re.I),
    ("work-period reference", r"\b(?:this|last|next|previous|earlier|later|that) session\b(?!s)", re.I),
    ("run label", r"(?<!-)\bcalls? \d+(?:\s*[-,]\s*\d+)*\b", re.I),
    ("run label", r"(?<!-)\brun \d+\b(?!%)", re.I),
    ("run label", r"\bruns \d+\s*(?:-|,|and)\s*\d+", re.I),
    ("run label", r"\b[Rr]uns? [A-E]\b", 0),
    ("run tag", r"\bS\d{1,2}\b", 0),
    ("issue reference", r"\bissues? \d+", re.I),
    ("issue reference", r"\bissue-\d+", re.I),
    ("issue reference", r"(?<![\w&/#])#\d+\b", 0),
    ("issue reference", r"\bdefects? \d+", re.I),
    ("issue reference", r"§\s*\d", 0),
    ("history file", r"verify_pending", 0),
    ("history file", r"\btmp_call\d+", 0),
]

# Extra patterns for comments in code only: dates of work periods.
CODE_ONLY = [
    ("dated comment", r"\b20\d\d-\d\d-\d\d\b", 0),
]

# Path components that carry history labels.
NAME_PATTERNS = [
    r"session", r"verify_pending", r"(?:^|[_.-])s\d{1,2}(?:[_.-]|$)", r"(?:^|[_.-])run\d+",
    r"(?:^|[_.-])run[A-Z](?:[_.-]|$)", r"(?:^|[_.-])v\d+(?:[_.-]|$)", r"call\d+",
]

# Allowed exceptions: (path regex, text regex, reason). A finding is dropped when its path
# matches the first and the matched text (or, for names, the path) matches the second; a text
# regex starting with "line:" is matched against the whole line instead.
ALLOWED = [
    (r".*", r"^S3$", "Amazon S3 and S3-compatible stores are product names, not run tags"),
    (r".*", r"line:(?i)\b(?:LMCache|vLLM|SGLang|llama\.cpp|transformers|PyTorch|cuDNN|CUTLASS|UCX|"
     r"RocksDB|etcd|gRPC|protobuf|abseil|civetweb|NCCL)(?:'s)? (?:issue|#)",
     "an upstream project's public issue is a citation, not our history"),
    (r"^bench/loadgen/", r"line:(?i)\bsession\b",
     "the chat workload's sessions are conversations, not work periods"),
    (r"^tests/docs/check_history\.py$", r".*", "this checker names the patterns it rejects"),
    (r"^CHANGELOG\.md$", r".*", "the changelog is where history belongs"),
    (r"^tests/model/chat_templates/.*", r".*",
     "upstream chat templates, kept byte for byte as published"),
]

SKIP_DIRS = {".git", "build", "node_modules", ".stage", ".deps", "__pycache__"}
SKIP_PREFIXES = ("build-", "build/")

C_LIKE = (".cc", ".h", ".cu", ".cuh", ".cpp", ".hpp", ".proto", ".c")
HASH_LIKE = (".py", ".sh", ".cmake", ".yaml", ".yml", ".toml", ".bash")


def list_files(root):
    try:
        out = subprocess.run(
            ["git", "-C", root, "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
            check=True, capture_output=True).stdout.decode("utf-8", "replace")
        files = [f for f in out.split("\0") if f]
        return sorted(f for f in files if os.path.isfile(os.path.join(root, f)))
    except (OSError, subprocess.CalledProcessError):
        files = []
        for d, dirs, names in os.walk(root):
            dirs[:] = [x for x in dirs if x not in SKIP_DIRS and not x.startswith("build-")]
            for n in names:
                files.append(os.path.relpath(os.path.join(d, n), root))
        return sorted(files)


def c_comments(text):
    """Yields (line number, comment text) of // and /* */ comments, skipping string literals."""
    i, n, line = 0, len(text), 1
    while i < n:
        c = text[i]
        if c == "\n":
            line += 1
            i += 1
        elif c == '"' or c == "'":
            # A raw string R"delim( ... )delim" or an ordinary literal.
            if c == '"' and i > 0 and text[i - 1] == "R":
                m = re.match(r'R"([^(\s]*)\(', text[i - 1:])
                if m:
                    end = text.find(")" + m.group(1) + '"', i)
                    end = n if end < 0 else end + len(m.group(1)) + 2
                    line += text.count("\n", i, end)
                    i = end
                    continue
            j = i + 1
            while j < n and text[j] != c and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            i = j + 1
        elif text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            yield line, text[i + 2:j]
            i = j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j
            for k, part in enumerate(text[i + 2:j].split("\n")):
                yield line + k, part
            line += text.count("\n", i, j)
            i = j + 2
        else:
            i += 1


def hash_comments(text, python):
    in_doc = None
    for ln, raw in enumerate(text.split("\n"), 1):
        s = raw
        if python:
            if in_doc:
                yield ln, s
                if in_doc in s:
                    in_doc = None
                continue
            m = re.match(r'\s*[rRbBuU]?("""|\'\'\')', s)
            if m:
                rest = s[m.end():]
                yield ln, rest
                if m.group(1) not in rest:
                    in_doc = m.group(1)
                continue
        # A '#' that starts a comment: at line start or after whitespace, outside quotes
        # (approximate: quotes are counted on the line before it).
        for m in re.finditer(r"(?:^|\s)#", s):
            before = s[:m.start()]
            if before.count('"') % 2 == 0 and before.count("'") % 2 == 0:
                if not s.startswith("#!"):
                    yield ln, s[m.end():]
                break


def allowed(path, text, line=""):
    for p, t, _ in ALLOWED:
        if not re.search(p, path):
            continue
        if t.startswith("line:"):
            if re.search(t[5:], line):
                return True
        elif re.search(t, text):
            return True
    return False


def scan_text(path, lines, patterns, findings):
    for ln, s in lines:
        for name, pat, flags in patterns:
            for m in re.finditer(pat, s, flags):
                if not allowed(path, m.group(0), s):
                    findings.append(f"{path}:{ln}: {name}: '{m.group(0)}' in: {s.strip()[:120]}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default=os.path.join(os.path.dirname(__file__), "..", ".."))
    ap.add_argument("--list", action="store_true", help="print the allowed exceptions")
    a = ap.parse_args()
    root = os.path.abspath(a.root)
    if a.list:
        for p, t, why in ALLOWED:
            print(f"{p}  {t}  -- {why}")
        return 0
    findings = []
    for path in list_files(root):
        if any(part in SKIP_DIRS for part in path.split("/")) or path.startswith(SKIP_PREFIXES):
            continue
        for part in path.split("/"):
            for pat in NAME_PATTERNS:
                if re.search(pat, part) and not allowed(path, path):
                    findings.append(f"{path}: history label in a file name ('{part}')")
                    break
        base = os.path.basename(path)
        ext = os.path.splitext(base)[1]
        if base == "CHANGELOG.md":
            continue
        if ext not in (".md",) + C_LIKE + HASH_LIKE and base != "CMakeLists.txt":
            continue
        try:
            with open(os.path.join(root, path), encoding="utf-8") as f:
                text = f.read()
        except (UnicodeDecodeError, OSError):
            continue
        if ext == ".md":
            scan_text(path, enumerate(text.split("\n"), 1), PATTERNS, findings)
        elif ext in C_LIKE:
            scan_text(path, c_comments(text), PATTERNS + CODE_ONLY, findings)
        else:
            scan_text(path, hash_comments(text, ext == ".py"), PATTERNS + CODE_ONLY, findings)
    for f in findings:
        print(f)
    if findings:
        print(f"\n{len(findings)} finding(s) of development-history wording outside CHANGELOG.md "
              "(move the history there; reference text says what is, not when it was done)",
              file=sys.stderr)
        return 1
    print("no development-history wording found")
    return 0


if __name__ == "__main__":
    sys.exit(main())
