"""The chart's pod, started here as the kubelet would start it: Secret files root's with the
fsGroup's read, emptyDirs root's and world-writable, the secrets-copying init container and
then `kvguard serve` as the image's user with the environment Helm rendered, probed on the
metrics port by the rendered httpGet probes; the inference container, as another user in the
fsGroup, reaches the ingest socket. What a schema check cannot see: that kvguard accepts the
files, modes, owners and settings the chart gives it."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx
import pytest
import sqlalchemy as sa
from kvguard.audit.keys import SigningKey
from kvguard.audit.pseudonym import generate_index_key

from tests.sidecar.conftest import PG_ADMIN, free_port
from tests.test_deploy import DEFAULTS, env_of, one, pod_of, render

INFERENCE_UID = 20002  # the inference image's own user: it shares only the pod's fsGroup with kvguard



def _closed_folder() -> Path | None:
    """The first folder above the checkout or the venv that other users cannot enter (e.g. a
    clone inside `mktemp -d`, mode 0700): the containers' users could not import kvguard."""
    for leaf in (Path(__file__).resolve().parent.parent, Path(sys.prefix).resolve()):
        for folder in (leaf, *leaf.parents):
            if not folder.stat().st_mode & 0o001:
                return folder
    return None


pytestmark = [
    pytest.mark.postgres,  # the chart's database is PostgreSQL (the runtime role's URL)
    pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"),
                       reason="runs the pod's containers as their users: needs root and setpriv (CI has both)"),
    pytest.mark.skipif(_closed_folder() is not None,
                       reason=f"runs Python as the containers' users, who cannot enter {_closed_folder()} "
                              "(clone into a folder others can traverse)"),
]


def as_user(uid: int, gid: int, groups: int) -> list[str]:
    return ["setpriv", f"--reuid={uid}", f"--regid={gid}", f"--groups={groups}", "--"]


@pytest.fixture
def scratch_db():
    name = f"kvguard_pod_{uuid.uuid4().hex[:10]}"
    admin = sa.create_engine(PG_ADMIN, isolation_level="AUTOCOMMIT")
    with admin.connect() as c:
        c.execute(sa.text(f'CREATE DATABASE "{name}"'))
    yield f"postgresql+psycopg://postgres@127.0.0.1:5432/{name}"
    with admin.connect() as c:
        c.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        c.execute(sa.text(f'DROP ROLE IF EXISTS "{name}_rt"'))
    admin.dispose()


@pytest.fixture
def root():
    path = Path(tempfile.mkdtemp(prefix="kvguard-pod-"))
    path.chmod(0o755)  # the containers' users walk through it, as through the node's volume folders
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_the_chart_pod_starts_and_passes_its_probes(root, scratch_db):
    pod = pod_of(render("values-production.yaml"))
    fs_group = pod["securityContext"]["fsGroup"]
    copy, sidecar = pod["initContainers"]
    volumes = {v["name"]: v for v in pod["volumes"]}

    # (1) the volumes, as the kubelet makes them: emptyDirs root's, 2777 in the fsGroup; a Secret's
    # files root's in the fsGroup, mode 0440 (defaultMode with the group's read added)
    secrets = {"signing.key": lambda p: SigningKey.generate().save(p), "index.key": generate_index_key,
               "seal.key": generate_index_key, "pgpass": lambda p: Path(p).write_text("127.0.0.1:5432:*:postgres:x\n")}
    for name, v in volumes.items():
        folder = root / name
        folder.mkdir()
        os.chown(folder, 0, fs_group)
        if "emptyDir" in v or "persistentVolumeClaim" in v:  # a fresh volume, writable by the fsGroup
            folder.chmod(0o2777)
            continue
        folder.chmod(0o755)
        for item in v["secret"].get("items") or [{"path": n} for n in ("signing.key", "index.key", "seal.key")]:
            secrets[item["path"]](folder / item["path"])
            os.chown(folder / item["path"], 0, fs_group)
            (folder / item["path"]).chmod(v["secret"]["defaultMode"] | 0o040)

    def local(container: dict, text: str) -> str:
        """The container's paths in `text` (words), as this machine's paths of the volumes mounted there."""
        def one(word: str) -> str:
            for m in container["volumeMounts"]:
                if word == m["mountPath"] or word.startswith(m["mountPath"].rstrip("/") + "/"):
                    return str(root / m["name"]) + word[len(m["mountPath"]):]
            return word
        return " ".join(one(w) for w in text.split(" "))

    # (2) the migration Job, as the owning role (here the superuser), granting a runtime role made for
    # this database; then the operator's admin token, made once before the first install
    owner_env = {**os.environ, "KVGUARD_DATABASE_URL": scratch_db, "KVGUARD_DATA_DIR": str(root / "operator")}
    role = sa.engine.make_url(scratch_db).database + "_rt"
    admin = sa.create_engine(PG_ADMIN, isolation_level="AUTOCOMMIT")
    with admin.connect() as c:
        c.execute(sa.text(f'CREATE ROLE "{role}" LOGIN'))
    admin.dispose()
    [upgrade] = one(render("values-production.yaml"), "Job")["spec"]["template"]["spec"]["containers"]
    job_args = [role if a == DEFAULTS["migrations"]["runtimeRole"] else a for a in upgrade["args"]]
    subprocess.run([sys.executable, "-m", "kvguard", *job_args], env=owner_env, check=True, capture_output=True,
                   timeout=120)
    subprocess.run([sys.executable, "-m", "kvguard", "token", "create", "--scope", "admin", "--name", "operator"],
                   env=owner_env, check=True, capture_output=True, timeout=120)
    runtime_db = sa.engine.make_url(scratch_db).set(username=role).render_as_string(hide_password=False)

    # (3) the init container copies the secrets, as kvguard's user
    uid = copy["securityContext"]["runAsUser"]
    user = as_user(uid, copy["securityContext"]["runAsGroup"], fs_group)
    subprocess.run([*user, *(local(copy, part) for part in copy["command"])], check=True, timeout=30)

    # (4) the sidecar: the image's ENV, then the rendered env; the Secrets' URL and the pod's name
    # filled in, and free ports in place of 8470 and 9470 on this shared machine
    ports = {"KVGUARD_PORT": str(free_port()), "KVGUARD_METRICS_PORT": str(free_port())}
    env = {"PATH": os.environ["PATH"], "KVGUARD_ENVIRONMENT": "production", "KVGUARD_LOG_FORMAT": "json"}
    for name, value in env_of(sidecar).items():
        if isinstance(value, dict):
            value = "llm-inference-5f7c9-q2x4z" if "fieldRef" in value else runtime_db
        env[name] = ports.get(name) or local(sidecar, value)
    user = as_user(sidecar["securityContext"]["runAsUser"], sidecar["securityContext"]["runAsGroup"], fs_group)
    log = root / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([*user, sys.executable, "-m", "kvguard", *sidecar["args"]], env=env, stdout=out,
                                stderr=subprocess.STDOUT)
    try:
        named = {p["name"]: ports["KVGUARD_METRICS_PORT"] for p in sidecar["ports"]}
        startup = sidecar["startupProbe"]
        deadline = time.monotonic() + min(60, startup["periodSeconds"] * startup["failureThreshold"])
        probe = startup["httpGet"]
        url = f"http://127.0.0.1:{named[probe['port']]}{probe['path']}"
        while True:
            assert proc.poll() is None, log.read_text()[-3000:]
            try:
                if httpx.get(url, timeout=startup["timeoutSeconds"]).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the startup probe never passed: " + log.read_text()[-3000:]
            time.sleep(0.3)
        for kind in ("livenessProbe", "readinessProbe"):
            get = sidecar[kind]["httpGet"]
            r = httpx.get(f"http://127.0.0.1:{named[get['port']]}{get['path']}", timeout=sidecar[kind]["timeoutSeconds"])
            assert r.status_code == 200, (kind, r.text)
        # kvguard made its data directory inside the volume, its own and 0700
        data = Path(env["KVGUARD_DATA_DIR"])
        assert (data.stat().st_uid, data.stat().st_mode & 0o777) == (uid, 0o700)

        # (5) the inference container, another user in the fsGroup, reaches the socket (0660)
        inference = pod["containers"][0]
        sock = local(inference, env_of(inference)["KVGUARD_SOCKET"])
        reach = ("import httpx, sys; c = httpx.Client(transport=httpx.HTTPTransport(uds=sys.argv[1])); "
                 "print(c.post('http://sidecar/internal/v1/events', json={}).status_code)")
        r = subprocess.run([*as_user(INFERENCE_UID, INFERENCE_UID, fs_group), sys.executable, "-c", reach, sock],
                           capture_output=True, text=True, timeout=60)
        assert r.stdout.strip() == "401", r.stderr  # connected; the token is what it lacks
    finally:
        proc.send_signal(signal.SIGTERM)  # what the kubelet sends once the inference container has exited
        code = proc.wait(30)
    assert code == 0, log.read_text()[-3000:]
