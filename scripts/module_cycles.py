#!/usr/bin/env python3
"""Import cycles between the files of each crate of the workspace.

Every `.rs` file under a crate's `src/` is one module (`a.rs` and `a/mod.rs` are `a`). A file
depends on another when it names an item of it: `use crate::a::X`, `super::X`, `self::b::X`, a
child module by its bare name, or the same paths written inline. Names a module re-exports with
`pub use` are followed to the module that defines them, so a facade (`lib.rs`, a `mod.rs` that
only re-exports) adds no edge of its own. Inline `#[cfg(test)] mod tests { .. }` blocks are
skipped. Exits 1 and prints each strongly connected group of files when there is a cycle.

    python3 scripts/module_cycles.py [ROOT]
"""

import os
import re
import sys

IDENT = r"[A-Za-z_][A-Za-z0-9_]*"


def strip_comments_and_strings(text):
    text = re.sub(r"//[^\n]*", "", text)
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    text = re.sub(r'r#*"(?:.|\n)*?"#*', '""', text)
    text = re.sub(r'"(?:\\.|[^"\\])*"', '""', text)
    return text


def strip_test_modules(text):
    out, i = [], 0
    pattern = re.compile(r"#\[cfg\(test\)\]\s*mod\s+" + IDENT + r"\s*\{")
    while True:
        m = pattern.search(text, i)
        if not m:
            out.append(text[i:])
            return "".join(out)
        out.append(text[i : m.start()])
        depth, j = 1, m.end()
        while j < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            j += 1
        i = j


def expand_use(tree):
    """`a::{b, c::{d, e}}` -> ['a::b', 'a::c::d', 'a::c::e'] (aliases dropped)."""
    tree = tree.strip()
    brace = tree.find("{")
    if brace < 0:
        return [re.sub(r"\s+as\s+" + IDENT + "$", "", tree).strip()]
    prefix, inner = tree[:brace], tree[brace + 1 : tree.rfind("}")]
    parts, depth, cur = [], 0, ""
    for ch in inner:
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
            continue
        depth += {"{": 1, "}": -1}.get(ch, 0)
        cur += ch
    parts.append(cur)
    out = []
    for part in parts:
        if part.strip():
            out += [prefix + p if p != "self" else prefix.rstrip(":") for p in expand_use(part)]
    return out


def crate_modules(src):
    """{module path tuple: file} for one crate's src/ directory."""
    modules = {}
    for dirpath, _, files in os.walk(src):
        for name in files:
            if not name.endswith(".rs"):
                continue
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, src)[:-3].split(os.sep)
            if rel[-1] in ("mod", "lib", "main"):
                rel = rel[:-1]
            if rel and rel[0] == "bin":
                continue
            modules[tuple(rel)] = path
    return modules


def analyse(src):
    modules = crate_modules(src)
    texts = {}
    for mod, path in modules.items():
        with open(path, encoding="utf-8") as f:
            texts[mod] = strip_test_modules(strip_comments_and_strings(f.read()))

    def absolute(mod, segs):
        """Resolves a path's leading `crate`/`super`/`self`/child segment against `mod`."""
        if not segs:
            return None
        if segs[0] == "crate":
            return list(segs[1:])
        if segs[0] in ("super", "self"):
            base = list(mod)
            while segs and segs[0] in ("super", "self"):
                if segs[0] == "super":
                    if not base:
                        return None
                    base.pop()
                segs = segs[1:]
            return base + list(segs)
        if tuple(mod) + (segs[0],) in modules:
            return list(mod) + list(segs)
        return None

    # pub use re-exports: (module, name) -> absolute path of what it names.
    reexports = {}
    for mod, text in texts.items():
        for m in re.finditer(r"\bpub(?:\([^)]*\))?\s+use\s+([^;]+);", text):
            for path in expand_use(m.group(1)):
                segs = [s for s in path.split("::") if s]
                target = absolute(mod, segs)
                if target and segs[-1] != "*":
                    reexports[(mod, segs[-1])] = target

    def owner(path, seen=0):
        """The file module that defines what `path` names."""
        best = ()
        for i in range(len(path), -1, -1):
            if tuple(path[:i]) in modules:
                best = tuple(path[:i])
                break
        rest = path[len(best) :]
        if rest and (best, rest[0]) in reexports and seen < 16:
            return owner(reexports[(best, rest[0])] + rest[1:], seen + 1)
        return best

    edges = {mod: set() for mod in modules}
    for mod, text in texts.items():
        paths = []
        for m in re.finditer(r"\buse\s+([^;]+);", text):
            paths += expand_use(m.group(1))
        paths += re.findall(r"\b((?:crate|super|self)(?:::" + IDENT + r")+)", text)
        paths += re.findall(r"(?<![:\w])(" + IDENT + r"(?:::" + IDENT + r")+)", text)
        for path in paths:
            segs = [s for s in path.split("::") if s and s != "*"]
            target = absolute(mod, segs)
            if target is None:
                continue
            dst = owner(target)
            if dst != mod and dst != () and dst in modules:
                edges[mod].add(dst)
    return modules, edges


def strongly_connected(edges):
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(group)

    sys.setrecursionlimit(10000)
    for v in edges:
        if v not in index:
            visit(v)
    return out


def main():
    root = sys.argv[1] if len(sys.argv) > 1 else "."
    crates = [os.path.join(root, "src")]
    crates += [os.path.join(root, d, "src") for d in sorted(os.listdir(root))]
    found = 0
    for src in crates:
        if not os.path.isdir(src) or not os.path.exists(os.path.join(os.path.dirname(src), "Cargo.toml")):
            continue
        modules, edges = analyse(src)
        for group in strongly_connected(edges):
            found += 1
            files = sorted(os.path.relpath(modules[m], root) for m in group)
            print("cycle: " + " <-> ".join(files))
    if found:
        sys.exit(1)
    print("no import cycles")


if __name__ == "__main__":
    main()
