"""The deployment files name only settings that exist, and the manifests parse."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from kvguard.sidecar.settings import Settings

ROOT = Path(__file__).resolve().parents[1]
CLIENT_SIDE = {"KVGUARD_SOCKET", "KVGUARD_INGEST_TOKEN"}  # read by the inference container, not the sidecar


def test_manifest_parses_and_wires_the_socket():
    docs = list(yaml.safe_load_all((ROOT / "deploy/k8s/inference-with-kvguard.yaml").read_text()))
    pod = docs[0]["spec"]["template"]["spec"]
    mounts = {c["name"]: {m["name"]: m["mountPath"] for m in c["volumeMounts"]} for c in pod["containers"]}
    assert mounts["inference"]["kvguard-sock"] == mounts["kvguard"]["kvguard-sock"]
    sidecar = next(c for c in pod["containers"] if c["name"] == "kvguard")
    assert sidecar["securityContext"]["readOnlyRootFilesystem"] is True


def test_environment_variables_are_real_settings():
    fields = {f"KVGUARD_{name.upper()}" for name in Settings.model_fields}
    for path in [*(ROOT / "deploy").rglob("*.yaml"), ROOT / "deploy/Dockerfile"]:
        for var in set(re.findall(r"KVGUARD_[A-Z_]+", path.read_text())):
            assert var in fields | CLIENT_SIDE | {"KVGUARD_BEHIND_TLS_PROXY"}, f"{path.name}: {var} is no setting"


def render_chart(release: str = "llm-inference") -> dict:
    """The chart's Deployment as `helm template` renders it with the default values (the few
    template constructs it uses: values, the release name, `if` on a value)."""
    chart = ROOT / "deploy/helm/kvguard"
    values = yaml.safe_load((chart / "values.yaml").read_text())

    def value(path: str):
        v = values
        for part in path.split("."):
            v = v[part]
        return v

    text = (chart / "templates/deployment.yaml").read_text()
    text = re.sub(r"\n[ \t]*\{\{- if \.Values\.([\w.]+) \}\}(.*?)\n[ \t]*\{\{- end \}\}",
                  lambda m: m.group(2) if value(m.group(1)) else "", text, flags=re.S)
    text = text.replace("{{ .Release.Name }}", release)
    text = re.sub(r"\{\{ \.Values\.([\w.]+) \}\}", lambda m: str(value(m.group(1))), text)
    assert "{{" not in text, "a template construct this renderer does not know"
    return yaml.safe_load(text)


DEPLOYMENTS = {"manifest": lambda: next(yaml.safe_load_all((ROOT / "deploy/k8s/inference-with-kvguard.yaml")
                                                         .read_text())),
               "chart": render_chart}


def sidecar_of(pod: dict) -> dict:
    return next(c for c in pod["containers"] if c["name"] == "kvguard")


@pytest.mark.parametrize("deployment", DEPLOYMENTS)
def test_probes_reach_the_admin_api_on_loopback(deployment):
    sidecar = sidecar_of(DEPLOYMENTS[deployment]()["spec"]["template"]["spec"])
    env = {e["name"]: e.get("value") for e in sidecar["env"]}
    host, port = env.get("KVGUARD_HOST", Settings.model_fields["host"].default), env.get("KVGUARD_PORT", "8470")
    assert host in ("127.0.0.1", "::1", "localhost")  # no TLS on the admin API: it never leaves the pod
    for probe, path in (("readinessProbe", "/readyz"), ("livenessProbe", "/healthz")):
        # the kubelet sends httpGet and tcpSocket probes to the pod's IP, which a loopback listener never answers
        assert set(sidecar[probe]) & {"httpGet", "tcpSocket", "grpc"} == set(), f"{probe} cannot reach {host}"
        assert f"http://127.0.0.1:{port}{path}" in " ".join(sidecar[probe]["exec"]["command"])


@pytest.mark.parametrize("deployment", DEPLOYMENTS)
def test_keys_reach_the_sidecar_readable_by_its_user_only(deployment):
    """The kubelet gives a Secret volume's files to root and the pod's fsGroup, adding group read
    to defaultMode when there is one (kubernetes/kubernetes#57923); kvguard refuses a key file
    its group or others can read, and the sidecar runs as neither root nor the file's owner."""
    pod = DEPLOYMENTS[deployment]()["spec"]["template"]["spec"]
    sidecar = sidecar_of(pod)
    uid = sidecar["securityContext"]["runAsUser"]
    env = {e["name"]: e.get("value") for e in sidecar["env"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    for var in ("KVGUARD_KEY_FILE", "KVGUARD_INDEX_KEY_FILE", "KVGUARD_SEAL_KEY_FILE"):
        folder, name = env[var].rsplit("/", 1)
        mount = next(m for m in sidecar["volumeMounts"] if m["mountPath"] == folder)
        assert mount.get("readOnly") is True
        volume = volumes[mount["name"]]
        if "secret" in volume:
            mode = volume["secret"].get("defaultMode", 0o644) | (0o440 if "fsGroup" in pod["securityContext"] else 0)
            readable = bool(mode & 0o004) or (bool(mode & 0o040) and "fsGroup" in pod["securityContext"])
            assert readable and not mode & 0o077, f"{var}: a Secret file of mode {mode:04o} owned by root"
            continue
        # copied out of the Secret into memory by an init container running as the sidecar's user
        assert volume["emptyDir"]["medium"] == "Memory"
        writers = [c for c in pod.get("initContainers", []) if any(m["name"] == mount["name"]
                                                                   for m in c["volumeMounts"])]
        assert len(writers) == 1 and writers[0]["securityContext"]["runAsUser"] == uid
        command = " ".join(writers[0]["command"])
        assert "install -m 0400" in command and f"/{name}" in command and command.rstrip().endswith(folder + "/")
        sources = [volumes[m["name"]] for m in writers[0]["volumeMounts"] if m["name"] != mount["name"]]
        assert [v["secret"]["secretName"] for v in sources] == ["kvguard-signing-key"]


def test_image_data_volume_belongs_to_the_service_user():
    """Docker creates a VOLUME's mount point root-owned unless the image holds the folder: the
    service user could not write its database and keys there."""
    final = (ROOT / "deploy/Dockerfile").read_text().replace("\\\n", " ").rsplit("\nFROM ", 1)[1]
    user = re.search(r"^USER (\S+)", final, re.M).group(1)
    for folder in json.loads(re.search(r"^VOLUME (\[.*\])", final, re.M).group(1)):
        made = re.search(rf"^RUN .*install -d -o {user} .*-m 0?700 {re.escape(folder)}\b", final, re.M)
        assert made and made.start() < final.index("\nVOLUME "), f"{folder} is not made {user}'s before VOLUME"


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
