"""The deployment files name only settings that exist, and the manifests parse."""

from __future__ import annotations

import re
from pathlib import Path

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
    key_volume = next(v for v in pod["volumes"] if v["name"] == "kvguard-key")
    assert key_volume["secret"]["defaultMode"] == 0o400  # the loader refuses keys others can read


def test_environment_variables_are_real_settings():
    fields = {f"KVGUARD_{name.upper()}" for name in Settings.model_fields}
    for path in [*(ROOT / "deploy").rglob("*.yaml"), ROOT / "deploy/Dockerfile"]:
        for var in set(re.findall(r"KVGUARD_[A-Z_]+", path.read_text())):
            assert var in fields | CLIENT_SIDE | {"KVGUARD_BEHIND_TLS_PROXY"}, f"{path.name}: {var} is no setting"
