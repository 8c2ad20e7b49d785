#!/usr/bin/env python3
"""Import cycles between the files of each crate of the workspace.

Every `.rs` file under a crate's `src/` is one module (`a.rs` and `a/mod.rs` are `a`). A file
depends on another when it names an item of it: `use crate::a::X`, `super::X`, `self::b::X`, a
child module by its bare name, or the same paths written inline; a path may also start with a
name a `use` brought in (`use crate::a;` or `use super::a as b;`, then `a::b::X` or `b::b::X`
names `X` in `a/b.rs`). Names a module re-exports with
`pub use` are followed to the module that defines them, so a facade (`lib.rs`, a `mod.rs` that
only re-exports) adds no edge of its own. Inline `#[cfg(test)] mod tests { .. }` blocks are
skipped. Exits 1 and prints each strongly connected group of files when there is a cycle.

    python3 scripts/module_cycles.py [ROOT]
    python3 scripts/module_cycles.py --self-test   # the analysis on small inline crates
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


def expand_use_aliased(tree):
    """`a::{b as x, c::{self, d}}` -> [('a::b', 'x'), ('a::c', None), ('a::c::d', None)]."""
    tree = tree.strip()
    brace = tree.find("{")
    if brace < 0:
        m = re.match(r"^(.*?)(?:\s+as\s+(" + IDENT + r"))?$", tree, re.S)
        return [(m.group(1).strip(), m.group(2))]
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
            for path, alias in expand_use_aliased(part):
                out.append((prefix.rstrip(":") if path == "self" else prefix + path, alias))
    return out


def expand_use(tree):
    """`a::{b, c::{d, e}}` -> ['a::b', 'a::c::d', 'a::c::e'] (aliases dropped)."""
    return [path for path, _ in expand_use_aliased(tree)]


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
            texts[mod] = f.read()
    return modules, module_edges(texts)


def module_edges(sources):
    """{module: set of modules it depends on} for {module path tuple: source text}."""
    texts = {mod: strip_test_modules(strip_comments_and_strings(text)) for mod, text in sources.items()}
    modules = set(texts)

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
            for path, alias in expand_use_aliased(m.group(1)):
                segs = [s for s in path.split("::") if s]
                target = absolute(mod, segs)
                if target and segs[-1] != "*":
                    reexports[(mod, alias or segs[-1])] = target

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
        uses = []
        for m in re.finditer(r"\buse\s+([^;]+);", text):
            uses += expand_use_aliased(m.group(1))
        # What each `use` brings into scope under its own name: `use crate::a;` (or
        # `use super::a as b;`) lets the file write `a::b::Item` (`b::b::Item`), a path that
        # starts with neither `crate`/`super`/`self` nor a child module.
        bindings = {}
        for path, alias in uses:
            segs = [s for s in path.split("::") if s]
            name = alias or (segs[-1] if segs else None)
            if not segs or segs[-1] == "*" or name in (None, "_", "self", "super", "crate"):
                continue
            target = absolute(mod, segs)
            if target:
                bindings[name] = target
        paths = [path for path, _ in uses]
        # Inline paths outside `use` items: those are expanded above, and the prefix of a
        # grouped `use a::b::{c, d};` (`a::b`) names nothing by itself.
        body = re.sub(r"\buse\s+[^;]+;", "", text)
        paths += re.findall(r"\b((?:crate|super|self)(?:::" + IDENT + r")+)", body)
        paths += re.findall(r"(?<![:\w])(" + IDENT + r"(?:::" + IDENT + r")+)", body)
        for path in paths:
            segs = [s for s in path.split("::") if s and s != "*"]
            target = absolute(mod, segs)
            if target is None and segs and segs[0] in bindings:
                target = bindings[segs[0]] + segs[1:]
            if target is None:
                continue
            dst = owner(target)
            if dst != mod and dst != () and dst in modules:
                edges[mod].add(dst)
    return edges


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


# --self-test: small crates (module path tuple -> source) and the cycles each must have.
SELF_TESTS = [
    (
        "a module imported by name, then used through a path",
        {
            (): "mod families; mod model;",
            ("model",): "use crate::families;\nfn f() { let l = families::qwen::LOADER; }",
            ("families",): "pub mod qwen;",
            ("families", "qwen"): "use crate::model::FamilyLoader;",
        },
        [{("model",), ("families", "qwen")}],
    ),
    (
        "the same through `super` and an alias",
        {
            (): "mod a;",
            ("a",): "mod b; mod c;",
            ("a", "b"): "use super::c as other;\nfn f() { other::d::run(); }",
            ("a", "c"): "pub mod d;",
            ("a", "c", "d"): "use crate::a::b::Thing;",
        },
        [{("a", "b"), ("a", "c", "d")}],
    ),
    (
        "a name imported from a module's facade is followed to its definition",
        {
            (): "mod s;",
            ("s",): "mod p; mod q; pub use p::Params;\nuse q::Adjust;",
            ("s", "p"): "pub struct Params;",
            ("s", "q"): "use super::Params;\nfn f() { Params::default(); }",
        },
        [],
    ),
    (
        "paths inside a test module add no edge",
        {
            (): "mod a; mod b;",
            ("a",): "use crate::b;\nfn f() { b::g(); }",
            ("b",): "#[cfg(test)]\nmod tests {\n    use crate::a;\n    fn t() { a::f(); }\n}",
        },
        [],
    ),
]


def self_test():
    """Runs SELF_TESTS; exits 1 naming each case whose cycles differ."""
    failed = 0
    for name, sources, want in SELF_TESTS:
        edges = module_edges(sources)
        got = [set(group) for group in strongly_connected(edges)]
        if sorted(map(sorted, got)) != sorted(map(sorted, want)):
            failed += 1
            print(f"self-test failed: {name}: cycles {got}, expected {want}")
    if failed:
        sys.exit(1)
    print(f"self-test: {len(SELF_TESTS)} cases pass")


def main():
    if sys.argv[1:] == ["--self-test"]:
        self_test()
        return
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
