"""docker-compose.yml, deploy/Dockerfile and deploy/k8s parse, and name only images, commands,
ports and settings that the code really has: a renamed flag, setting or port fails here."""

from __future__ import annotations

import re
import shlex
import shutil
from pathlib import Path
from typing import Any

import pytest
import typer.main
import yaml

from domain.settings import Settings
from domain.tuning import Tuning
from phalanx import __version__
from phalanx.cli.main import app as phalanx_app
from tests.deploy.tools import DEPLOY, promtool
from tests.support.server import REPO_ROOT, self_signed_pair

K8S = DEPLOY / "k8s"
IMAGE = f"phalanx:{__version__}"
SETTINGS_ENV = {f"PHALANX_{name.upper()}" for name in Settings.model_fields} | {
    f"PHALANX_SCHED_{name.upper()}" for name in Tuning.model_fields}
OTHER_ENV = {"PROMETHEUS_MULTIPROC_DIR"}  # read by api/metrics.py (prometheus-client)


def compose() -> dict[str, Any]:
    return yaml.safe_load((REPO_ROOT / "docker-compose.yml").read_text())


def k8s_objects() -> list[dict[str, Any]]:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    objects = []
    for resource in kustomization["resources"]:
        objects += [d for d in yaml.safe_load_all((K8S / resource).read_text()) if d]
    return objects


def by_kind(kind: str) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["name"]: o for o in k8s_objects() if o["kind"] == kind}


def check_command(argv: list[str]) -> None:
    """The argv a container runs: `phalanx ...` must parse with our CLI; celery must name our app."""
    if argv[0] == "phalanx":
        command: Any = typer.main.get_command(phalanx_app)
        rest = argv[1:]
        while hasattr(command, "list_commands"):  # a group: descend into the named subcommand
            name, *rest = rest
            command = command.get_command(None, name)
            assert command is not None, f"no such command {name!r} in {shlex.join(argv)}"
        try:
            command.make_context(argv[-1], list(rest))  # parses and validates, runs nothing
        except Exception as exc:  # typer's (vendored) click raises UsageError subclasses
            pytest.fail(f"{shlex.join(argv)}: {exc}")
    elif argv[0] == "celery":
        assert argv[1:3] == ["-A", "roots.worker"], argv
        from roots import worker

        assert worker.app.main, "roots.worker.app is the Celery app"
    else:
        pytest.fail(f"unexpected command {argv}")


def env_names(mapping: dict[str, Any] | list[str]) -> set[str]:
    if isinstance(mapping, list):
        return {item.split("=", 1)[0] for item in mapping}
    return set(mapping)


# -- docker compose ---------------------------------------------------------------------------

PHALANX_SERVICES = ("migrate", "api", "worker", "beat")


def test_compose_runs_the_whole_stack_with_health_checks_and_named_volumes() -> None:
    doc = compose()
    services = doc["services"]
    assert set(services) == {"postgres", "redis", "migrate", "api", "worker", "beat", "prometheus",
                             "grafana"}
    for name, service in services.items():
        if name != "migrate":
            assert "healthcheck" in service, f"{name} has no health check"
    used = {v.split(":", 1)[0] for s in services.values() for v in s.get("volumes", [])
            if not v.startswith(".")}
    assert used <= set(doc["volumes"]), f"undeclared volumes: {used - set(doc['volumes'])}"
    for name in ("api", "worker", "beat"):
        assert services[name]["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
    assert services["migrate"]["command"] == ["phalanx", "db", "upgrade"]


def test_compose_phalanx_services_use_our_image_commands_and_settings() -> None:
    services = compose()["services"]
    for name in PHALANX_SERVICES:
        service = services[name]
        assert service["image"] == IMAGE
        assert service["build"]["dockerfile"] == "deploy/Dockerfile"
        check_command(service["command"])
        unknown = env_names(service["environment"]) - SETTINGS_ENV - OTHER_ENV
        assert not unknown, f"{name}: environment the code never reads: {unknown}"
    api = services["api"]
    assert "--workers" in api["command"] and api["command"][api["command"].index("--workers") + 1] == "2"
    port = api["command"][api["command"].index("--port") + 1]
    assert f"{port}:{port}" in api["ports"]


def test_compose_prometheus_scrapes_the_api_and_loads_the_rules() -> None:
    services = compose()["services"]
    prom_cfg = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    api_port = services["api"]["command"][services["api"]["command"].index("--port") + 1]
    targets = [t for job in prom_cfg["scrape_configs"] if job["job_name"] == "phalanx-api"
               for sc in job["static_configs"] for t in sc["targets"]]
    assert targets == [f"api:{api_port}"]
    mounts = dict(m.rsplit(":", 1)[0].split(":", 1)[::-1] for m in services["prometheus"]["volumes"]
                  if m.startswith("./"))  # container path -> host path
    flag = next(a for a in services["prometheus"]["command"] if a.startswith("--config.file="))
    config_path = flag.split("=", 1)[1]
    assert mounts[config_path] == "./deploy/prometheus/prometheus.yml"
    for rule_file in prom_cfg["rule_files"]:  # relative to the config file, as Prometheus reads it
        in_container = f"{config_path.rsplit('/', 1)[0]}/{rule_file}"
        assert mounts.get(in_container) == f"./deploy/prometheus/{rule_file}", in_container
        assert (DEPLOY / "prometheus" / rule_file).is_file(), rule_file


def test_compose_grafana_sets_every_variable_the_provisioning_reads() -> None:
    grafana = compose()["services"]["grafana"]
    text = (DEPLOY / "grafana" / "provisioning" / "datasources" / "datasources.yml").read_text()
    wanted = set(re.findall(r"\$\{(\w+)\}", text))
    assert wanted and wanted <= env_names(grafana["environment"])
    assert grafana["environment"]["GRAFANA_PROMETHEUS_URL"] == "http://prometheus:9090"
    assert "./deploy/grafana/provisioning:/etc/grafana/provisioning:ro" in grafana["volumes"]


def test_the_dockerfile_copies_what_exists_and_runs_our_server() -> None:
    text = (DEPLOY / "Dockerfile").read_text()
    for src in re.findall(r"^COPY (?!--)(\S+(?: \S+)*?) \S+$", text, re.M):
        for part in src.split():
            assert (REPO_ROOT / part).exists(), f"Dockerfile copies missing {part}"
    # every package `pip install .` installs (pyproject's list), so the image has what it runs
    import tomllib

    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    packages = [p.rstrip("*") for p in project["tool"]["setuptools"]["packages"]["find"]["include"]]
    assert "pictures" in packages
    for package in packages:
        assert f"COPY {package} " in text, f"the image lacks {package}/"
    cmd = re.search(r'^CMD (\[.*\])$', text, re.M)
    assert cmd
    check_command(yaml.safe_load(cmd.group(1)))
    assert "PROMETHEUS_MULTIPROC_DIR" in text


# -- kubernetes -------------------------------------------------------------------------------

def test_kustomization_lists_every_manifest_and_each_parses() -> None:
    listed = set(yaml.safe_load((K8S / "kustomization.yaml").read_text())["resources"])
    on_disk = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == on_disk
    kinds = sorted(o["kind"] for o in k8s_objects())
    for kind in ("Deployment", "Service", "HorizontalPodAutoscaler", "ConfigMap", "Secret",
                 "PersistentVolumeClaim", "Namespace"):
        assert kind in kinds, kind
    for obj in k8s_objects():
        assert obj.get("apiVersion") and obj["metadata"].get("name"), obj


def containers(deployment: dict[str, Any]) -> list[dict[str, Any]]:
    pod = deployment["spec"]["template"]["spec"]
    return [*pod.get("initContainers", []), *pod["containers"]]


def test_deployments_run_our_image_commands_and_real_settings() -> None:
    deployments = by_kind("Deployment")
    assert set(deployments) == {"phalanx-api", "phalanx-worker", "phalanx-beat"}
    configmaps, secrets = by_kind("ConfigMap"), by_kind("Secret")
    claims = by_kind("PersistentVolumeClaim")
    for name, dep in deployments.items():
        labels = dep["spec"]["template"]["metadata"]["labels"]
        assert dep["spec"]["selector"]["matchLabels"].items() <= labels.items(), name
        for c in containers(dep):
            assert c["image"] == IMAGE, name
            check_command(c["command"])
            for source in c.get("envFrom", []):
                ref = source.get("configMapRef") or source.get("secretRef")
                assert ref["name"] in configmaps or ref["name"] in secrets, ref
            unknown = {e["name"] for e in c.get("env", [])} - SETTINGS_ENV - OTHER_ENV
            assert not unknown, f"{name}: {unknown}"
        for volume in dep["spec"]["template"]["spec"].get("volumes", []):
            if "persistentVolumeClaim" in volume:
                assert volume["persistentVolumeClaim"]["claimName"] in claims
    for cm in [*configmaps.values(), *secrets.values()]:
        keys = set(cm.get("data", {})) | set(cm.get("stringData", {}))
        assert keys <= SETTINGS_ENV, f"{cm['metadata']['name']}: unknown {keys - SETTINGS_ENV}"


def _bytes(quantity: str) -> int:
    units = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30}
    return int(quantity[:-2]) * units[quantity[-2:]] if quantity[-2:] in units else int(quantity)


def test_what_each_pod_keeps_of_a_steps_buffers_fits_its_memory_limit() -> None:
    """The buffer pool keeps what a step used until it is let go (wire/buffers.py), per process:
    a pod's processes together must be able to hold their pools under its memory limit, or the
    defaults kill it with a big model (4 GiB a process by default)."""
    pool = by_kind("ConfigMap")["phalanx-config"]["data"]["PHALANX_BUFFER_POOL_MB"]
    for name in ("phalanx-api", "phalanx-worker"):
        (c,) = by_kind("Deployment")[name]["spec"]["template"]["spec"]["containers"]
        argv = c["command"]
        processes = int(argv[argv.index("--workers") + 1]) if "--workers" in argv else 1
        limit = _bytes(c["resources"]["limits"]["memory"])
        assert processes * (int(pool) << 20) <= 0.8 * limit, (name, processes, pool, limit)


def test_beat_runs_exactly_once_and_the_shared_volume_is_read_write_many() -> None:
    beat = by_kind("Deployment")["phalanx-beat"]
    assert beat["spec"]["replicas"] == 1
    assert beat["spec"]["strategy"]["type"] == "Recreate"
    assert "HorizontalPodAutoscaler" not in {o["kind"] for o in k8s_objects()
                                             if o.get("spec", {}).get("scaleTargetRef", {})
                                             .get("name") == "phalanx-beat"}
    for claim in by_kind("PersistentVolumeClaim").values():
        assert claim["spec"]["accessModes"] == ["ReadWriteMany"]  # several pods mount it


def test_disruption_budgets_keep_an_api_replica_and_a_worker_through_a_drain() -> None:
    budgets = by_kind("PodDisruptionBudget")
    deployments = by_kind("Deployment")
    for name in ("phalanx-api", "phalanx-worker"):
        budget = budgets[name]
        assert budget["apiVersion"] == "policy/v1" and budget["spec"]["minAvailable"] == 1
        pod_labels = deployments[name]["spec"]["template"]["metadata"]["labels"]
        assert budget["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert deployments["phalanx-api"]["spec"].get("replicas", 2) >= 2  # else the budget blocks


def test_beat_answers_its_liveness_probe_only_with_remote_control_on() -> None:
    (beat,) = containers(by_kind("Deployment")["phalanx-beat"])
    assert "--enable-remote-control" in beat["command"]
    probe = beat["livenessProbe"]["exec"]["command"]
    assert probe[:2] == ["sh", "-c"]
    assert "celery -A roots.worker inspect ping" in probe[2]
    assert "-d celerybeat@$HOSTNAME" in probe[2]


def test_beats_probe_command_passes_against_a_real_beat_and_redis(redis_url: str,
                                                                  tmp_path: Path) -> None:
    """The probe as the manifest writes it, run against a real beat with remote control."""
    import os
    import socket
    import subprocess
    import sys
    import time

    (beat,) = containers(by_kind("Deployment")["phalanx-beat"])
    # the image's PATH holds celery; here, this interpreter's environment does
    path = os.pathsep.join((str(Path(sys.executable).parent), os.environ.get("PATH", "")))
    env = {**os.environ, "PATH": path, "PHALANX_REDIS_URL": redis_url,
           "HOSTNAME": socket.gethostname(), "PHALANX_DATA_DIR": str(tmp_path),
           "PYTHONPATH": str(REPO_ROOT)}
    argv = [*beat["command"], "--schedule", str(tmp_path / "beat-schedule")]
    process = subprocess.Popen(argv, env=env, cwd=tmp_path, stdout=subprocess.DEVNULL,
                               stderr=subprocess.STDOUT)
    probe = beat["livenessProbe"]["exec"]["command"]
    assert "--timeout 10" in probe[2]
    probe = [*probe[:2], probe[2].replace("--timeout 10", "--timeout 2")]  # quicker misses
    try:
        answered = None
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            answered = subprocess.run(probe, env=env, cwd=REPO_ROOT, capture_output=True,
                                      text=True, timeout=60)
            if answered.returncode == 0:
                break
            time.sleep(1)
        assert answered is not None and answered.returncode == 0, answered
        process.terminate()
        process.wait(timeout=30)
        gone = subprocess.run(probe, env=env, cwd=REPO_ROOT, capture_output=True, timeout=60)
        assert gone.returncode != 0  # no beat, no answer: the kubelet would restart it
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_the_ingress_example_routes_the_api_and_the_bulk_port_to_their_service_ports() -> None:
    ingress = yaml.safe_load((K8S / "examples" / "ingress.yaml").read_text())
    assert ingress["kind"] == "Ingress" and ingress["apiVersion"] == "networking.k8s.io/v1"
    service = by_kind("Service")["phalanx-api"]
    port_names = {p["name"] for p in service["spec"]["ports"]}
    routed = {rule["host"]: rule["http"]["paths"][0]["backend"]["service"]
              for rule in ingress["spec"]["rules"]}
    assert {b["name"] for b in routed.values()} == {"phalanx-api"}
    assert sorted(b["port"]["name"] for b in routed.values()) == ["bulk", "http"]
    assert {b["port"]["name"] for b in routed.values()} <= port_names
    assert "PHALANX_BULK_PUBLIC_URL" in (K8S / "examples" / "ingress.yaml").read_text()
    assert "bulk_public_url" in Settings.model_fields


def test_the_api_service_hpa_and_scrape_annotations_point_at_the_api() -> None:
    api = by_kind("Deployment")["phalanx-api"]
    pod = api["spec"]["template"]
    container = next(c for c in pod["spec"]["containers"] if c["name"] == "api")
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert str(ports["http"]) == container["command"][container["command"].index("--port") + 1]
    notes = pod["metadata"]["annotations"]
    assert notes["prometheus.io/scrape"] == "true"
    assert int(notes["prometheus.io/port"]) == ports["http"]
    assert notes["prometheus.io/path"] == "/metrics"
    service = by_kind("Service")["phalanx-api"]
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert all(p["targetPort"] in ports or p["targetPort"] in ports.values()
               for p in service["spec"]["ports"])
    hpa = by_kind("HorizontalPodAutoscaler")["phalanx-api"]
    assert hpa["spec"]["scaleTargetRef"]["name"] == "phalanx-api"
    assert hpa["spec"]["minReplicas"] >= 2
    probes = {container["readinessProbe"]["httpGet"]["path"], container["livenessProbe"]["httpGet"]["path"]}
    assert probes == {"/readyz", "/healthz"}


def test_a_wrong_flag_would_be_caught() -> None:
    with pytest.raises(pytest.fail.Exception, match="--wokers"):
        check_command(["phalanx", "server", "--wokers", "2"])


def test_the_k8s_namespace_is_the_kustomization_namespace() -> None:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert set(by_kind("Namespace")) == {kustomization["namespace"]}




def test_the_tls_override_serves_https_from_the_mounted_pair_and_prometheus_checks_it(
        tmp_path: Path) -> None:
    """deploy/compose.tls.yml over docker-compose.yml: the API gets --tls-cert/--tls-key from
    the mounted ./deploy/tls, its health check and Prometheus's scrape speak https."""
    override = yaml.safe_load((DEPLOY / "compose.tls.yml").read_text())["services"]
    api = override["api"]
    mounts = dict(v.rsplit(":", 1)[0].split(":", 1)[::-1] for v in api["volumes"])
    host_dir = mounts["/tls"]
    assert host_dir == "./deploy/tls" and (REPO_ROOT / host_dir / ".gitignore").is_file()
    command = api["command"]
    for flag in ("--tls-cert", "--tls-key"):
        assert command[command.index(flag) + 1].startswith("/tls/")
    cert, key = self_signed_pair(tmp_path)  # the files the openssl line in the override makes
    check_command([{"/tls/server.pem": str(cert), "/tls/server.key": str(key)}.get(a, a)
                   for a in command])
    assert "https://127.0.0.1:8000/readyz" in api["healthcheck"]["test"][-1]
    base = compose()["services"]["api"]["command"]
    assert command[:len(base)] == base  # the same server, plus TLS
    prom = dict(v.rsplit(":", 1)[0].split(":", 1)[::-1] for v in override["prometheus"]["volumes"])
    assert prom["/etc/prometheus/prometheus.yml"] == "./deploy/prometheus/prometheus-tls.yml"
    assert prom["/etc/prometheus/phalanx-ca.pem"] == "./deploy/tls/server.pem"
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus-tls.yml").read_text())
    api_job = next(j for j in config["scrape_configs"] if j["job_name"] == "phalanx-api")
    assert api_job["scheme"] == "https" and api_job["tls_config"]["server_name"] == "api"
    assert api_job["tls_config"]["ca_file"] == "/etc/prometheus/phalanx-ca.pem"
    api_job["tls_config"]["ca_file"] = str(cert)  # as mounted, for promtool to read here
    shutil.copy(DEPLOY / "prometheus" / "alerts.yml", tmp_path / "alerts.yml")
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    done = promtool("check", "config", "prometheus.yml", cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
