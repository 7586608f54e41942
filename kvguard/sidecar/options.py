"""The options every sidecar command takes (settings file, data directory, database URL) and
the settings they yield: shared by the sidecar's commands (cli.py) and the operator's (dbcli.py)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path


def settings_from(args: argparse.Namespace):
    """The settings, with what the command line gives over the environment and the file."""
    from .settings import load_settings

    if getattr(args, "config", None):
        os.environ["KVGUARD_CONFIG"] = str(args.config)
    overrides = {k: v for k, v in {
        "data_dir": args.data_dir, "database_url": args.database_url,
        "environment": "development" if getattr(args, "dev", False) else None,
        "host": getattr(args, "host", None), "port": getattr(args, "port", None),
    }.items() if v is not None}
    return load_settings(**overrides)


def add_common(p: argparse.ArgumentParser) -> None:
    """The options every sidecar command takes: where its settings, keys and database are."""
    p.add_argument("--config", type=Path, help="YAML settings file (also KVGUARD_CONFIG)")
    p.add_argument("--data-dir", type=Path, help="keys, SQLite database, socket (KVGUARD_DATA_DIR; default ./.data)")
    p.add_argument("--database-url", help="SQLAlchemy URL of the audit store (KVGUARD_DATABASE_URL; "
                                          "default SQLite in the data directory)")
