"""Infer tokens: bound to one tenant, which they carry; an altered tenant part authenticates nothing."""

from __future__ import annotations

import pytest
from sqlalchemy.orm import Session

from kvguard.errors import ConfigError
from kvguard.sidecar.auth import authenticate, create_token, token_tenant


@pytest.fixture
def db(tmp_path):
    from kvguard.audit.store import make_engine, migrate

    url = f"sqlite:///{tmp_path / 'a.db'}"
    migrate(url)
    engine = make_engine(url)
    with Session(engine) as s:
        yield s
    engine.dispose()


def test_an_infer_token_carries_its_one_tenant(db):
    key = b"k" * 32
    token = create_token(db, "web", ["infer"], tenants=["acme corp/ü"], index_key=key)
    assert token_tenant(token) == "acme corp/ü"
    p = authenticate(db, token)
    assert p is not None and p.scopes == {"infer"} and not p.allows("ingest")
    head, _, secret = token.partition(".")
    forged = "kvg_" + "Z2xvYmV4" + "." + secret  # "globex" with acme's secret
    assert token_tenant(forged) == "globex" and authenticate(db, forged) is None
    admin = create_token(db, "root", ["admin"])
    assert token_tenant(admin) is None and not authenticate(db, admin).allows("infer")
    for scopes, tenants in ((["infer"], None), (["infer"], ["a", "b"]), (["infer", "ingest"], ["a"]),
                            (["infer"], ["x" * 97])):
        with pytest.raises(ConfigError):
            create_token(db, "bad", scopes, tenants=tenants, index_key=key)
    assert token_tenant("kvg_%%%.x") is None and token_tenant("kvg_abc") is None
