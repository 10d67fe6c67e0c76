#!/usr/bin/env python3
"""Import cycles between the modules of one crate: `module-cycles.py crates/NAME/src`.

For every module, its direct submodules are the nodes; A -> B when code anywhere under A
names anything under B (`crate::...`, `super::...`, `self::...` paths, in `use` lines or
inline). A strongly connected set of two or more siblings is a cycle: neither can be read,
tested or moved without the other. Test code (`tests.rs`, `*_tests.rs`, a trailing
`#[cfg(test)] mod ... {`) is left out. Prints each cycle; exits 1 if there is any.
"""

import os
import re
import sys


def file_modules(src):
    """Maps each .rs file under `src` to its module path (a tuple), following `#[path]`."""
    mods = {}
    roots = [f for f in ("lib.rs", "main.rs") if os.path.exists(os.path.join(src, f))]
    todo = [(os.path.join(src, r), ()) for r in roots]
    while todo:
        path, mod = todo.pop()
        if path in mods or not os.path.exists(path):
            continue
        mods[path] = mod
        text = open(path, encoding="utf-8").read()
        base = os.path.dirname(path)
        own_dir = base if os.path.basename(path) in ("lib.rs", "main.rs", "mod.rs") else \
            os.path.join(base, os.path.basename(path)[:-3])
        for m in re.finditer(r'(#\[path\s*=\s*"([^"]+)"\]\s*)?(?:#\[[^\]]*\]\s*)*'
                             r'(?:pub(?:\([^)]*\))?\s+)?mod\s+(\w+)\s*;', text):
            name = m.group(3)
            if m.group(2):
                child = os.path.join(base, m.group(2))
            elif os.path.exists(os.path.join(own_dir, name + ".rs")):
                child = os.path.join(own_dir, name + ".rs")
            else:
                child = os.path.join(own_dir, name, "mod.rs")
            todo.append((child, mod + (name,)))
    return mods


def strip_tests(text):
    m = re.search(r'#\[cfg\(test\)\]\s*(?:pub(?:\([^)]*\))?\s+)?mod\s+\w+\s*\{', text)
    return text[: m.start()] if m else text


def referenced(text, mod, is_dir_module):
    """Module paths named by `text`, which lives in module `mod`."""
    text = re.sub(r'//[^\n]*', '', text)
    out = set()
    for m in re.finditer(r'\b(crate|super|self)((?:::(?:super|\w+))*)::(\{)?', text):
        head, rest, brace = m.group(1), m.group(2), m.group(3)
        parts = [p for p in rest.split("::") if p]
        if head == "crate":
            base = ()
        else:
            # `self` in a file module is the module; `super` its parent.
            base = mod if head == "self" else mod[:-1]
        for p in parts:
            if p == "super":
                base = base[:-1]
            else:
                base = base + (p,)
        if brace:
            depth, i, names, cur = 1, m.end(), [], ""
            while i < len(text) and depth:
                c = text[i]
                if c == "{":
                    depth += 1
                elif c == "}":
                    depth -= 1
                if depth == 1 and c in ",":
                    names.append(cur)
                    cur = ""
                elif depth >= 1:
                    cur += c
                i += 1
            names.append(cur)
            for n in names:
                first = re.match(r'\s*(\w+)', n)
                if first and first.group(1) != "self":
                    out.add(base + (first.group(1),))
            out.add(base)
        else:
            out.add(base)
    return out


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    src = sys.argv[1]
    mods = file_modules(src)
    known = set(mods.values())
    edges = {}
    for path, mod in mods.items():
        name = os.path.basename(path)
        if name == "tests.rs" or name.endswith("_tests.rs") or "tests" in mod:
            continue
        text = strip_tests(open(path, encoding="utf-8").read())
        for ref in referenced(text, mod, name == "mod.rs"):
            # The longest known module prefix of the path is the module it names.
            while ref and ref not in known:
                ref = ref[:-1]
            edges.setdefault(mod, set()).add(ref)
    cycles = []
    parents = {m[:-1] for m in known if m}
    for parent in sorted(parents):
        children = sorted({m[len(parent)] for m in known
                           if len(m) > len(parent) and m[: len(parent)] == parent})
        graph = {c: set() for c in children}
        for src_mod, targets in edges.items():
            if src_mod[: len(parent)] != parent or len(src_mod) <= len(parent):
                continue
            a = src_mod[len(parent)]
            for t in targets:
                if t[: len(parent)] == parent and len(t) > len(parent) and t[len(parent)] != a:
                    graph[a].add(t[len(parent)])
        for scc in strongly_connected(graph):
            if len(scc) > 1:
                cycles.append("::".join(("crate",) + parent) + ": " + " <-> ".join(sorted(scc)))
    for c in cycles:
        print(c)
    print(f"{len(cycles)} cycle(s) in {src}")
    sys.exit(1 if cycles else 0)


def strongly_connected(graph):
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            scc = []
            while True:
                w = stack.pop()
                on.discard(w)
                scc.append(w)
                if w == v:
                    break
            out.append(scc)

    for v in graph:
        if v not in index:
            visit(v)
    return out


if __name__ == "__main__":
    main()
