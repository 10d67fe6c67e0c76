"""What can be checked of deploy/Containerfile without building it (scripts/check-deploy.sh).

- the build stage copies paths that exist in the repository, builds the kvwarden package, and
  its Rust image is at least the workspace's rust-version;
- both stages are the same Debian release, so the binary needs no newer glibc than the
  runtime has;
- the runtime stage adds nothing but the build stage's binary (no model, no other file), runs
  it as ENTRYPOINT in exec form, as a numeric non-root user;
- the binary's shared libraries (given as `ldd` output) are glibc's and libgcc_s only, and each
  is in the runtime base's Debian packages (given as `dpkg-deb -c` listings, when available).

Prints `binary_from=PATH` (where the runtime stage takes the binary from the build stage) and
`build_copy=SRC DEST` per file the build stage copies on stdout; failures on stderr, exit 1.
"""

import argparse
import json
import re
import sys
from pathlib import Path

DEBIAN = {"bookworm": "12", "trixie": "13"}
# What distroless/cc adds to the C library: libgcc_s (Rust's unwinder); libm and the dynamic
# loader are glibc's own.
ALLOWED_LIBS = {"linux-vdso.so.1", "libc.so.6", "libm.so.6", "libgcc_s.so.1", "ld-linux-x86-64.so.2",
                "ld-linux-aarch64.so.1", "libpthread.so.0", "libdl.so.2", "librt.so.1"}


def instructions(text):
    """(KEYWORD, rest) per instruction, continuation lines joined, comments dropped."""
    out, cur = [], ""
    for line in text.splitlines():
        if not cur and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            cur += line.rstrip()[:-1] + " "
            continue
        cur += line
        kw, _, rest = cur.strip().partition(" ")
        out.append((kw.upper(), rest.strip()))
        cur = ""
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("containerfile")
    ap.add_argument("--root", required=True, help="the build context (repository root)")
    ap.add_argument("--ldd", required=True, help="`ldd target/debug/kvwarden` output")
    ap.add_argument("--package-list", action="append", default=[], help="`dpkg-deb -c` of a runtime package")
    args = ap.parse_args()
    errors = []
    fail = errors.append
    root = Path(args.root)

    args_default, stages = {}, []
    for kw, rest in instructions(Path(args.containerfile).read_text()):
        if kw == "ARG" and not stages:
            name, _, value = rest.partition("=")
            args_default[name] = value
        elif kw == "FROM":
            m = re.fullmatch(r"(\S+)(?:\s+AS\s+(\S+))?", rest, re.I)
            image = re.sub(r"\$\{(\w+)\}", lambda v: args_default.get(v.group(1), ""), m.group(1))
            stages.append({"image": image, "name": m.group(2), "ops": []})
        elif stages:
            stages[-1]["ops"].append((kw, rest))
    if len(stages) != 2 or stages[0]["name"] != "build":
        fail(f"expected two stages, the first named `build`; found {[(s['name'], s['image']) for s in stages]}")
        return done(errors)
    build, runtime = stages

    # Build stage.
    m = re.search(r"/rust:(\d+)\.(\d+)(?:\.\d+)?-slim-(\w+)$", build["image"])
    workspace = re.search(r'^rust-version = "(\d+)\.(\d+)', (root / "Cargo.toml").read_text(), re.M)
    if not m:
        fail(f"the build image {build['image']} is not a rust:X.Y-slim-RELEASE image")
    elif (int(m.group(1)), int(m.group(2))) < (int(workspace.group(1)), int(workspace.group(2))):
        fail(f"the build image {build['image']} is older than the workspace's rust-version")
    build_release = m.group(3) if m else None
    runs = " ".join(rest for kw, rest in build["ops"] if kw == "RUN")
    if not re.search(r"cargo build\b.*--release\b.*-p kvwarden\b", runs):
        fail("the build stage does not run `cargo build --release ... -p kvwarden`")
    build_copies = []
    for kw, rest in build["ops"]:
        if kw in ("COPY", "ADD"):
            words = [w for w in rest.split() if not w.startswith("--")]
            for src in words[:-1]:
                build_copies.append(f"{src} {words[-1]}")
                if not (root / src).exists():
                    fail(f"the build stage copies {src}, which is not in the repository")

    # Runtime stage.
    m = re.search(r"debian(\d+)", runtime["image"])
    if not m or not build_release or DEBIAN.get(build_release) != m.group(1):
        fail(f"the build image ({build['image']}) and the runtime ({runtime['image']}) are not one Debian release")
    copies = [rest for kw, rest in runtime["ops"] if kw in ("COPY", "ADD")]
    m = re.fullmatch(r"--from=build\s+(\S+)\s+(\S+)", copies[0]) if len(copies) == 1 else None
    if not m:
        fail(f"the runtime stage must add the build stage's binary and nothing else; it adds {copies}")
        return done(errors)
    binary_from, binary = m.groups()
    if binary_from not in runs:
        fail(f"the build stage never writes {binary_from}")
    ops = dict(runtime["ops"])
    try:
        entrypoint = json.loads(ops.get("ENTRYPOINT", "null"))
    except json.JSONDecodeError:
        entrypoint = None
    if not isinstance(entrypoint, list) or entrypoint[:1] != [binary]:
        fail(f"ENTRYPOINT must be the exec form [\"{binary}\"] (no shell in the image); it is {ops.get('ENTRYPOINT')}")
    user = ops.get("USER", "")
    if not re.fullmatch(r"[1-9]\d*(:\d+)?", user):
        fail(f"USER must be a numeric non-root uid (Kubernetes' runAsNonRoot checks it); it is {user!r}")

    # Shared libraries.
    needed = set()
    for line in Path(args.ldd).read_text().splitlines():
        name = line.split()[0] if line.split() else ""
        needed.add(Path(name).name)
        if "not found" in line:
            fail(f"ldd: {line.strip()}")
    extra = needed - ALLOWED_LIBS
    if extra:
        fail(f"the binary links {sorted(extra)}, beyond the glibc and libgcc_s that the runtime is checked to have")
    if args.package_list:
        # `dpkg-deb -c` lines: mode owner size date time path [-> target]
        files = {Path(line.split()[5]).name for f in args.package_list
                 for line in Path(f).read_text().splitlines() if len(line.split()) > 5}
        missing = needed - files - {"linux-vdso.so.1"}
        if missing:
            fail(f"the runtime's packages lack {sorted(missing)}")
    print(f"binary_from={binary_from}")
    for copy in build_copies:
        print(f"build_copy={copy}")
    print(f"check_containerfile: {len(stages)} stages; build {build['image']}; runtime {runtime['image']}; "
          f"entrypoint {binary}, user {user}; shared libraries {sorted(needed - {'linux-vdso.so.1'})}"
          + (f" all in {len(args.package_list)} runtime packages" if args.package_list else ""), file=sys.stderr)
    return done(errors)


def done(errors):
    for e in errors:
        print(f"check_containerfile: {e}", file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
