"""deploy/k8s is correct by construction: no cluster is needed to check it.

No pure-Python kustomize exists, so `render()` builds what `kubectl kustomize` would for the subset the manifests
use (resources, namespace, namePrefix, labels, images, JSON 6902 patches), and every check runs on the base and
on the example overlay: the containers run the `tether` subcommands with the flags service_commands() gives them
(metrics on, JSON logs, --threads = the CPU limit), stage i of the StatefulSet holds layer slice i, the
coordinator's route and admission's coordinator are the Services' DNS names and ports, probes use gRPC health on
the gRPC port, Prometheus annotations name the metrics port, and every resource has requests and limits. The
second-pipeline and autoscaled overlays have their own checks at the end.

Secure by default: every kustomization but overlays/dev-plaintext runs mutual TLS with each container holding
only its own certificate (from Secrets that deploy/k8s/cert-manager's Certificates make, with the identities of
tether/security/identity.py and the DNS names peers dial), admission reads API keys from a Secret, no pod
mounts the CA's key, and the NetworkPolicies, evaluated here as Kubernetes does, let only admission reach the
coordinators and only a pipeline's own pods reach its stages.
"""

from __future__ import annotations

import copy
import importlib
import inspect
import re
import tomllib
from pathlib import Path

import pytest
import yaml

from services.coordinator import drain
from tether import grpcutil, settings
from tether.cli.cluster import default_metrics_ports, service_commands
from tether.cli.main import SERVICE_MODULES
from tether.model.config import head_cost, parse_layers
from tether.model.presets import PRESETS

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
BASE = K8S / "base"
OVERLAY = K8S / "overlays" / "example"
SECOND_PIPELINE = K8S / "overlays" / "pipeline-p1"
AUTOSCALED = K8S / "overlays" / "autoscaled"
DEV = K8S / "overlays" / "dev-plaintext"
CERT_MANAGER = K8S / "cert-manager"
TENANTS_EXAMPLE = K8S / "secure" / "frontdoor" / "tenants.example.toml"
HEALTHCHECK = ["python", "-m", "tether.cli.healthcheck"]
ADDRESS_FLAGS = {"--stages", "--coordinator"}
# flags a deployment sets that the local launcher leaves default
K8S_ONLY_FLAGS = {"--kv-memory-mib", "--tenants", "--metrics-host", "--tls-client-auth"}
CLUSTER_SCOPED = {"Namespace"}
IMAGE_UID = 10001                                   # the Dockerfile's `useradd --uid`


# --------------------------------------------------------------------------------------------- rendering

def _pointer(path: str) -> list[str]:
    return [p.replace("~1", "/").replace("~0", "~") for p in path.lstrip("/").split("/")]


def _json_patch(doc: dict, ops: list[dict]) -> None:
    """RFC 6902 add / replace / remove / test (what the overlays use)."""
    for op in ops:
        *parents, last = _pointer(op["path"])
        node = doc
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node[key]
        if op["op"] == "remove":
            del node[int(last) if isinstance(node, list) else last]
            continue
        if op["op"] == "test":   # the patch states what it replaces: a base that moved fails here, not silently
            here = node[int(last)] if isinstance(node, list) else node[last]
            assert here == op["value"], f"patch test {op['path']}: {here!r} != {op['value']!r}"
            continue
        value = copy.deepcopy(op["value"])
        if isinstance(node, list):
            if op["op"] == "add":
                node.insert(len(node) if last == "-" else int(last), value)
            else:
                node[int(last)] = value
        elif op["op"] == "replace":
            assert last in node, f"replace of a missing {op['path']}"
            node[last] = value
        elif op["op"] == "add":
            node[last] = value
        else:
            raise AssertionError(f"unsupported patch op {op['op']}")


def _workload_containers(doc: dict) -> list[dict]:
    if doc["kind"] in ("Deployment", "StatefulSet"):
        return doc["spec"]["template"]["spec"]["containers"]
    return []


def _init_containers(doc: dict) -> list[dict]:
    if doc["kind"] in ("Deployment", "StatefulSet"):
        return doc["spec"]["template"]["spec"].get("initContainers", [])
    return []


# kustomize's name references this renderer follows when a namePrefix renames their target
_NAME_REFS = {"StatefulSet": [("spec", "serviceName")], "HorizontalPodAutoscaler": [("spec", "scaleTargetRef", "name")]}


def _rename(docs: list[dict], prefix: str) -> None:
    """namePrefix: every resource of this kustomization, and the references to them (ConfigMap keys, a
    StatefulSet's Service, an HPA's target); references to resources outside it stay as they are."""
    names = {d["metadata"]["name"] for d in docs}
    for d in docs:
        d["metadata"]["name"] = prefix + d["metadata"]["name"]
        for path in _NAME_REFS.get(d["kind"], []):
            *parents, last = path
            node = d
            for key in parents:
                node = node[key]
            if node[last] in names:
                node[last] = prefix + node[last]
        for c in _workload_containers(d):
            for e in c.get("env", []):
                ref = e.get("valueFrom", {}).get("configMapKeyRef")
                if ref and ref["name"] in names:
                    ref["name"] = prefix + ref["name"]


def _label(docs: list[dict], pairs: dict[str, str], selectors: bool, templates: bool = False) -> None:
    """labels: metadata always; with includeTemplates, pod templates too; with includeSelectors, pod templates,
    Service selectors, workload selectors and NetworkPolicies' existing podSelector matchLabels (kustomize's
    commonLabels field specs, which create none)."""
    for d in docs:
        d["metadata"].setdefault("labels", {}).update(pairs)
        if (selectors or templates) and d["kind"] in ("Deployment", "StatefulSet"):
            d["spec"]["template"]["metadata"].setdefault("labels", {}).update(pairs)
        if not selectors:
            continue
        if d["kind"] == "Service" and "selector" in d["spec"]:
            d["spec"]["selector"].update(pairs)
        if d["kind"] in ("Deployment", "StatefulSet"):
            d["spec"]["selector"]["matchLabels"].update(pairs)
        if d["kind"] == "NetworkPolicy":
            peers = [p for rule in d["spec"].get("ingress", []) for p in rule.get("from", [])]
            for sel in [d["spec"]["podSelector"]] + [p["podSelector"] for p in peers if "podSelector" in p]:
                if "matchLabels" in sel:
                    sel["matchLabels"].update(pairs)


def render(folder: Path) -> list[dict]:
    k = yaml.safe_load((folder / "kustomization.yaml").read_text())
    unknown = set(k) - {"apiVersion", "kind", "resources", "namespace", "namePrefix", "labels", "images", "patches"}
    assert not unknown, f"{folder}: kustomization fields this renderer does not model: {unknown}"
    docs: list[dict] = []
    for res in k.get("resources", []):
        path = (folder / res).resolve()
        if path.is_dir():
            docs += render(path)
        else:
            assert path.is_relative_to(folder.resolve()), f"{folder}: kustomize loads files under the root only: {res}"
            docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    for patch in k.get("patches", []):
        target = patch["target"]
        hits = [d for d in docs if d["kind"] == target["kind"] and d["metadata"]["name"] == target["name"]]
        assert len(hits) == 1, f"patch target {target} matches {len(hits)} resources"
        _json_patch(hits[0], yaml.safe_load(patch["patch"]))
    if "namePrefix" in k:
        _rename(docs, k["namePrefix"])
    for group in k.get("labels", []):
        assert set(group) <= {"pairs", "includeSelectors", "includeTemplates"}, group
        _label(docs, group["pairs"], group.get("includeSelectors", False), group.get("includeTemplates", False))
    for image in k.get("images", []):
        for d in docs:
            for c in _workload_containers(d) + _init_containers(d):
                name, _, tag = c["image"].partition(":")
                if name == image["name"]:
                    c["image"] = f"{image.get('newName', name)}:{image.get('newTag', tag)}"
    if "namespace" in k:
        for d in docs:
            if d["kind"] not in CLUSTER_SCOPED:
                d["metadata"]["namespace"] = k["namespace"]
    return docs


@pytest.fixture(params=["base", "overlay", "dev"])
def docs(request) -> list[dict]:
    return render({"base": BASE, "overlay": OVERLAY, "dev": DEV}[request.param])


def _secure(docs: list[dict]) -> bool:
    """The secure shape (every kustomization but dev-plaintext): admission has TLS variables."""
    (c,) = _workload_containers(one(docs, *ADMISSION))
    return any(e["name"] == settings.TLS_CERT_ENV for e in c.get("env", []))


def one(docs: list[dict], kind: str, name: str) -> dict:
    hits = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(hits) == 1, f"{kind}/{name}: {len(hits)} found"
    return hits[0]


# --------------------------------------------------------------------------------------------- helpers

STAGE, COORD, ADMISSION = ("StatefulSet", "tether-stage"), ("Deployment", "tether-coordinator"), \
    ("Deployment", "tether-admission")


def _config(docs: list[dict]) -> dict[str, str]:
    return one(docs, "ConfigMap", "tether-config")["data"]


def _env(docs: list[dict], container: dict, ordinal: int = 0) -> dict[str, str]:
    """The container's environment as the kubelet resolves it: ConfigMap keys, the pod-index label, $(VAR)."""
    env: dict[str, str] = {}
    for e in container.get("env", []):
        if "value" in e:
            env[e["name"]] = _expand(e["value"], env)
            continue
        src = e["valueFrom"]
        if "configMapKeyRef" in src:
            ref = src["configMapKeyRef"]
            assert ref["name"] == "tether-config"
            env[e["name"]] = _config(docs)[ref["key"]]
        elif src.get("fieldRef", {}).get("fieldPath") == "metadata.labels['apps.kubernetes.io/pod-index']":
            env[e["name"]] = str(ordinal)
        elif src.get("fieldRef"):
            env[e["name"]] = f"<{src['fieldRef']['fieldPath']}>"
        else:
            raise AssertionError(f"unexpected env source {src}")
    return env


def _expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion; a reference to a variable not defined before it would stay literal."""
    def sub(m: re.Match) -> str:
        assert m.group(1) in env, f"$({m.group(1)}) is not defined before its use"
        return env[m.group(1)]
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", sub, text)


def _argv(docs: list[dict], kind_name: tuple[str, str], ordinal: int = 0) -> list[str]:
    (c,) = _workload_containers(one(docs, *kind_name))
    assert "command" not in c, "the image's ENTRYPOINT (`tether`) runs; args pick the subcommand"
    env = _env(docs, c, ordinal)
    return [_expand(a, env) for a in c["args"]]


def _flags(args: list[str]) -> dict[str, str]:
    pairs = list(zip(args[::2], args[1::2]))
    assert len(args) % 2 == 0 and all(k.startswith("--") for k, _ in pairs), args
    assert len({k for k, _ in pairs}) == len(pairs), f"repeated flag in {args}"
    return dict(pairs)


def _replicas(docs: list[dict]) -> int:
    return one(docs, *STAGE)["spec"]["replicas"]


def _cpu(text: str) -> float:
    return float(text[:-1]) / 1000 if str(text).endswith("m") else float(text)


def _mib(text: str) -> float:
    units = {"Ki": 1 / 1024, "Mi": 1, "Gi": 1024, "Ti": 1024 ** 2}
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(Ki|Mi|Gi|Ti)", str(text))
    assert m, f"memory {text!r}: use a binary unit"
    return float(m.group(1)) * units[m.group(2)]


def _reference(docs: list[dict]) -> dict[str, list[str]]:
    """service_commands() of the same cluster: metrics on, JSON logs, --threads = the stages' CPU limit."""
    n = _replicas(docs)
    (stage,) = _workload_containers(one(docs, *STAGE))
    threads = int(_cpu(stage["resources"]["limits"]["cpu"]))
    extra = {role: ["--log-format", "json"] for role in ("stage", "coordinator", "admission")}
    services = service_commands(_config(docs)["model"], n, threads=threads, extra=extra,
                                metrics_ports=default_metrics_ports(n))
    return {s.name: s.argv[s.argv.index("-m") + 2:] for s in services}


def _all_commands(docs: list[dict]) -> dict[str, list[str]]:
    out = {f"stage{i}": _argv(docs, STAGE, i) for i in range(_replicas(docs))}
    out["coordinator"], out["admission"] = _argv(docs, COORD), _argv(docs, ADMISSION)
    return out


# --------------------------------------------------------------------------------------------- checks

def test_the_resources(docs):
    kinds = {(d["kind"], d["metadata"]["name"]) for d in docs}
    assert {STAGE, COORD, ADMISSION, ("Service", "tether-stage"), ("Service", "tether-coordinator"),
            ("Service", "tether-admission"), ("ConfigMap", "tether-config")} <= kinds
    for d in docs:
        if d["kind"] not in CLUSTER_SCOPED:   # the overlay's own Namespace is not the base's
            assert d["metadata"]["labels"]["app.kubernetes.io/part-of"] == "tether", d["metadata"]["name"]


def test_commands_parse_and_match_service_commands(docs):
    reference = _reference(docs)
    for name, argv in _all_commands(docs).items():
        role = "stage" if name.startswith("stage") else name
        assert argv[0] == role
        module = importlib.import_module(f"services.{SERVICE_MODULES[role]}.main")
        try:
            ns = module.build_parser().parse_args(argv[1:])
        except SystemExit as e:
            pytest.fail(f"{name}: `tether {' '.join(argv)}` does not parse (exit {e.code})")
        assert ns.host == "0.0.0.0"
        assert ns.metrics_host == "0.0.0.0", f"{name}: Prometheus scrapes the pod's IP (the NetworkPolicy limits who)"
        mine, theirs = _flags(argv[1:]), _flags(reference[name])
        assert set(theirs) <= set(mine), f"{name}: missing {sorted(set(theirs) - set(mine))}"
        assert set(mine) - set(theirs) <= K8S_ONLY_FLAGS, f"{name}: unexpected {sorted(set(mine) - set(theirs))}"
        for flag in set(theirs) - {"--host", "--port", "--metrics-port"} - ADDRESS_FLAGS:
            assert mine[flag] == theirs[flag], f"{name}: {flag} {mine[flag]!r} != service_commands() {theirs[flag]!r}"


def test_ports_are_the_settings(docs):
    """Every pod has its own IP: every stage uses stage 0's ports."""
    commands = _all_commands(docs)
    for name, argv in commands.items():
        f = _flags(argv[1:])
        port, metrics = {"coordinator": (settings.COORDINATOR_PORT, settings.COORDINATOR_METRICS_PORT),
                         "admission": (settings.ADMISSION_PORT, settings.ADMISSION_METRICS_PORT)}.get(
            name, (settings.STAGE_BASE_PORT, settings.STAGE_METRICS_BASE_PORT))
        assert (int(f["--port"]), int(f["--metrics-port"])) == (port, metrics), name


def test_stage_i_holds_slice_i_and_the_slices_cover_the_model(docs):
    model = _config(docs)["model"]
    assert model in PRESETS, "the base image bakes the presets only; another model needs a volume"
    num_layers = PRESETS[model].num_hidden_layers
    n = _replicas(docs)
    ranges = []
    for i in range(n):
        layers = _flags(_argv(docs, STAGE, i)[1:])["--layers"]
        assert layers == f"{i}/{n}", "slice = the pod's ordinal, of N = replicas"
        ranges.append(parse_layers(layers, num_layers, head_cost(PRESETS[model])))
    assert ranges[0][0] == 0 and ranges[-1][1] == num_layers
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:])), ranges


def _service_port(svc: dict, name: str) -> int:
    (p,) = [p for p in svc["spec"]["ports"] if p["name"] == name]
    assert p.get("targetPort", p["port"]) == p["port"]
    return p["port"]


def _selects(svc: dict, workload: dict) -> bool:
    labels = workload["spec"]["template"]["metadata"]["labels"]
    return all(labels.get(k) == v for k, v in svc["spec"]["selector"].items())


def test_route_is_the_statefulset_pods_by_dns(docs):
    sts = one(docs, *STAGE)
    headless = one(docs, "Service", sts["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None" and _selects(headless, sts)
    assert headless["spec"].get("publishNotReadyAddresses") is True
    assert sts["spec"]["selector"]["matchLabels"].items() <= sts["spec"]["template"]["metadata"]["labels"].items()
    port = _service_port(headless, "grpc")
    expected = [f"{sts['metadata']['name']}-{i}.{headless['metadata']['name']}:{port}"
                for i in range(_replicas(docs))]
    assert _flags(_argv(docs, COORD)[1:])["--stages"].split(",") == expected


def test_admission_follows_the_coordinators_by_dns(docs):
    coord, svc = one(docs, *COORD), one(docs, "Service", "tether-coordinator")
    assert _selects(svc, coord)
    assert coord["spec"]["replicas"] == 1, "one coordinator per pipeline: it is the single writer"
    assert coord["spec"]["strategy"]["type"] == "Recreate", "two coordinators must never share the stages"
    # admission follows every pipeline's coordinator by DNS: a headless Service over the coordinators' pods
    every = one(docs, "Service", "tether-coordinators")
    assert every["spec"]["clusterIP"] == "None" and _selects(every, coord)
    assert _flags(_argv(docs, ADMISSION)[1:])["--coordinator"] == f"dns:tether-coordinators:{_service_port(every, 'grpc')}"
    adm, adm_svc = one(docs, *ADMISSION), one(docs, "Service", "tether-admission")
    assert _selects(adm_svc, adm)


@pytest.mark.parametrize("kind_name", [STAGE, COORD, ADMISSION])
def test_ports_probes_and_scrape_annotations(docs, kind_name):
    w = one(docs, *kind_name)
    (c,) = _workload_containers(w)
    f = _flags(_argv(docs, kind_name)[1:])
    grpc_port, metrics_port = int(f["--port"]), int(f["--metrics-port"])
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    expected = {"grpc": grpc_port, "metrics": metrics_port}
    if kind_name == ADMISSION:   # the OpenAI-compatible API, on the port admission's parser says it serves
        ns = importlib.import_module("services.admission.main").build_parser().parse_args(
            _argv(docs, kind_name)[1:])
        assert not ns.no_http and ns.http_port == settings.HTTP_PORT
        expected["http"] = ns.http_port
    assert ports == expected
    svc = one(docs, "Service", w["metadata"]["name"] if kind_name != STAGE else w["spec"]["serviceName"])
    assert {p["name"]: p["port"] for p in svc["spec"]["ports"]} == ports
    # readiness: gRPC health (admission and the coordinator are SERVING only while their pipeline is); under TLS
    # through tether.cli.healthcheck, since the kubelet's own gRPC probe speaks plaintext only
    secure = _secure(docs)
    assert _health_probe_port(c["readinessProbe"], secure) == grpc_port
    startup, liveness = c["startupProbe"], c["livenessProbe"]
    assert (startup.get("tcpSocket") or {}).get("port", None) == grpc_port or \
        _health_probe_port(startup, secure) == grpc_port
    if kind_name == STAGE:
        assert _health_probe_port(liveness, secure) == grpc_port
    else:   # NOT_SERVING while the pipeline recovers is not a reason to restart: the port alone
        assert liveness["tcpSocket"]["port"] == grpc_port
    notes = w["spec"]["template"]["metadata"]["annotations"]
    assert notes["prometheus.io/scrape"] == "true"
    assert int(notes["prometheus.io/port"]) == metrics_port
    assert notes["prometheus.io/path"] == "/metrics"


def _drain_fits_the_grace_period(pod_spec: dict, coordinator: dict, argv: list[str]) -> None:
    """Deleting a pod drains its coordinator by SIGTERM, with no preStop hook in front (coordinator.yaml says why),
    and the kubelet's SIGKILL comes only after the drain, the hand-back's flush and the gRPC grace."""
    assert "preStop" not in coordinator.get("lifecycle", {}), "SIGTERM drains: a preStop hook would only delay it"
    ns = importlib.import_module("services.coordinator.main").build_parser().parse_args(argv[1:])
    grpc_grace_s = inspect.signature(grpcutil.Server.wait_for_signal).parameters["grace_s"].default
    needed = ns.drain_seconds + drain.FLUSH_S + grpc_grace_s
    assert pod_spec.get("terminationGracePeriodSeconds", 30) > needed   # 30: Kubernetes' default


def test_deleting_the_coordinator_pod_drains_it_within_the_grace_period(docs):
    w = one(docs, *COORD)
    (c,) = _workload_containers(w)
    _drain_fits_the_grace_period(w["spec"]["template"]["spec"], c, _argv(docs, COORD))


def _health_probe_port(probe: dict, secure: bool) -> int:
    """The gRPC port a health probe checks: the kubelet's grpc probe (plaintext shape) or tether.cli.healthcheck
    on the pod's loopback (TLS: it reads the container's TETHER_TLS_* variables)."""
    if not secure:
        return probe["grpc"]["port"]
    assert "grpc" not in probe, "the kubelet's gRPC probe cannot speak TLS"
    cmd = probe["exec"]["command"]
    assert cmd[:3] == HEALTHCHECK and len(cmd) == 4, cmd
    from tether.cli import healthcheck
    host, port = healthcheck.build_parser().parse_args(cmd[3:]).target.rsplit(":", 1)
    assert host == "127.0.0.1"
    return int(port)


@pytest.mark.parametrize("kind_name", [STAGE, COORD, ADMISSION])
def test_resources_security_and_otel(docs, kind_name):
    w = one(docs, *kind_name)
    (c,) = _workload_containers(w)
    res = c["resources"]
    for key in ("cpu", "memory"):
        assert key in res["requests"] and key in res["limits"], f"{kind_name}: {key} requests and limits"
    assert _cpu(res["requests"]["cpu"]) <= _cpu(res["limits"]["cpu"])
    assert _mib(res["requests"]["memory"]) <= _mib(res["limits"]["memory"])
    f = _flags(_argv(docs, kind_name)[1:])
    if kind_name == STAGE:
        assert int(f["--threads"]) == _cpu(res["limits"]["cpu"]), "torch threads = the CPU limit"
        kv = float(f.get("--kv-memory-mib", settings.KV_MEMORY_MIB))
        assert _mib(res["limits"]["memory"]) >= kv + 1024, "the KV pool plus 1 GiB for weights and runtime"
    pod = w["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] == IMAGE_UID
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    env = _env(docs, c)
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"].startswith("http") and env["OTEL_EXPORTER_OTLP_ENDPOINT"].endswith(":4317")
    assert env["OTEL_SERVICE_NAME"] == w["metadata"]["name"]


def test_tenants_file_is_admissions_and_mounted_where_it_reads_it(docs, tmp_path):
    """Secure: the tenants file (API key digests) is Secret tether-tenants, whose example lists keys; the
    ConfigMap has no tenants. Dev: the ConfigMap's, limits only."""
    secure = _secure(docs)
    text = TENANTS_EXAMPLE.read_text() if secure else _config(docs)["tenants.toml"]
    tomllib.loads(text)
    limits = importlib.import_module("services.admission.limits")
    auth = importlib.import_module("services.admission.auth")
    path = tmp_path / "tenants.toml"
    path.write_text(text)
    limits.TenantLimits.from_file(path)   # admission's own parser accepts it
    keys = auth.ApiKeys.from_config(limits.read_tenants_file(path), str(path))
    assert keys.active == secure, "the secure shape's example requires API keys"
    assert ("tenants.toml" in _config(docs)) != secure
    adm = one(docs, *ADMISSION)
    (c,) = _workload_containers(adm)
    (mount,) = [m for m in c["volumeMounts"] if m["name"] == "config"]
    (vol,) = [v for v in adm["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"]]
    source = vol["secret"] if secure else vol["configMap"]
    (item,) = source["items"]
    assert (source.get("secretName") or source.get("name")) == ("tether-tenants" if secure else "tether-config")
    assert item["key"] == "tenants.toml"
    mounted = f"{mount['mountPath']}/{item['path']}"
    flags = _flags(_argv(docs, ADMISSION)[1:])
    assert flags.get("--tenants") == mounted, "admission must read the tenants file the ConfigMap mounts"


def test_images(docs):
    images = {c["image"] for d in docs for c in _workload_containers(d)}
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    assert len(images) == 1
    if all("namespace" not in d["metadata"] for d in docs):   # the base: the image docker-compose builds
        assert images == {compose["x-tether"]["image"]}
    else:
        assert images == {"registry.example.com/tether:0.1.0"}


def test_overlay_namespace_and_changes():
    docs = render(OVERLAY)
    one(docs, "Namespace", "tether")
    assert all(d["metadata"].get("namespace") == "tether" for d in docs if d["kind"] != "Namespace")
    assert one(docs, *ADMISSION)["spec"]["replicas"] == 2
    assert one(docs, "Service", "tether-admission")["spec"]["type"] == "LoadBalancer"
    anti = one(docs, *STAGE)["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"]
    assert anti["requiredDuringSchedulingIgnoredDuringExecution"][0]["topologyKey"] == "kubernetes.io/hostname"
    # the base is untouched by rendering the overlay
    assert one(render(BASE), *ADMISSION)["spec"]["replicas"] == 1


# --------------------------------------------------------------------------------------------- more pipelines

def _pods_selected(svc_or_workload_selector: dict, workload: dict) -> bool:
    labels = workload["spec"]["template"]["metadata"]["labels"]
    return all(labels.get(k) == v for k, v in svc_or_workload_selector.items())


def test_a_second_pipeline_beside_the_base_shares_nothing_but_admission():
    """overlays/pipeline-p1 applied next to the base: every name distinct, no selector of one pipeline picks the
    other's pods, its route names its own stage pods, and admission's headless Service lists both coordinators."""
    base, p1 = render(BASE), render(SECOND_PIPELINE)
    names = [(d["kind"], d["metadata"]["name"]) for d in base + p1]
    assert len(names) == len(set(names)), "a name of the second pipeline clashes with the base's"
    assert not any(d["kind"] in ("ConfigMap", "Namespace") or "admission" in d["metadata"]["name"] for d in p1), \
        "a pipeline overlay deploys stages and a coordinator only"
    both = base + p1
    sts = {p: one(both, "StatefulSet", f"{p}tether-stage") for p in ("", "p1-")}
    coords = {p: one(both, "Deployment", f"{p}tether-coordinator") for p in ("", "p1-")}
    for mine, other in (("", "p1-"), ("p1-", "")):
        for kind, w in (("StatefulSet", sts), ("Deployment", coords)):
            assert not _pods_selected(w[mine]["spec"]["selector"]["matchLabels"], w[other]), \
                f"{kind} {w[mine]['metadata']['name']} selects the other pipeline's pods"
        for svc_name, w in ((f"{mine}tether-stage", sts), (f"{mine}tether-coordinator", coords)):
            svc = one(both, "Service", svc_name)
            assert _selects(svc, w[mine]) and not _selects(svc, w[other]), svc_name
        c = _workload_containers(w := sts[mine])[0]
        assert _env(both, c)["OTEL_SERVICE_NAME"] == w["metadata"]["name"]
    every = one(both, "Service", "tether-coordinators")
    assert all(_selects(every, c) for c in coords.values()), "admission must find both pipelines by DNS"
    # p1's route: its own stage pods under its own headless Service, as many as it has replicas
    headless = one(both, "Service", sts["p1-"]["spec"]["serviceName"])
    assert headless["metadata"]["name"] == "p1-tether-stage" and _selects(headless, sts["p1-"])
    route = _flags(_argv(both, ("Deployment", "p1-tether-coordinator"))[1:])["--stages"].split(",")
    assert route == [f"p1-tether-stage-{i}.p1-tether-stage:{_service_port(headless, 'grpc')}"
                     for i in range(sts["p1-"]["spec"]["replicas"])]
    # and the rest of its commands are the base pipeline's
    for kind_name in (("StatefulSet", "tether-stage"), ("Deployment", "tether-coordinator")):
        p1_kind_name = (kind_name[0], "p1-" + kind_name[1])
        a, b = _flags(_argv(both, kind_name)[1:]), _flags(_argv(both, p1_kind_name)[1:])
        assert {k: v for k, v in a.items() if k != "--stages"} == {k: v for k, v in b.items() if k != "--stages"}


def test_autoscaled_pipeline_pods_are_whole_pipelines_scaled_on_the_queue():
    """overlays/autoscaled: each pod of tether-pipeline runs the commands `tether up` gives one pipeline (same ports,
    the route over the pod's loopback), carries the coordinator label admission discovers, and the HPA scales
    that Deployment on the metric the prometheus-adapter rule makes of the coordinator's queue gauge."""
    docs = render(AUTOSCALED)
    assert not [d for d in docs if d["kind"] == "StatefulSet"], "no stage StatefulSet: the pod is the pipeline"
    pipe = one(docs, "Deployment", "tether-pipeline")
    assert "replicas" not in pipe["spec"], "the HPA owns the replica count"
    pod = pipe["spec"]["template"]
    containers = pod["spec"]["containers"]
    stages = [c for c in containers if c["name"].startswith("stage-")]
    (coord,) = [c for c in containers if c["name"] == "coordinator"]
    n = len(stages)
    extra = {role: ["--log-format", "json"] for role in ("stage", "coordinator", "admission")}
    threads = int(_cpu(stages[0]["resources"]["limits"]["cpu"]))
    reference = {s.name: s.argv[s.argv.index("-m") + 2:]
                 for s in service_commands(_config(docs)["model"], n, threads=threads, extra=extra,
                                           metrics_ports=default_metrics_ports(n))}
    for i, c in enumerate(stages):
        assert c["name"] == f"stage-{i}"
        argv = [_expand(a, _env(docs, c)) for a in c["args"]]
        mine, theirs = _flags(argv[1:]), _flags(reference[f"stage{i}"])
        assert _same_but_hosts(mine, theirs)
        assert _health_probe_port(c["readinessProbe"], secure=True) == int(mine["--port"])
        assert {p["containerPort"] for p in c["ports"]} == {int(mine["--port"]), int(mine["--metrics-port"])}
        importlib.import_module("services.stage_worker.main").build_parser().parse_args(argv[1:])
    argv = [_expand(a, _env(docs, coord)) for a in coord["args"]]
    _drain_fits_the_grace_period(pod["spec"], coord, argv)
    mine, theirs = _flags(argv[1:]), _flags(reference["coordinator"])
    assert _same_but_hosts(mine, theirs), \
        "the pod's coordinator routes to its own stage containers exactly as `tether up` does"
    importlib.import_module("services.coordinator.main").build_parser().parse_args(argv[1:])
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == mine["--metrics-port"], \
        "Prometheus scrapes the coordinator: the queue gauge the HPA reads is its"
    every = one(docs, "Service", "tether-coordinators")
    assert _selects(every, pipe) and _service_port(every, "grpc") == int(mine["--port"])
    assert _flags(_argv(docs, ADMISSION)[1:])["--coordinator"] == f"dns:tether-coordinators:{mine['--port']}"
    # the HPA: this Deployment, on the adapter's name for the coordinator's tether:num_requests_waiting gauge
    hpa = one(docs, "HorizontalPodAutoscaler", "tether-pipeline")
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "tether-pipeline"}
    assert 1 <= hpa["spec"]["minReplicas"] < hpa["spec"]["maxReplicas"]
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods" and metric["pods"]["target"]["type"] == "AverageValue"
    adapter = yaml.safe_load((AUTOSCALED / "prometheus-adapter-rules.yaml").read_text())
    (rule,) = adapter["rules"]["custom"]
    assert rule["name"]["as"] == metric["pods"]["metric"]["name"]
    series = re.match(r"([A-Za-z_:][A-Za-z0-9_:]*)\{", rule["seriesQuery"]).group(1)
    assert re.fullmatch(rule["name"]["matches"], series)
    assert series in _coordinator_metric_names(), f"{series} is not a metric the coordinator exports"


def _same_but_hosts(mine: dict[str, str], theirs: dict[str, str]) -> bool:
    """Equal flags apart from where they listen (0.0.0.0 in a pod, for the probes and Prometheus)."""
    assert mine["--host"] == mine["--metrics-host"] == "0.0.0.0"
    drop = {"--host", "--metrics-host"}
    return {k: v for k, v in mine.items() if k not in drop} == {k: v for k, v in theirs.items() if k not in drop}


def _coordinator_metric_names() -> set[str]:
    """The names the coordinator's collector exports, read from a collector over a stub Stats reply."""
    from prometheus_client import CollectorRegistry
    from tether.telemetry import metrics
    from tether.v1 import coordinator_pb2
    registry = CollectorRegistry()
    registry.register(metrics.CoordinatorCollector(lambda: coordinator_pb2.StatsReply()))
    return {m.name for m in registry.collect()}


# --------------------------------------------------------------------------------------------- secure by default

SECURE = {"base": BASE, "overlay": OVERLAY, "pipeline-p1": SECOND_PIPELINE, "autoscaled": AUTOSCALED}
TLS_ENVS = (settings.TLS_CA_ENV, settings.TLS_CERT_ENV, settings.TLS_KEY_ENV)


def test_only_the_dev_overlay_is_plaintext():
    """Every kustomization a deployment may apply runs TLS in every tether container; the one without is named
    dev-plaintext and says so in its first line."""
    folders = [BASE] + sorted(p for p in (K8S / "overlays").iterdir() if p.is_dir())
    assert DEV in folders and set(SECURE.values()) <= set(folders)
    for folder in folders:
        docs = render(folder)
        containers = [c for d in docs for c in _workload_containers(d)]
        with_tls = [all(e in {x["name"] for x in c.get("env", [])} for e in TLS_ENVS) for c in containers]
        if folder == DEV:
            assert not any(with_tls) and not [d for d in docs if d["kind"] == "NetworkPolicy"]
            assert (folder / "kustomization.yaml").read_text().startswith("# DEVELOPMENT ONLY: the plaintext shape")
        else:
            assert containers and all(with_tls), f"{folder.name}: a tether container without TLS"


def _files_of(pod: dict, container: dict, ordinal: int = 0) -> dict[str, tuple[str, str]]:
    """Path inside `container` -> (Secret name, key) of every Secret file it can read, following a StatefulSet's
    init container that copies its ordinal's files into an emptyDir the container mounts."""
    volumes = {v["name"]: v for v in pod["spec"].get("volumes", [])}

    def sources(volume: dict) -> dict[str, tuple[str, str]]:   # path within the volume -> (secret, key)
        if "secret" in volume:
            sec = volume["secret"]
            return {i["path"]: (sec["secretName"], i["key"]) for i in sec["items"]}
        if "projected" in volume:
            return {i["path"]: (s["secret"]["name"], i["key"]) for s in volume["projected"]["sources"]
                    for i in s["secret"]["items"]}
        return {}
    files: dict[str, tuple[str, str]] = {}
    for m in container.get("volumeMounts", []):
        volume = volumes[m["name"]]
        for path, src in sources(volume).items():
            files[f"{m['mountPath']}/{path}"] = src
        if "emptyDir" in volume:   # filled by an init container: what it copies there
            for init in pod["spec"].get("initContainers", []):
                mounts = {im["name"]: im["mountPath"] for im in init["volumeMounts"]}
                if m["name"] not in mounts:
                    continue
                env = {"STAGE_INDEX": str(ordinal)}
                script = init["command"][2].replace("$(STAGE_INDEX)", env["STAGE_INDEX"])
                copied = re.match(r"cp (\S+)/\* (\S+)/ && chmod 0400 \S+$", script)
                assert init["command"][:2] == ["sh", "-c"] and copied, script
                src_dir, dst_dir = copied.groups()
                assert dst_dir == mounts[m["name"]]
                (from_volume,) = [n for n, path in mounts.items() if src_dir.startswith(path + "/")]
                prefix = src_dir[len(mounts[from_volume]) + 1:] + "/"
                for path, src in sources(volumes[from_volume]).items():
                    if path.startswith(prefix):
                        files[f"{m['mountPath']}/{path[len(prefix):]}"] = src
    return files


def _tls_containers(docs: list[dict]):
    """(pod template, container, certificate name, ordinal) of every tether container, its certificate name the
    one service_commands(tls_dir=) gives its role: stage-<i>, coordinator, admission."""
    for d in docs:
        if d["kind"] == "StatefulSet":
            for i in range(d["spec"]["replicas"]):
                yield d["spec"]["template"], _workload_containers(d)[0], f"stage-{i}", i
        elif d["kind"] == "Deployment":
            for c in _workload_containers(d):
                role = c["args"][0]
                name = f"stage-{_flags(c['args'][1:])['--layers'].split('/')[0]}" if role == "stage" else role
                yield d["spec"]["template"], c, name, 0


@pytest.mark.parametrize("name", sorted(SECURE))
def test_each_container_reads_only_its_own_certificate_and_never_the_ca_key(name):
    docs = render(SECURE[name])
    seen = set()
    for pod, c, cert, ordinal in _tls_containers(docs):
        env = {e["name"]: e.get("value") for e in c["env"]}
        files = _files_of(pod, c, ordinal)
        secret = f"tether-tls-{cert}"
        assert files[env[settings.TLS_CERT_ENV]] == (secret, "tls.crt"), (c["name"], cert)
        assert files[env[settings.TLS_KEY_ENV]] == (secret, "tls.key"), (c["name"], cert)
        assert files[env[settings.TLS_CA_ENV]][1] == "ca.crt"
        keys = {src for src in files.values() if src[1] == "tls.key"}
        assert keys == {(secret, "tls.key")}, f"{c['name']} ({cert}) can read another identity's key: {keys}"
        seen.add(cert)
        for volume in pod["spec"].get("volumes", []):
            assert "tether-ca" not in str(volume), "no pod may mount the CA's Secret (its key signs identities)"
            assert "ca.key" not in str(volume)
        pod_security = pod["spec"]["securityContext"]
        assert pod_security["fsGroup"] == IMAGE_UID, "the Secrets' 0440 files are readable by the image's user"
    assert {"coordinator", "stage-0", "stage-1"} <= seen


def _certificates() -> dict[str, dict]:
    docs = render(CERT_MANAGER)
    return {d["spec"]["secretName"]: d for d in docs if d["kind"] == "Certificate"}


def test_cert_manager_certificates_carry_the_identities_and_the_names_peers_dial():
    from tether.security.identity import of_service, parse
    certs = _certificates()
    ca = certs.pop("tether-ca")
    assert ca["spec"]["isCA"] is True
    (ca_issuer,) = [d for d in render(CERT_MANAGER) if d["kind"] == "Issuer" and "ca" in d["spec"]]
    assert ca_issuer["spec"]["ca"]["secretName"] == "tether-ca"
    both = render(BASE) + render(SECOND_PIPELINE) + render(AUTOSCALED)
    mounted = {src[0] for pod, c, cert, i in _tls_containers(both) for src in _files_of(pod, c, i).values()}
    assert mounted - {"tether-tenants"} == set(certs), "every certificate the workloads mount is made here"
    dialled = {f"stage-{i}": set() for i in range(2)}
    for docs, prefix in ((render(BASE), ""), (render(BASE) + render(SECOND_PIPELINE), "p1-")):
        route = _flags(_argv(docs, ("Deployment", f"{prefix}tether-coordinator"))[1:])["--stages"].split(",")
        for i, address in enumerate(route):
            dialled[f"stage-{i}"].add(address.rsplit(":", 1)[0])
    dialled["coordinator"] = {_flags(_argv(render(BASE), ADMISSION)[1:])["--coordinator"].split(":")[1]}
    dialled["admission"] = {"tether-admission"}
    for secret, cert in certs.items():
        name = secret.removeprefix("tether-tls-")
        spec = cert["spec"]
        assert spec["uris"] == [of_service(name).uri] and parse(spec["uris"][0]) == of_service(name)
        assert {"server auth", "client auth"} <= set(spec["usages"]), f"{name} serves and calls"
        assert spec["issuerRef"] == {"name": ca_issuer["metadata"]["name"], "kind": "Issuer"}
        assert dialled[name] <= set(spec["dnsNames"]), f"{name}: peers dial {dialled[name]}"
        # the name every channel between services verifies this identity under, and no other certificate's
        servers = {d for d in spec["dnsNames"] if d.endswith(".id.tether.local")}
        assert servers == {of_service(name).server_name}, f"{name} must carry its server name, only its own"
        assert "127.0.0.1" in spec["ipAddresses"], "the probes dial the pod's loopback"
        assert spec["privateKey"]["algorithm"] == "ECDSA"


# NetworkPolicy semantics (networking.k8s.io/v1), for pods of one namespace and peers by pod or namespace labels
def _matches(selector: dict, labels: dict) -> bool:
    assert set(selector) <= {"matchLabels"}, f"selector features not modelled: {selector}"
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def _admits(policies: list[dict], pod: dict, port: int, peer: dict, peer_namespace: dict) -> bool:
    """Whether a connection from `peer` (pod labels; its namespace's labels; "same" namespace when
    peer_namespace is None) to `pod` on `port` is allowed: not isolated, or some selecting policy admits it."""
    selecting = [p for p in policies if _matches(p["spec"]["podSelector"], pod)
                 and "Ingress" in p["spec"].get("policyTypes", ["Ingress"])]
    if not selecting:
        return True
    for policy in selecting:
        for rule in policy["spec"].get("ingress", []):
            if "ports" in rule and port not in {p["port"] for p in rule["ports"]}:
                continue
            if "from" not in rule:
                return True
            for frm in rule["from"]:
                same_ns = peer_namespace is None
                if "namespaceSelector" in frm:
                    ns_ok = _matches(frm["namespaceSelector"], peer_namespace or {"kubernetes.io/metadata.name": "tether"})
                else:
                    ns_ok = same_ns
                if ns_ok and ("podSelector" not in frm or _matches(frm["podSelector"], peer)):
                    return True
    return False


def _pods(docs: list[dict]) -> dict[str, dict]:
    return {d["metadata"]["name"]: d["spec"]["template"]["metadata"]["labels"] for d in docs
            if d["kind"] in ("Deployment", "StatefulSet")}


def test_network_policies_let_only_admission_reach_coordinators_and_only_a_pipeline_reach_its_stages():
    """The base and a second pipeline side by side, and a stranger pod of the same namespace: who may open which
    port, evaluated as Kubernetes evaluates NetworkPolicies."""
    docs = render(BASE) + render(SECOND_PIPELINE)
    policies = [d for d in docs if d["kind"] == "NetworkPolicy"]
    pods = _pods(docs)
    adm, coord, stage = pods["tether-admission"], pods["tether-coordinator"], pods["tether-stage"]
    coord1, stage1 = pods["p1-tether-coordinator"], pods["p1-tether-stage"]
    stranger = {"app": "something-else"}
    monitoring = {"kubernetes.io/metadata.name": "monitoring"}
    elsewhere = {"kubernetes.io/metadata.name": "default"}

    def ok(pod, port, peer, ns=None):
        return _admits(policies, pod, port, peer, ns)
    for c in (coord, coord1):   # coordinators: admission only
        assert ok(c, 50061, adm)
        assert not any(ok(c, 50061, p) for p in (stage, stage1, stranger, coord1 if c is coord else coord))
        assert not ok(c, 50061, stranger, elsewhere)
    assert ok(stage, 50071, coord) and ok(stage, 50071, stage)            # its coordinator; the relay from stage 0
    assert ok(stage1, 50071, coord1) and ok(stage1, 50071, stage1)
    assert not any(ok(stage, 50071, p) for p in (adm, coord1, stage1, stranger))
    assert not any(ok(stage1, 50071, p) for p in (adm, coord, stage, stranger))
    assert not ok(stage, 50071, stranger, monitoring)
    for port in (50051, settings.HTTP_PORT):   # the public door: gRPC and the OpenAI-compatible API
        assert ok(adm, port, stranger) and ok(adm, port, stranger, elsewhere)
    for pod, metrics_port in ((adm, 9051), (coord, 9061), (stage, 9071), (stage1, 9071)):
        assert ok(pod, metrics_port, stranger, monitoring)
        assert not ok(pod, metrics_port, stranger) and not ok(pod, metrics_port, adm)
    for pod in (adm, coord, stage, stage1):   # anything else: refused by the default deny
        assert not ok(pod, 8080, stranger) and not ok(pod, 22, adm)
    # every tether pod is isolated (selected by the default deny), including autoscaled's pipeline pods
    deny = one(docs, "NetworkPolicy", "tether-default-deny")
    auto = _pods(render(AUTOSCALED))
    assert all(_matches(deny["spec"]["podSelector"], labels) for labels in list(pods.values()) + list(auto.values()))
    auto_policies = [d for d in render(AUTOSCALED) if d["kind"] == "NetworkPolicy"]
    assert _admits(auto_policies, auto["tether-pipeline"], 50061, auto["tether-admission"], None)
    assert not _admits(auto_policies, auto["tether-pipeline"], 50071, auto["tether-admission"], None)
