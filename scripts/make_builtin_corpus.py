#!/usr/bin/env python3
"""Build scripts/builtin_corpus.txt, the training text of the built-in model's tokenizer
(and of its short language-model warm-up).

Offline and deterministic for a given Python installation: it concatenates
  1. docstrings (English prose about programming) of a fixed list of CPython standard-library
     modules, read with `ast` from the .py sources (nothing is imported),
  2. the full source code of a few small standard-library modules (code),
  3. this repository's own Markdown documentation (README.md, docs/*.md).
The output is committed; regenerating it with another Python version gives slightly different
text, which is fine: scripts/make_builtin_model.py only reads the committed file.

CPython's library is under the PSF License Agreement (permissive); see models/builtin/README.md.

    python3 scripts/make_builtin_corpus.py [--out scripts/builtin_corpus.txt] [--max-bytes 450000]
"""

import argparse
import ast
import os
import sysconfig

DOC_MODULES = [
    "abc", "argparse", "base64", "bisect", "calendar", "cmd", "codecs", "collections/__init__",
    "configparser", "contextlib", "copy", "csv", "dataclasses", "datetime", "difflib", "doctest",
    "email/message", "enum", "filecmp", "fileinput", "fnmatch", "fractions", "ftplib", "functools",
    "getopt", "gettext", "glob", "graphlib", "gzip", "hashlib", "heapq", "hmac", "html/parser",
    "http/client", "http/cookies", "imaplib", "inspect", "ipaddress", "json/__init__",
    "json/decoder", "json/encoder", "logging/__init__", "lzma", "mailbox", "mimetypes",
    "netrc", "numbers", "operator", "optparse", "os", "pathlib", "pdb", "pickle", "pkgutil",
    "platform", "plistlib", "pprint", "queue", "quopri", "random", "reprlib", "sched", "secrets",
    "selectors", "shelve", "shlex", "shutil", "smtplib", "socket", "socketserver", "statistics",
    "string", "subprocess", "tarfile", "tempfile", "textwrap", "threading", "timeit", "tokenize",
    "trace", "traceback", "turtle", "typing", "unittest/case", "urllib/parse", "urllib/request",
    "uuid", "warnings", "wave", "weakref", "webbrowser", "zipfile", "zipimport",
]

CODE_MODULES = [
    "bisect", "heapq", "textwrap", "fnmatch", "colorsys", "shlex", "graphlib", "sched", "keyword",
    "reprlib", "glob", "getopt",
]

REPO_DOCS = ["README.md", "docs"]


def docstrings(path):
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    out = []

    def visit(node, prefix):
        doc = ast.get_docstring(node, clean=True)
        if doc:
            out.append((prefix, doc))
        for child in getattr(node, "body", []):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                if child.name.startswith("_") and not child.name.startswith("__init__"):
                    continue
                visit(child, f"{prefix}.{child.name}" if prefix else child.name)

    visit(tree, "")
    return out


def strip_header(src):
    # Drop leading comment/licence lines so the code part is mostly code.
    lines = src.splitlines()
    i = 0
    while i < len(lines) and (lines[i].startswith("#") or not lines[i].strip()):
        i += 1
    return "\n".join(lines[i:]).strip() + "\n"


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    repo = os.path.dirname(here)
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(here, "builtin_corpus.txt"))
    ap.add_argument("--max-bytes", type=int, default=450_000)
    args = ap.parse_args()

    stdlib = sysconfig.get_paths()["stdlib"]
    parts = []

    # Repository docs first (small, and the most on-topic text for this project).
    for entry in REPO_DOCS:
        p = os.path.join(repo, entry)
        files = [p] if os.path.isfile(p) else sorted(
            os.path.join(p, f) for f in os.listdir(p) if f.endswith(".md")) if os.path.isdir(p) else []
        for fp in files:
            with open(fp, encoding="utf-8") as f:
                parts.append(f.read().strip() + "\n")

    code = []
    for mod in CODE_MODULES:
        fp = os.path.join(stdlib, mod + ".py")
        if os.path.exists(fp):
            with open(fp, encoding="utf-8") as f:
                code.append(f"# file: {mod}.py\n" + strip_header(f.read()))

    prose = []
    for mod in DOC_MODULES:
        fp = os.path.join(stdlib, mod + ".py")
        if not os.path.exists(fp):
            continue
        name = mod.replace("/__init__", "").replace("/", ".")
        for qual, doc in docstrings(fp):
            title = f"{name}.{qual}" if qual else name
            prose.append(f"{title}\n\n{doc.strip()}\n")

    # Interleave prose and code blocks deterministically (roughly 3:1 by count) so any prefix
    # of the corpus has both, then cut at max-bytes on a block boundary.
    blocks = list(parts)
    ci = 0
    for i, p in enumerate(prose):
        blocks.append(p)
        if i % 40 == 39 and ci < len(code):
            blocks.append(code[ci])
            ci += 1
    blocks.extend(code[ci:])

    text, size = [], 0
    for b in blocks:
        b = b.replace("\r\n", "\n")
        n = len(b.encode("utf-8")) + 1
        if size + n > args.max_bytes:
            continue
        text.append(b)
        size += n
    with open(args.out, "w", encoding="utf-8") as f:
        f.write("\n".join(text))
    print(f"wrote {args.out}: {os.path.getsize(args.out)} bytes, {len(text)} blocks")


if __name__ == "__main__":
    main()
