"""Checks one `helm template` render of deploy/helm/kvwarden (run by scripts/check-deploy.sh).

Every object must validate against the Kubernetes API schemas of each --kube version
(kubernetes-validate, strict: a misspelt or misplaced field fails, as `kubectl apply
--validate=strict` would). Objects of cert-manager's kinds are written to --crd-out for
cert_manager.mjs; any other kind has no schema here and fails. Then the chart's own promises:
the router finds each pool through its headless Service as `dns:NAME:PORT` (and the binary's
help documents that form); every flag the chart passes exists in the binary, and every file it
names lies on a mount that provides it; every pod mounts the same model file read-only, and
only its own component's key, from a Secret its own Certificate writes when cert-manager makes
them; each Service and budget selects one component's pods; probes and Services name declared
ports; certificates carry the name peers verify and both TLS usages.

Prints one line per render; exits 1 naming each failure.
"""

import argparse
import json
import re
import sys

import kubernetes_validate
import yaml

CRD_GROUPS = ("cert-manager.io/",)
COMPONENTS = ("router", "prefill", "decode")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("render")
    ap.add_argument("--kube", action="append", required=True, help="Kubernetes version (repeat)")
    ap.add_argument("--namespace", required=True)
    ap.add_argument("--cluster-domain", default="cluster.local")
    ap.add_argument("--router-help", required=True, help="output of `kvwarden router --help`")
    ap.add_argument("--serve-help", required=True, help="output of `kvwarden serve --help`")
    ap.add_argument("--server-name", required=True, help="the name peers verify (SERVER_NAME)")
    ap.add_argument("--crd-out", required=True, help="JSON list of the cert-manager objects")
    ap.add_argument("--core-only", action="store_true", help="fail on any custom resource")
    args = ap.parse_args()

    with open(args.render) as f:
        docs = [d for d in yaml.safe_load_all(f) if d]
    errors = []
    fail = errors.append

    crds, invalid = [], set()
    for doc in docs:
        what = f"{doc.get('kind')}/{doc.get('metadata', {}).get('name')}"
        if doc.get("apiVersion", "").startswith(CRD_GROUPS):
            if args.core_only:
                fail(f"{what}: a custom resource in a render that must hold core kinds only")
            crds.append(doc)
            continue
        for version in args.kube:
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.SchemaNotFoundError:
                invalid.add(what)
                fail(f"{what}: no Kubernetes {version} schema for {doc.get('apiVersion')} {doc.get('kind')}")
            except kubernetes_validate.ValidationError as e:
                invalid.add(what)
                path = ".".join(str(p) for p in e.path)
                fail(f"{what}: Kubernetes {version}: {path}: {e.message}")
    with open(args.crd_out, "w") as f:
        json.dump(crds, f)

    deployments = {component_of(d): d for d in docs if d["kind"] == "Deployment"}
    if sorted(deployments) != sorted(COMPONENTS):
        fail(f"expected one Deployment per component {COMPONENTS}, found {sorted(deployments)}")
        return report(errors, args, docs, crds, invalid)
    services = [d for d in docs if d["kind"] == "Service"]
    pods = {c: d["spec"]["template"]["spec"] for c, d in deployments.items()}
    containers = {c: p["containers"][0] for c, p in pods.items()}

    # The router's addresses: dns:<headless Service of the pool>.<ns>.svc.<domain>:<its port>.
    router_args = flag_values(containers["router"]["args"])
    for pool in ("prefill", "decode"):
        headless = [s for s in services if component_of(s) == pool and s["spec"].get("clusterIP") == "None"]
        if len(headless) != 1:
            fail(f"{pool}: expected one headless Service, found {len(headless)}")
            continue
        svc = headless[0]
        port = next((p for p in svc["spec"]["ports"] if p["name"] == "grpc"), None)
        node_port = flag_values(containers[pool]["args"]).get("--port", [None])[0]
        if port is None or str(port["port"]) != node_port:
            fail(f"{pool}: the headless Service's grpc port is not the nodes' --port {node_port}")
            continue
        want = f"dns:{svc['metadata']['name']}.{args.namespace}.svc.{args.cluster_domain}:{port['port']}"
        got = router_args.get(f"--{pool}", [])
        if got != [want]:
            fail(f"router: --{pool} is {got}, expected [{want!r}] (the pool's headless Service)")

    # Flags the binary does not know would stop every pod at start.
    helps = {"router": read(args.router_help), "serve": read(args.serve_help)}
    if "dns:" not in helps["router"]:
        fail("`kvwarden router --help` does not mention the dns:NAME:PORT form that the chart passes")
    for component, container in containers.items():
        text = helps[container["args"][0]]
        for flag in flag_values(container["args"]):
            if not re.search(rf"(^|\s){re.escape(flag)}[\s=<,]", text, re.M):
                fail(f"{component}: `kvwarden {container['args'][0]}` has no flag {flag}")

    # The same model file, read-only, in every pod: the router refuses nodes whose file differs.
    models = {c: flag_values(ct["args"]).get("--model", [None])[0] for c, ct in containers.items()}
    if len(set(models.values())) != 1:
        fail(f"--model differs between components: {models}")
    # The same LoRA adapters on every node (the router refuses nodes whose sets differ), each
    # file on the pod's mounts; the router loads none.
    adapters = {pool: flag_values(containers[pool]["args"]).get("--lora", []) for pool in ("prefill", "decode")}
    if adapters["prefill"] != adapters["decode"]:
        fail(f"--lora differs between the pools: {adapters}")
    if "--lora" in router_args:
        fail("router: passed --lora (the router learns the nodes' adapters; it takes --lora-access)")
    for pool, values in adapters.items():
        for value in values:
            spec = value.partition("=")[2]  # NAME=PATH[,SCALE]
            path = spec.rpartition(",")[0] or spec
            if not path.startswith("/") or not on_mount(path, containers[pool], pods[pool]):
                fail(f"{pool}: --lora={value}: the file is on no mount")
    sources = set()
    issued = {c["spec"]["secretName"]: component_of(c) for c in crds if c["kind"] == "Certificate"}
    for component, pod in pods.items():
        model = models[component] or ""
        mounts = [m for m in containers[component].get("volumeMounts", []) if model.startswith(m["mountPath"] + "/")]
        if len(mounts) != 1 or not mounts[0].get("readOnly"):
            fail(f"{component}: the model {model} is not on exactly one read-only mount")
            continue
        volume = next(v for v in pod["volumes"] if v["name"] == mounts[0]["name"])
        sources.add(json.dumps({k: v for k, v in volume.items() if k != "name"}, sort_keys=True))
        # Each component holds the CA and its own key only, from a Secret that exists or that a
        # Certificate of its own component makes.
        for v in pod["volumes"]:
            secret = v.get("secret", {})
            for item in secret.get("items", []):
                others = [c for c in COMPONENTS if c != component and c in item["key"]]
                if others:
                    fail(f"{component}: mounts {item['key']} from Secret {secret['secretName']}")
                if item["key"] == "tls.crt" and issued.get(secret["secretName"]) != component:
                    fail(f"{component}: no Certificate of its own writes Secret {secret['secretName']}")
        # Every file a flag names lies on a mount, and on a Secret's mount is one of its items.
        for flag, values in flag_values(containers[component]["args"]).items():
            for value in values:
                if value and value.startswith("/") and not on_mount(value, containers[component], pod):
                    fail(f"{component}: {flag}={value} is on no mount that provides it")
    if len(sources) > 1:
        fail(f"the model volume differs between components: {sources}")

    # Selectors: each Service and budget selects exactly one component's pods.
    for obj in services + [d for d in docs if d["kind"] == "PodDisruptionBudget"]:
        sel = obj["spec"]["selector"]
        sel = sel.get("matchLabels", sel) if obj["kind"] == "PodDisruptionBudget" else sel
        hits = [c for c, d in deployments.items() if selects(sel, d["spec"]["template"]["metadata"]["labels"])]
        if hits != [component_of(obj)]:
            fail(f"{obj['kind']}/{obj['metadata']['name']} selects {hits}")
    for component in ("prefill", "decode"):
        if not any(d["kind"] == "PodDisruptionBudget" and component_of(d) == component for d in docs):
            fail(f"{component}: no PodDisruptionBudget")

    # Probes and Service target ports name ports the container declares.
    for component, container in containers.items():
        declared = {p["name"] for p in container["ports"]} | {p["containerPort"] for p in container["ports"]}
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            spec = container.get(probe)
            if not spec:
                fail(f"{component}: no {probe}")
                continue
            handler = spec.get("httpGet") or spec.get("tcpSocket") or {}
            if handler.get("port") not in declared:
                fail(f"{component}: {probe} port {handler.get('port')} is not declared")
        if component != "router" and container["readinessProbe"].get("httpGet", {}).get("path") != "/health":
            fail(f"{component}: readiness is not /health")
    for svc in services:
        for port in svc["spec"]["ports"]:
            ports = containers[component_of(svc)]["ports"]
            if port["targetPort"] not in {p["name"] for p in ports} | {p["containerPort"] for p in ports}:
                fail(f"Service/{svc['metadata']['name']}: targetPort {port['targetPort']} is not declared")

    # Certificates from cert-manager: the name every peer verifies, and both directions of TLS.
    for cert in (d for d in crds if d["kind"] == "Certificate" and not d["spec"].get("isCA")):
        spec = cert["spec"]
        if args.server_name not in spec.get("dnsNames", []):
            fail(f"Certificate/{cert['metadata']['name']}: dnsNames lacks {args.server_name}")
        if not {"server auth", "client auth"} <= set(spec.get("usages", [])):
            fail(f"Certificate/{cert['metadata']['name']}: usages lack server auth or client auth")
    return report(errors, args, docs, crds, invalid)


def report(errors, args, docs, crds, invalid):
    for e in errors:
        print(f"validate_chart: {args.render}: {e}", file=sys.stderr)
    core = len(docs) - len(crds)
    print(f"{core - len(invalid)} of {core} core objects valid against Kubernetes {' and '.join(args.kube)} "
          f"(strict), {len(crds)} cert-manager objects passed on; {len(errors)} failures")
    return 1 if errors else 0


def on_mount(path, container, pod):
    for mount in container.get("volumeMounts", []):
        prefix = mount["mountPath"].rstrip("/") + "/"
        if path.startswith(prefix):
            volume = next((v for v in pod["volumes"] if v["name"] == mount["name"]), {})
            items = volume.get("secret", {}).get("items")
            return items is None or path[len(prefix):] in {i["path"] for i in items}
    return False


def component_of(obj):
    return obj["metadata"].get("labels", {}).get("app.kubernetes.io/component")


def selects(selector, labels):
    return all(labels.get(k) == v for k, v in selector.items())


def flag_values(argv):
    """{flag: [values]} from `--flag=value` and `--flag value` forms."""
    out, i = {}, 0
    while i < len(argv):
        a = str(argv[i])
        if a.startswith("--"):
            if "=" in a:
                k, v = a.split("=", 1)
            elif i + 1 < len(argv) and not str(argv[i + 1]).startswith("--"):
                k, v = a, str(argv[i + 1])
                i += 1
            else:
                k, v = a, None
            out.setdefault(k, []).append(v)
        i += 1
    return out


def read(path):
    with open(path) as f:
        return f.read()


if __name__ == "__main__":
    sys.exit(main())
