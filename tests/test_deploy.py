"""The Helm chart as Helm itself renders and lints it (the helm-python-sdk wheel embeds Helm),
the manifests rendered from it, and what both promise: they validate against the Kubernetes
schemas (kubernetes-validate), kvguard runs as a native sidecar probed over HTTP on its
metrics listener, migrations run as the owning role and `serve` as the runtime role, keys
and passwords reach kvguard readable by its user only, and every container is locked down."""

from __future__ import annotations

import functools
import json
import os
import re
import sys
from pathlib import Path

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

from kvguard.cli import build_parser
from kvguard.sidecar.settings import OTHER_VARIABLES, Settings, load_settings

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "deploy/helm/kvguard"
RELEASE = "llm-inference"
# the oldest Kubernetes with native sidecars on by default (the chart's kubeVersion), and the newest schema
KUBE_VERSIONS = ("1.29.0", kubernetes_validate.latest_version())
DEFAULTS = yaml.safe_load((CHART / "values.yaml").read_text())
UID = DEFAULTS["kvguard"]["uid"]
METRICS_PORT = DEFAULTS["kvguard"]["metricsPort"]


# what the chart's defaults lack: the verifier key of the witness it deploys by default
WITNESS = {"witnesses": {"vkey": "witness.example/w1+fa029245+BIAMEqSNVtZbVcQ5h5+9TxIROxx5UgFf63FrfyNlvSVg"}}


def witnessed(values: dict | None) -> dict:
    """`values` over WITNESS: the witness's key where the values name none."""
    values = dict(values or {})
    values["witnesses"] = {**WITNESS["witnesses"], **values.get("witnesses", {})}
    return values


@functools.cache
def render(values_file: str | None, vllm: tuple[tuple[str, object], ...] = ()) -> tuple[dict, ...]:
    """The chart rendered with a values file (and values of its vllm section set)."""
    values = yaml.safe_load((CHART / values_file).read_text()) if values_file else None
    if vllm:
        values = {**values, "vllm": {**values["vllm"], **dict(vllm)}}
    values = witnessed(values)
    with helm.Chart.load(CHART) as chart:
        rendered = chart.render(values, name=RELEASE, namespace="ml", is_install=True)
    assert "port-forward" in rendered.pop("kvguard/templates/NOTES.txt")  # what `helm install` prints
    return tuple(d for text in rendered.values() for d in yaml.safe_load_all(text) if d)


@functools.cache
def manifests() -> tuple[dict, ...]:
    """The inference pods' manifests (the witness runs apart: witness.yaml, tested below)."""
    return tuple(d for f in sorted((ROOT / "deploy/k8s").glob("*.yaml"))
                 if f.name not in ("values.yaml", "witness.yaml")
                 for d in yaml.safe_load_all(f.read_text()) if d)


DEPLOYMENTS = {"chart": lambda: render(None), "chart-production": lambda: render("values-production.yaml"),
               "manifests": manifests}
VLLM = {"chart-vllm": lambda: render("values-vllm.yaml")}  # vLLM behind kvguard's front (docs/vllm.md)


def one(docs, kind: str) -> dict:
    """The one resource of a kind of the inference pods (the chart's witness is apart)."""
    found = [d for d in docs if d["kind"] == kind and "-witness" not in d["metadata"]["name"]]
    assert len(found) == 1, f"{len(found)} {kind}s"
    return found[0]


def pod_of(docs) -> dict:
    return one(docs, "Deployment")["spec"]["template"]["spec"]


def sidecar_of(pod: dict) -> dict:
    return next(c for c in pod["initContainers"] if c["name"] == "kvguard")


def env_of(container: dict) -> dict:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def all_pods(docs) -> list[dict]:
    return [d["spec"]["template"]["spec"] for d in docs if d["kind"] in ("Deployment", "Job")]


# --- Helm and the Kubernetes schemas ----------------------------------------------------------------


def test_the_manifests_are_the_chart_as_helm_renders_it():
    sys.path.insert(0, str(ROOT / "deploy/k8s"))
    try:
        import render as k8s_render
    finally:
        sys.path.pop(0)
    for name, text in k8s_render.render().items():
        assert (ROOT / "deploy/k8s" / name).read_text() == text, f"{name} is stale: run python deploy/k8s/render.py"


@pytest.mark.parametrize("values_file", [None, "values-production.yaml", "values-vllm.yaml"])
def test_helm_lint_finds_nothing_to_warn_about(values_file):
    values = witnessed(yaml.safe_load((CHART / values_file).read_text()) if values_file else None)
    report = helm.lint(CHART, values, strict=True, kube_version="v1.29.0")
    assert report["errors"] == [] and report["total_charts_linted"] == 1
    assert [m for m in report["messages"] if m["severity"] >= 2] == []  # 1: info ("icon is recommended")


@pytest.mark.parametrize("deployment", DEPLOYMENTS | VLLM)
def test_every_resource_validates_against_the_kubernetes_schemas(deployment):
    docs = (DEPLOYMENTS | VLLM)[deployment]()
    kinds = sorted(d["kind"] for d in docs)
    assert {"Deployment", "Job", "Service"} <= set(kinds), kinds
    for doc in docs:
        if doc["apiVersion"].startswith("monitoring.coreos.com/"):
            continue  # a CRD, which kubernetes-validate has no schema for: checked below
        for version in KUBE_VERSIONS:
            kubernetes_validate.validate(doc, version, strict=True)  # raises, naming the field


def test_the_schemas_would_catch_a_native_sidecar_on_a_cluster_without_them():
    """The validation is real: before 1.28 a container has no restartPolicy."""
    with pytest.raises(kubernetes_validate.ValidationError, match="restartPolicy"):
        kubernetes_validate.validate(one(render(None), "Deployment"), "1.27.0", strict=True)


def test_the_service_monitor_scrapes_the_metrics_service():
    docs = render("values-production.yaml")
    monitor, service = one(docs, "ServiceMonitor"), one(docs, "Service")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "prometheus"  # values-production's selector label
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    [endpoint] = monitor["spec"]["endpoints"]
    assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}
    assert endpoint["path"] == "/metrics" and re.fullmatch(r"\d+[smh]", endpoint["interval"])
    assert "ServiceMonitor" not in {d["kind"] for d in render(None)}  # off by default: it needs the CRD


def test_the_production_example_pulls_both_images_with_its_credentials():
    for pod in all_pods(render("values-production.yaml")):
        assert pod["imagePullSecrets"] == [{"name": "registry-credentials"}]
    assert all("imagePullSecrets" not in pod for pod in all_pods(render(None)))


@pytest.mark.parametrize("values, error", [
    ({"kvguard": {"metricPort": 9471}}, "additional properties 'metricPort' not allowed"),
    ({"kvguard": {"metricsPort": "9471"}}, "got string, want integer"),
    ({"secrets": {"database": "Kvguard_DB"}}, "does not match pattern"),
    ({"kvguard": {"readinessProbe": {"timeoutSeconds": 0}}}, "minimum"),
    ({"kvguard": {"metricsPort": 8470}}, "must differ"),
    ({"witnesses": {"vkey": None}}, "witnesses.vkey is required"),  # the defaults deploy a witness: name its key
    ({"witnesses": {"vkey": "not a vkey"}}, "does not match pattern"),
])
def test_values_that_helm_must_refuse(values, error):
    """values.schema.json: a misspelt key or a wrong type fails the install instead of being ignored."""
    with helm.Chart.load(CHART) as chart, pytest.raises(helm.HelmError, match=error):
        chart.render(witnessed(values), name=RELEASE)


def test_the_chart_deploys_a_witness_by_default_and_the_sidecars_use_it():
    docs = render(None)
    witness = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"].endswith("-witness"))
    service = next(d for d in docs if d["kind"] == "Service" and d["metadata"]["name"].endswith("-witness"))
    inference = next(d for d in docs if d["kind"] == "Deployment" and d is not witness)
    # neither the inference Deployment nor the metrics Service selects the witness's pod
    labels = witness["spec"]["template"]["metadata"]["labels"]
    for d in docs:
        sel = d["spec"].get("selector", {}) if d["kind"] in ("Deployment", "Service") and d is not witness \
            and d is not service else None
        sel = (sel or {}).get("matchLabels", sel) if sel else None
        assert not sel or not all(labels.get(k) == v for k, v in sel.items()), d["metadata"]["name"]
    [target] = json.loads(env_of(sidecar_of(inference["spec"]["template"]["spec"]))["KVGUARD_WITNESSES"])
    assert target == {"url": f"http://{service['metadata']['name']}:8471", "vkey": WITNESS["witnesses"]["vkey"]}
    args = witness["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[:2] == ["witness", "serve"] and args[args.index("--name") + 1] == "witness.example/w1"
    # without the chart's witness, none is configured: the choice is in the values, and the sidecars warn
    with helm.Chart.load(CHART) as chart:
        rendered = chart.render({"witnesses": {"deploy": False}}, name=RELEASE)
    assert "witness" not in "".join(k for k, v in rendered.items() if v.strip() and "NOTES" not in k).replace(
        "templates/witness.yaml", "")
    assert "KVGUARD_WITNESSES" not in rendered["kvguard/templates/deployment.yaml"]


def test_a_service_monitor_without_its_service_is_refused():
    values = {"metrics": {"service": False, "serviceMonitor": {"enabled": True}}}
    with helm.Chart.load(CHART) as chart, pytest.raises(helm.HelmError, match="needs metrics.service"):
        chart.render(witnessed(values), name=RELEASE)


# --- the native sidecar and its probes ------------------------------------------------------------


@pytest.mark.parametrize("deployment", DEPLOYMENTS)
def test_kvguard_is_a_native_sidecar_sharing_the_socket(deployment):
    pod = pod_of(DEPLOYMENTS[deployment]())
    # the secrets are copied first; then the sidecar, which keeps running while the inference
    # container starts after it (once its startup probe passes) and stops before it
    assert [c["name"] for c in pod["initContainers"]] == ["kvguard-secrets", "kvguard"]
    assert sidecar_of(pod)["restartPolicy"] == "Always" and "restartPolicy" not in pod["initContainers"][0]
    assert [c["name"] for c in pod["containers"]] == ["inference"]
    mounts = {c["name"]: {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
              for c in (*pod["containers"], sidecar_of(pod))}
    assert mounts["inference"]["kvguard-sock"] == mounts["kvguard"]["kvguard-sock"] == "/run/kvguard"
    assert env_of(pod["containers"][0])["KVGUARD_SOCKET"] == env_of(sidecar_of(pod))["KVGUARD_INGEST_SOCKET"]


def test_the_vllm_pod_is_kvguards_front_before_vllm_on_loopback_with_the_connector():
    pod = pod_of(render("values-vllm.yaml"))
    assert [c["name"] for c in pod["initContainers"]] == ["kvguard-secrets", "kvguard"]
    front, vllm = pod["containers"]
    assert (front["name"], vllm["name"]) == ("inference", "vllm")
    assert front["image"] == DEFAULTS["kvguard"]["image"] and front["args"][:3] == ["serve-llm", "--upstream",
                                                                                  "http://127.0.0.1:8001"]
    args = vllm["args"]
    assert args[args.index("--host") + 1] == "127.0.0.1"  # only the front reaches vLLM
    connector = json.loads(args[args.index("--kv-transfer-config") + 1])
    assert connector["kv_connector_module_path"] == "kvguard.vllm.connector"
    assert connector["kv_connector_extra_config"] == {"socket": "/run/kvguard/ingest.sock",
                                                      "api_url": "http://127.0.0.1:8001", "offload_blocks": 2048}
    plain = pod_of(render("values-vllm.yaml", (("offloadBlocks", 0),)))["containers"][1]["args"]
    assert "offload_blocks" not in json.loads(plain[plain.index("--kv-transfer-config") + 1])["kv_connector_extra_config"]
    assert not any(v["name"] == "kvguard-offload" for v in pod["volumes"])  # host memory: no volume
    # the copies on sealed disk: an emptyDir of the pod's, mounted in the vLLM container alone
    disk = pod_of(render("values-vllm.yaml", (("offloadTier", "disk"), ("offloadDiskSize", "8Gi"))))
    args = disk["containers"][1]["args"]
    extra = json.loads(args[args.index("--kv-transfer-config") + 1])["kv_connector_extra_config"]
    assert extra["offload_tier"] == "disk" and extra["offload_dir"] == "/var/lib/kvguard-offload"
    assert {"name": "kvguard-offload", "emptyDir": {"sizeLimit": "8Gi"}} in disk["volumes"]
    mounts = {c["name"]: [m["name"] for m in c.get("volumeMounts", [])] for c in disk["containers"]}
    assert "kvguard-offload" in mounts["vllm"] and "kvguard-offload" not in mounts["inference"]
    # the copies in Redis: its URL (a password) from a Secret, in vLLM's environment, not its arguments
    red = pod_of(render("values-vllm.yaml", (("offloadTier", "redis"), ("offloadRedisSecret", "kv-redis"))))
    rargs = red["containers"][1]["args"]
    extra = json.loads(rargs[rargs.index("--kv-transfer-config") + 1])["kv_connector_extra_config"]
    assert extra["offload_tier"] == "redis" and "offload_redis" not in extra
    assert env_of(red["containers"][1])["KVGUARD_OFFLOAD_REDIS_URL"] == {
        "secretKeyRef": {"name": "kv-redis", "key": "url"}}
    assert "KVGUARD_OFFLOAD_REDIS_URL" not in env_of(front) and not any(
        v["name"] == "kvguard-offload" for v in red["volumes"])
    with pytest.raises(Exception, match="needs vllm.offloadRedisSecret"):  # redis without its Secret: refused
        render("values-vllm.yaml", (("offloadTier", "redis"),))
    assert "--kv-events-config" not in args  # vLLM's KV events carry token ids: off
    socket = env_of(sidecar_of(pod))["KVGUARD_INGEST_SOCKET"]
    for c in (front, vllm):  # both are inference processes of the sidecar, over its socket, with the token
        assert env_of(c)["KVGUARD_SOCKET"] == socket
        assert env_of(c)["KVGUARD_INGEST_TOKEN"]["secretKeyRef"]["key"] == "ingest"
        assert any(m["name"] == "kvguard-sock" for m in c["volumeMounts"])
    assert vllm["resources"]["limits"]["nvidia.com/gpu"] == 1 and "nvidia.com/gpu" not in front["resources"]["limits"]


@pytest.mark.parametrize("deployment", DEPLOYMENTS)
def test_probes_are_http_gets_on_the_metrics_listener(deployment):
    docs = DEPLOYMENTS[deployment]()
    sidecar = sidecar_of(pod_of(docs))
    env = env_of(sidecar)
    ports = {p["name"]: p["containerPort"] for p in sidecar["ports"]}
    assert ports == {"metrics": METRICS_PORT} and env["KVGUARD_METRICS_PORT"] == str(METRICS_PORT)
    assert env["KVGUARD_METRICS_HOST"] == "0.0.0.0"  # the pod's IP, where the kubelet and Prometheus connect
    assert env["KVGUARD_HOST"] == "127.0.0.1"  # the admin API (no TLS) stays inside the pod
    for probe, path in (("startupProbe", "/readyz"), ("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")):
        spec = sidecar[probe]
        assert "exec" not in spec, f"{probe} would start a process"  # no interpreter every few seconds
        assert spec["httpGet"] == {"path": path, "port": "metrics"}, probe
        assert 1 <= spec["timeoutSeconds"] < spec["periodSeconds"]
    startup, live = sidecar["startupProbe"], sidecar["livenessProbe"]
    # time enough for a start that waits on the database, and a restart only after 30 s without an answer
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 120
    assert live["periodSeconds"] * live["failureThreshold"] >= 30
    service = one(docs, "Service")
    assert service["spec"]["ports"] == [{"name": "metrics", "port": METRICS_PORT, "targetPort": "metrics",
                                         "protocol": "TCP"}]
    labels = one(docs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()


def test_the_manifests_carry_scrape_annotations_instead_of_a_service_monitor():
    annotations = one(manifests(), "Deployment")["spec"]["template"]["metadata"]["annotations"]
    assert annotations == {"prometheus.io/scrape": "true", "prometheus.io/port": str(METRICS_PORT),
                           "prometheus.io/path": "/metrics"}


# --- roles, secrets, lockdown ------------------------------------------------------------------------


@pytest.mark.parametrize("deployment", DEPLOYMENTS)
def test_migrations_run_as_the_owning_role_and_serve_as_the_runtime_role(deployment):
    docs = DEPLOYMENTS[deployment]()
    secrets = DEFAULTS["secrets"]
    job = one(docs, "Job")
    assert job["metadata"]["annotations"]["helm.sh/hook"] == "pre-install,pre-upgrade"
    [upgrade] = job["spec"]["template"]["spec"]["containers"]
    assert upgrade["args"] == ["db", "upgrade", "--grant", DEFAULTS["migrations"]["runtimeRole"]]
    assert "command" not in upgrade
    args = build_parser().parse_args(upgrade["args"])  # a command that exists, with the grant it runs
    assert (args.command, args.db_command, args.grant) == ("db", "upgrade", "kvguard_rt")
    assert env_of(upgrade)["KVGUARD_DATABASE_URL"]["secretKeyRef"] == {"name": secrets["databaseOwner"], "key": "url"}
    sidecar = sidecar_of(pod_of(docs))
    assert sidecar["args"] == ["serve"] and "command" not in sidecar
    assert env_of(sidecar)["KVGUARD_DATABASE_URL"]["secretKeyRef"] == {"name": secrets["database"], "key": "url"}
    # every sidecar of the database mounts the one volume of key-encryption keys, which outlives the release
    kek = one(docs, "PersistentVolumeClaim")
    assert kek["spec"]["accessModes"] == ["ReadWriteMany"]
    assert kek["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    volumes = {v["name"]: v for v in pod_of(docs)["volumes"]}
    mount = next(m for m in sidecar["volumeMounts"] if m["name"] == "kvguard-kek")
    assert volumes["kvguard-kek"]["persistentVolumeClaim"]["claimName"] == kek["metadata"]["name"]
    assert env_of(sidecar)["KVGUARD_KEK_DIR"] == mount["mountPath"] and not mount.get("readOnly")
    # nothing of the Deployment's pods can read the owning role's Secret
    assert secrets["databaseOwner"] not in json.dumps(one(docs, "Deployment"))


def _copied_files(pod: dict, container: dict) -> dict[str, str]:
    """Each file a container's PGPASSFILE and KVGUARD_*_FILE variables name: the Secret it was copied from."""
    env = env_of(container)
    volumes = {v["name"]: v for v in pod["volumes"]}
    out = {}
    for var in ("KVGUARD_KEY_FILE", "KVGUARD_INDEX_KEY_FILE", "KVGUARD_SEAL_KEY_FILE", "PGPASSFILE"):
        if var not in env:
            continue
        folder, name = env[var].rsplit("/", 1)
        mount = next(m for m in container["volumeMounts"] if m["mountPath"] == folder)
        assert mount.get("readOnly") is True, var
        # The kubelet gives a Secret volume's files to root and the pod's fsGroup, mode 0440
        # (kubernetes/kubernetes#57923); kvguard refuses a key its group can read, libpq ignores
        # such a pgpass: an init container running as kvguard's user copies them, 0400, into memory.
        assert volumes[mount["name"]]["emptyDir"]["medium"] == "Memory", var
        writers = [c for c in pod["initContainers"] if c is not container and
                   any(m["name"] == mount["name"] for m in c["volumeMounts"])]
        assert len(writers) == 1 and writers[0]["securityContext"]["runAsUser"] == container["securityContext"]["runAsUser"]
        command = " ".join(writers[0]["command"])
        assert "install -m 0400 " in command and command.rstrip().endswith(folder + "/"), command
        source = next(p for p in command.split() if p.endswith("/" + name) and p.startswith("/run/kvguard-secret/"))
        src_mount = next(m for m in writers[0]["volumeMounts"] if source.startswith(m["mountPath"] + "/"))
        assert src_mount["readOnly"] is True
        secret = volumes[src_mount["name"]]["secret"]
        assert secret["defaultMode"] == 0o440  # what the kubelet would make of it anyway with an fsGroup
        out[var] = secret["secretName"]
    return out


@pytest.mark.parametrize("deployment", DEPLOYMENTS)
def test_keys_and_passwords_reach_kvguard_readable_by_its_user_only(deployment):
    docs = DEPLOYMENTS[deployment]()
    secrets = DEFAULTS["secrets"]
    pod = pod_of(docs)
    assert _copied_files(pod, sidecar_of(pod)) == {"KVGUARD_KEY_FILE": secrets["keys"],
                                                   "KVGUARD_INDEX_KEY_FILE": secrets["keys"],
                                                   "KVGUARD_SEAL_KEY_FILE": secrets["keys"],
                                                   "PGPASSFILE": secrets["database"]}
    job_pod = one(docs, "Job")["spec"]["template"]["spec"]
    assert _copied_files(job_pod, job_pod["containers"][0]) == {"PGPASSFILE": secrets["databaseOwner"]}
    # the database Secrets' url goes to the environment; only their pgpass becomes a file
    for p in (pod, job_pod):
        for v in p["volumes"]:
            if "secret" in v and v["secret"]["secretName"] != secrets["keys"]:
                assert v["secret"]["items"] == [{"key": "pgpass", "path": "pgpass"}]


def test_without_pgpass_no_password_file_is_copied_or_named():
    with helm.Chart.load(CHART) as chart:
        rendered = chart.render(witnessed({"secrets": {"pgpass": False}}), name=RELEASE)
    docs = [d for name, text in rendered.items() if name.endswith(".yaml") for d in yaml.safe_load_all(text) if d]
    assert "pgpass" not in json.dumps(docs).lower()
    assert "initContainers" not in one(docs, "Job")["spec"]["template"]["spec"]


@pytest.mark.parametrize("deployment", DEPLOYMENTS | VLLM)
def test_every_container_is_locked_down_and_bounded(deployment):
    for pod in all_pods((DEPLOYMENTS | VLLM)[deployment]()):
        assert pod["automountServiceAccountToken"] is False
        # a Service named kvguard in the namespace would otherwise inject KVGUARD_PORT=tcp://... and
        # KVGUARD_SERVICE_HOST, which kvguard's strict settings refuse
        assert pod["enableServiceLinks"] is False
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        for c in (*pod.get("initContainers", []), *pod["containers"]):
            assert c["resources"]["requests"] and c["resources"]["limits"]["memory"], c["name"]
            if c["name"] == "vllm" or c["name"] == "inference" and c["image"] != DEFAULTS["kvguard"]["image"]:
                continue  # the inference image's own user; the pod forbids root (vLLM's front is kvguard's)
            sc = c["securityContext"]
            assert sc["runAsUser"] == sc["runAsGroup"] == UID and sc["runAsNonRoot"] is True, c["name"]
            assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False, c["name"]
            assert sc["capabilities"] == {"drop": ["ALL"]} and sc["seccompProfile"] == {"type": "RuntimeDefault"}
            assert any(m["mountPath"] == "/tmp" for m in c["volumeMounts"]) or c["name"] == "kvguard-secrets"


@pytest.mark.parametrize("deployment", DEPLOYMENTS)
def test_the_data_directory_is_one_kvguard_makes_itself(deployment):
    """The kubelet makes an emptyDir's mount point root's (group: the fsGroup), and kvguard refuses
    a data directory another user owns: the data directory is a folder inside the volume, which
    kvguard makes, 0700, as its own user."""
    for pod in all_pods(DEPLOYMENTS[deployment]()):
        volumes = {v["name"]: v for v in pod["volumes"]}
        for c in (*pod.get("initContainers", []), *pod["containers"]):
            data = env_of(c).get("KVGUARD_DATA_DIR")
            if data is None:
                continue
            mounts = [m for m in c["volumeMounts"] if data.startswith(m["mountPath"].rstrip("/") + "/")]
            assert len(mounts) == 1 and data != mounts[0]["mountPath"], c["name"]
            assert "emptyDir" in volumes[mounts[0]["name"]] and not mounts[0].get("readOnly"), c["name"]
    assert all(env_of(c).get("KVGUARD_DATA_DIR") for p in all_pods(DEPLOYMENTS[deployment]())
               for c in (*p.get("initContainers", []), *p["containers"]) if c["name"] in ("kvguard", "db-upgrade"))


@pytest.mark.parametrize("deployment", DEPLOYMENTS)
def test_environment_variables_are_real_settings(deployment):
    fields = {f"KVGUARD_{name.upper()}" for name in Settings.model_fields}
    for pod in all_pods(DEPLOYMENTS[deployment]()):
        for c in (*pod.get("initContainers", []), *pod["containers"]):
            for var in env_of(c):
                if var.startswith("KVGUARD_"):
                    assert var in fields | OTHER_VARIABLES, f"{c['name']}: {var} is no setting"
    for path in [*CHART.rglob("*.yaml"), *CHART.rglob("*.tpl"), ROOT / "deploy/Dockerfile"]:
        for var in set(re.findall(r"KVGUARD_[A-Z_]+", path.read_text())):
            assert var in fields | OTHER_VARIABLES, f"{path.name}: {var} is no setting"


def test_the_sidecar_environment_is_one_kvguard_accepts(monkeypatch):
    """The image's ENV and the chart's env, as the kubelet would fill them in, load as settings."""
    env = dict(re.findall(r"(KVGUARD_[A-Z_]+)=(\S+)", _final_stage()))
    for name, value in env_of(sidecar_of(pod_of(render("values-production.yaml")))).items():
        if isinstance(value, dict):  # the pod's name, or the runtime role's URL from its Secret
            value = "llm-inference-7d9f-x2" if "fieldRef" in value else "postgresql+psycopg://kvguard_app@db/kvguard"
        env[name] = value
    for name in [n for n in os.environ if n.startswith("KVGUARD_")]:
        monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    s = load_settings()
    assert (s.host, s.port, s.metrics_host, s.metrics_port) == ("127.0.0.1", 8470, "0.0.0.0", METRICS_PORT)
    assert s.origin == "llm-inference-7d9f-x2" and s.retention_max_age_s == 2592000
    assert s.environment == "production" and s.socket_path == Path("/run/kvguard/ingest.sock")


# --- the image ------------------------------------------------------------------------------------------


def _final_stage() -> str:
    return (ROOT / "deploy/Dockerfile").read_text().replace("\\\n", " ").rsplit("\nFROM ", 1)[1]


def test_the_image_runs_what_the_chart_passes():
    final = _final_stage()
    assert re.search(r"^USER (\S+)", final, re.M).group(1) == str(UID)
    assert re.search(rf"groupadd --gid {UID} .*useradd --uid {UID} --gid {UID}", final)
    assert json.loads(re.search(r"^ENTRYPOINT (\[.*\])", final, re.M).group(1)) == ["kvguard"]
    assert re.search(r"^EXPOSE (.*)$", final, re.M).group(1).split() == [str(METRICS_PORT)]
    assert f"KVGUARD_METRICS_PORT={METRICS_PORT}" in final
    for pod in all_pods(render(None)):
        for c in (*pod.get("initContainers", []), *pod["containers"]):
            if c["image"] == DEFAULTS["kvguard"]["image"] and c["name"] not in ("kvguard-secrets", "witness-key"):
                assert "command" not in c and c["args"][0] in ("serve", "db", "witness"), c["name"]  # the ENTRYPOINT


def test_image_data_volume_belongs_to_the_service_user():
    """Docker creates a VOLUME's mount point root-owned unless the image holds the folder: the
    service user could not write its database and keys there."""
    final = _final_stage()
    user = re.search(r"^USER (\S+)", final, re.M).group(1)
    for folder in json.loads(re.search(r"^VOLUME (\[.*\])", final, re.M).group(1)):
        made = re.search(rf"^RUN .*install -d -o {user} .*-m 0?700 {re.escape(folder)}\b", final, re.M)
        assert made and made.start() < final.index("\nVOLUME "), f"{folder} is not made {user}'s before VOLUME"


@pytest.mark.parametrize("deployment", DEPLOYMENTS)
def test_the_inference_container_runs_serve_llm_beside_the_sidecar(deployment):
    inference = pod_of(DEPLOYMENTS[deployment]())["containers"][0]
    assert inference["args"][0] == "kvguard"
    args = build_parser().parse_args(inference["args"][1:])
    assert args.command == "serve-llm"
    assert [p["containerPort"] for p in inference["ports"]] == [int(inference["args"][-1])]
    assert env_of(inference)["KVGUARD_SOCKET"] == "/run/kvguard/ingest.sock"


@pytest.mark.parametrize("deployment", DEPLOYMENTS)
def test_the_fleet_settings_reach_the_sidecar_and_are_accepted(deployment):
    from kvguard.sidecar.settings import Settings

    env = env_of(sidecar_of(pod_of(DEPLOYMENTS[deployment]())))
    fleet = {k: env[k] for k in ("KVGUARD_FLEET_HEARTBEAT_S", "KVGUARD_FLEET_DEADLINE_S",
                                 "KVGUARD_MAX_CONCURRENT_ERASURES")}
    s = Settings(fleet_heartbeat_s=fleet["KVGUARD_FLEET_HEARTBEAT_S"],
                 fleet_deadline_s=fleet["KVGUARD_FLEET_DEADLINE_S"],
                 max_concurrent_erasures=fleet["KVGUARD_MAX_CONCURRENT_ERASURES"])
    assert (s.fleet_heartbeat_s, s.fleet_deadline_s, s.max_concurrent_erasures) == (5.0, 30.0, 32)


def test_the_witness_manifest_runs_a_command_that_exists():
    from kvguard.cli import build_parser

    docs = list(yaml.safe_load_all((ROOT / "deploy/k8s/witness.yaml").read_text()))
    [container] = docs[0]["spec"]["template"]["spec"]["containers"]
    args = build_parser().parse_args(container["args"])
    assert (args.command, args.witness_command, args.port) == ("witness", "serve", 8471)
    origin, _, key = args.log[0].partition("=")
    assert origin.endswith("*") and key.startswith("/etc/witness/logs/")
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert {"/etc/witness/key", "/etc/witness/logs", "/var/lib/witness"} <= mounts
    for doc in docs:
        for version in KUBE_VERSIONS:
            kubernetes_validate.validate(doc, version, strict=True)
