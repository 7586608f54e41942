"""The daemon's settings: environment (KVGUARD_*) over a YAML file over defaults.

Outside development, insecure configurations are refused at start: see `check_secure`.
"""

from __future__ import annotations

import difflib
import os
import socket
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    YamlConfigSettingsSource,
)

from ..errors import ConfigError


class WitnessTarget(BaseModel):
    """A witness the sidecar submits its checkpoints to: the URL prefix of its add-checkpoint
    endpoint and its public witness key (`kvguard witness keygen` prints it)."""

    model_config = ConfigDict(extra="forbid")
    url: str
    vkey: str

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        if not v.startswith(("http://", "https://")) or len(v) > 2000:
            raise ValueError("a witness url is an http:// or https:// prefix of its add-checkpoint endpoint")
        return v

    @field_validator("vkey")
    @classmethod
    def _vkey(cls, v: str) -> str:
        from kvguard.audit.cosignature import Witness
        from kvguard.audit.errors import KeyFileError

        try:
            Witness.from_vkey(v)
        except KeyFileError as exc:
            raise ValueError(str(exc)) from None
        return v.strip()


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="KVGUARD_", extra="forbid")

    environment: Literal["development", "production"] = "production"
    data_dir: Path = Path("./.data")
    database_url: str | None = None  # default: SQLite in data_dir
    key_file: Path | None = None  # default: data_dir/signing.key
    # Keys that must outlive a pod and be shared by every sidecar of one database:
    # the pseudonyms' index key and the key sealing pending erasure requests.
    index_key_file: Path | None = None  # default: data_dir/index.key
    seal_key_file: Path | None = None  # default: data_dir/seal.key
    # The key-encryption keys wrapping the subjects' pseudonym secrets (audit.keyring): a
    # directory outside the database, shared by every sidecar of the database; rotated
    # every kek_rotation_s, which bounds how long a shredded secret stays readable in WAL
    # and backups (docs/audit-format.md §6).
    kek_dir: Path | None = None  # default: data_dir/kek
    kek_rotation_s: float = Field(default=86_400.0, ge=60)
    origin: str = Field(default_factory=lambda: f"kvguard.local/{socket.gethostname()}")
    host: str = "127.0.0.1"
    # a TLS-terminating proxy is in front: the admin API may then listen beyond loopback
    behind_tls_proxy: bool = False
    port: int = Field(default=8470, ge=0, le=65535)
    # The metrics listener: /metrics, /healthz and /readyz without a token, for Prometheus and the
    # kubelet's httpGet probes, which reach the pod's IP and not its loopback. It serves aggregate
    # figures only (no subject, no token, no detail of a failing check). None: not served.
    metrics_host: str = "0.0.0.0"
    metrics_port: int | None = Field(default=None, ge=1, le=65535)
    ingest_socket: Path | None = None  # Unix socket for inference clients; default data_dir/ingest.sock
    checkpoint_every: int = Field(default=256, ge=1)
    checkpoint_ms: int = Field(default=1000, ge=10)
    # Sign audit records in a child process (audit.signproc), off the service's GIL.
    audit_sign_process: bool = True
    gdpr_deadline_days: int = Field(default=30, ge=1)
    pipl_deadline_hours: int = Field(default=72, ge=1)  # "without undue delay": configurable
    erasure_ack_timeout_s: float = Field(default=30.0, gt=0)
    # An inference process counts as live this long after its last contact; after a start,
    # erasures wait this long for the processes to reconnect.
    inference_live_s: float = Field(default=30.0, gt=0)
    # The fleet (sidecars sharing one database): each heartbeats this often, and one silent for
    # longer than the deadline is down (its erasure parts are named as overdue).
    fleet_heartbeat_s: float = Field(default=5.0, gt=0)
    fleet_deadline_s: float = Field(default=30.0, gt=0)
    # Erasure parts carried out at once by this sidecar (each waits for its processes' answers).
    max_concurrent_erasures: int = Field(default=32, ge=1)
    # The deployment's policy (kvguard/policy/schema.py): its retention.max_age is the retention limit.
    policy_file: Path | None = None
    retention_max_age_s: float | None = Field(default=None, gt=0)  # default: the policy's; None = no limit
    retention_check_s: float = Field(default=60.0, gt=0)
    # Bounds of what a client may make the server hold: request bodies (event batches, and
    # every other route), the time to send a whole request, connections per listener.
    max_body_bytes: int = Field(default=64 * 1024, ge=1024)
    max_ingest_body_bytes: int = Field(default=16 * 1024 * 1024, ge=1024)
    request_read_timeout_s: float = Field(default=10.0, gt=0)
    keep_alive_s: int = Field(default=5, ge=1)
    max_connections: int = Field(default=256, ge=1)
    # Witnesses (C2SP tlog-witness) cosigning each checkpoint, e.g. as JSON in KVGUARD_WITNESSES:
    # [{"url": "https://witness.example/w1", "vkey": "witness.example/w1+1a2b3c4d+BL..."}]
    witnesses: list[WitnessTarget] = []
    witness_timeout_s: float = Field(default=5.0, gt=0)
    witness_refresh_s: float = Field(default=60.0, gt=0)  # re-cosign an idle log's latest checkpoint
    witness_retry_max_s: float = Field(default=60.0, gt=0)  # longest back-off after a failure
    # How often the audit writer re-checks the store it relies on (audit.state): new checkpoint
    # rows, the keys table, every subject secret against the erase records' shred tags
    audit_state_check_s: float = Field(default=60.0, gt=0)
    log_format: Literal["json", "console", "auto"] = "auto"
    log_level: str = "info"

    @classmethod
    def settings_customise_sources(cls, settings_cls: type[BaseSettings], init_settings, env_settings,
                                   dotenv_settings, file_secret_settings) -> tuple[PydanticBaseSettingsSource, ...]:
        yaml_file = os.environ.get("KVGUARD_CONFIG")
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        if yaml_file:
            if not Path(yaml_file).is_file():
                raise ConfigError(f"KVGUARD_CONFIG points to {yaml_file}, which is not a readable file")
            sources.append(YamlConfigSettingsSource(settings_cls, yaml_file=yaml_file))
        return tuple(sources)

    @model_validator(mode="after")
    def _policy(self) -> Settings:
        if self.policy_file is None:
            return self
        from ..policy.schema import load_policy  # no torch: the daemon only reads the retention

        limit = load_policy(self.policy_file).retention.seconds  # PolicyError: file, line and field
        if self.retention_max_age_s is None:
            self.retention_max_age_s = float(limit)
        elif self.retention_max_age_s != limit:
            raise ValueError(f"retention_max_age_s is {self.retention_max_age_s:g} s but the policy "
                             f"{self.policy_file} says {limit} s (retention.max_age): set one of them")
        return self

    @model_validator(mode="after")
    def _ports(self) -> Settings:
        if self.metrics_port is not None and self.metrics_port == self.port:
            raise ValueError(f"metrics_port and port are both {self.port}: the metrics listener needs a port "
                             "of its own")
        return self

    @model_validator(mode="after")
    def _fleet(self) -> Settings:
        if self.fleet_deadline_s <= self.fleet_heartbeat_s:
            raise ValueError(f"fleet_deadline_s ({self.fleet_deadline_s:g}) must be longer than "
                             f"fleet_heartbeat_s ({self.fleet_heartbeat_s:g}), or every sidecar looks down")
        return self

    @field_validator("origin")
    @classmethod
    def _origin(cls, v: str) -> str:
        if not v or any(c.isspace() for c in v) or len(v) > 200:
            raise ValueError("origin must be a non-empty name without whitespace (the log's C2SP origin line)")
        return v

    # --- derived paths ----------------------------------------------------------------------------

    @property
    def db_url(self) -> str:
        return self.database_url or f"sqlite:///{(self.data_dir / 'audit.db').resolve()}"

    @property
    def signing_key_path(self) -> Path:
        return self.key_file or self.data_dir / "signing.key"

    @property
    def index_key_path(self) -> Path:
        return self.index_key_file or self.data_dir / "index.key"

    @property
    def seal_key_path(self) -> Path:
        return self.seal_key_file or self.data_dir / "seal.key"

    @property
    def kek_path(self) -> Path:
        return self.kek_dir or self.data_dir / "kek"

    @property
    def postgres(self) -> bool:
        return self.db_url.startswith("postgresql")

    @property
    def migrates_at_start(self) -> bool:
        """Production on PostgreSQL runs its migrations apart, as the tables' owner
        (`kvguard db upgrade`); development and SQLite migrate when they start."""
        return self.development or not self.postgres

    @property
    def socket_path(self) -> Path:
        return self.ingest_socket or self.data_dir / "ingest.sock"

    @property
    def development(self) -> bool:
        return self.environment == "development"


# KVGUARD_* variables that are not settings of the daemon: the YAML file's path, what the
# inference container and the demo read, the witness's database, the admin token of
# `kvguard keys rotate`, and the Redis URL of the vLLM connector's offload tier
OTHER_VARIABLES = frozenset({"KVGUARD_CONFIG", "KVGUARD_SOCKET", "KVGUARD_INGEST_TOKEN", "KVGUARD_DEMO_KEEP",
                             "KVGUARD_WITNESS_DATABASE_URL", "KVGUARD_ADMIN_TOKEN", "KVGUARD_OFFLOAD_REDIS_URL"})


def check_variables(environ=os.environ) -> None:
    """A misspelt KVGUARD_* variable would be ignored and its setting left at its default:
    refuse it, naming the setting it was probably meant to be."""
    known = {f"KVGUARD_{name.upper()}" for name in Settings.model_fields} | OTHER_VARIABLES
    unknown = sorted(n for n in environ if n.upper().startswith("KVGUARD_") and n.upper() not in known)
    if not unknown:
        return
    problems = []
    for name in unknown:
        near = difflib.get_close_matches(name.upper(), sorted(known), n=1, cutoff=0.6)
        problems.append(f"{name}" + (f" (did you mean {near[0]}?)" if near else ""))
    raise ConfigError("unknown variable(s) " + "; ".join(problems) + ": kvguard reads no such setting "
                      "(the settings are listed in docs/sidecar.md)")


def load_settings(**overrides) -> Settings:
    """Settings from the environment, the YAML file and `overrides`; what is wrong with them is
    a ConfigError naming each setting, without its value (a URL may hold a secret). A KVGUARD_*
    variable that names no setting is an error too."""
    check_variables()
    try:
        return Settings(**overrides)
    except ValidationError as e:
        problems = []
        for err in e.errors():
            name = ".".join(str(p) for p in err["loc"]) or "settings"
            env = f"KVGUARD_{name.upper()}" if err["loc"] else ""
            msg = err["msg"].removeprefix("Value error, ")
            problems.append(f"{name} ({env}): {msg}" if env else f"{name}: {msg}")
        raise ConfigError("invalid settings: " + "; ".join(problems)) from None


def check_secure(settings: Settings, *, tokens_exist: bool) -> None:
    """Refuse to start with an insecure configuration outside development."""
    if settings.development:
        return
    problems = []
    if not tokens_exist:
        problems.append("no admin API token exists: create one with 'kvguard token create --scope admin'")
    if settings.host not in ("127.0.0.1", "::1", "localhost") and not settings.behind_tls_proxy:
        problems.append(f"the admin API would listen on {settings.host} without TLS: bind to loopback behind a "
                        "TLS-terminating proxy and set KVGUARD_BEHIND_TLS_PROXY=1")
    shared_db = bool(settings.database_url and settings.database_url.startswith("postgresql"))
    for path, what, make in ((settings.index_key_path, "index key file", "kvguard keygen --secret"),
                             (settings.seal_key_path, "seal key file", "kvguard keygen --secret"),
                             (settings.kek_path, "key-encryption key directory", "mkdir -m 700")):
        if shared_db and not path.exists():
            problems.append(f"the {what} {path} does not exist: with a shared database every sidecar needs "
                            f"the same one; create it once with '{make} {path}' and mount it")
    if shared_db and _password_in(settings.database_url):
        problems.append("the database password is in the URL: use a PGPASSFILE or a secret-mounted service file")
    if problems:
        raise ConfigError("refusing to start in production: " + "; ".join(problems))


def _password_in(url: str) -> bool:
    """Whether a database URL carries a password: user:password@host or ?password=..."""
    from sqlalchemy.engine import make_url

    parsed = make_url(url)
    return parsed.password is not None or "password" in parsed.query
