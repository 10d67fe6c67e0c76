#!/usr/bin/env python3
"""Checks that ARCHITECTURE.md names only things that exist (run by scripts/check-repo.sh).

A map that cites a file that moved, or a function that was renamed, sends the next reader
to the wrong place; this keeps the map true as the code moves:

- every cited file (`crates/kv/src/pool.rs`, or a shorter `kernels/tile_out.rs`, the end
  of some tracked file's path) exists;
- every cited Rust path that starts with a workspace crate (`engine::handoff::VerifiedImport`,
  `kv::PageLease`) resolves: its modules are files of that crate, and the item after them
  is defined in that module (or anywhere in the crate, for one re-exported at its root);
  a further segment (a method, a variant, an associated item) is defined in the crate;
- every cited `Type::member` names a type and a member defined in some crate;
- every cited snake_case name (a test, a function, a flag's field: `unwritten_read`,
  `test_over_the_limit_is_400`) appears as a word in some tracked Rust or Python file, or is a tracked file's stem.

Prints one line per dangling name and exits 1 if there is any.
"""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "ARCHITECTURE.md"
ITEM = r"(?:fn|struct|enum|trait|type|const|static|mod|union)\s+{name}\b|macro_rules!\s*{name}\b"


def tracked():
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True)
    return out.stdout.split()


def crates():
    """Workspace crate name (as Rust code spells it) -> its src folder."""
    found = {}
    for manifest in sorted(ROOT.glob("crates/*/Cargo.toml")):
        name = re.search(r'^name\s*=\s*"([^"]+)"', manifest.read_text(), re.M).group(1)
        found[name.replace("-", "_")] = manifest.parent / "src"
    return found


def defines(text, name):
    """Whether `text` defines `name`: an item, a variant, a field or a re-export."""
    if re.search(r"\b(?:pub(?:\([^)]*\))?\s+)?(?:async\s+|unsafe\s+|const\s+)*"
                 + ITEM.format(name=re.escape(name)), text):
        return True
    # Enum variants, struct fields and `use` re-exports.
    n = re.escape(name)
    return bool(re.search(r"(?m)^\s*" + n + r"\s*[({,]|^\s*" + n + r"\s*$|^\s*(?:pub(?:\([^)]*\))?\s+)?"
                          + n + r"\s*:[^:]|\buse\b[^;]*\b" + n + r"\b[^;]*;", text))


def module_files(src, parts):
    """The files of module `parts` under `src`, or None if there is no such module file."""
    base = src.joinpath(*parts) if parts else src
    if not parts:
        return [p for p in (src / "lib.rs", src / "main.rs") if p.exists()]
    for candidate in (base.with_suffix(".rs"), base / "mod.rs"):
        if candidate.exists():
            return [candidate]
    return None


def crate_text(src):
    return "\n".join(p.read_text(encoding="utf-8") for p in src.rglob("*.rs"))


def main():
    doc = DOC.read_text(encoding="utf-8")
    spans = set(re.findall(r"`([^`\n]+)`", doc))
    files = tracked()
    names = crates()
    texts = {}
    everything = None
    problems = []

    for span in sorted(spans):
        path = span.split(":")[0]
        if re.fullmatch(r"[A-Za-z0-9_./-]+\.(rs|sh|py|proto|toml|json|jinja)", path):
            if not (ROOT / path).exists() and not any(
                    f == path or f.endswith("/" + path) for f in files):
                problems.append(f"cites {path}, which is no file of the repository")

    for span in sorted(spans):
        m = re.fullmatch(r"([A-Za-z_][A-Za-z0-9_]*(?:::[A-Za-z_][A-Za-z0-9_]*)+)(?:\(\))?", span)
        if not m:
            continue
        parts = m.group(1).split("::")
        if parts[0] in names:
            src = names[parts[0]]
            if src not in texts:
                texts[src] = crate_text(src)
            rest, mods = parts[1:], []
            while rest and module_files(src, mods + [rest[0]]) is not None:
                mods.append(rest.pop(0))
            if not rest:
                continue
            scope = texts[src] if not mods else "\n".join(
                p.read_text(encoding="utf-8") for p in module_files(src, mods)
                + list((src.joinpath(*mods)).rglob("*.rs")) if p.exists())
            if not defines(scope, rest[0]):
                where = "::".join([parts[0]] + mods)
                problems.append(f"cites {span}: {where} defines no {rest[0]}")
                continue
            for member in rest[1:]:
                if not defines(texts[src], member):
                    problems.append(f"cites {span}: crate {parts[0]} defines no {member}")
        elif parts[0][:1].isupper():
            if everything is None:
                everything = "\n".join(crate_text(src) for src in names.values())
            for part in parts:
                if not defines(everything, part):
                    problems.append(f"cites {span}: no crate defines {part}")
                    break

    words = None
    for span in sorted(spans):
        if not re.fullmatch(r"[a-z][a-z0-9]*(?:_[a-z0-9]+)+(?:\(\))?", span):
            continue
        if words is None:
            # File stems count too: fuzz targets and scripts are named by their files.
            words = {Path(f).stem for f in files}
            for f in files:
                if f.endswith((".rs", ".py")):
                    words.update(re.findall(r"\b[a-z][a-z0-9_]*\b",
                                            (ROOT / f).read_text(encoding="utf-8", errors="replace")))
        if span.rstrip("()") not in words:
            problems.append(f"cites {span}, which no Rust or Python file of the repository names")

    for p in problems:
        print(f"check-architecture: ARCHITECTURE.md {p}", file=sys.stderr)
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
