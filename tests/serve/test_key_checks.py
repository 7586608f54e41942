"""Key checks against a sidecar that answers slowly and refuses more than a few questions at once:
a burst with one key asks once and meets no 503; a key in use is asked again in the background;
a revocation ends it once the sidecar's answer arrives."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import httpx
import pytest

from kvguard.serve.app import create_app
from kvguard.serve.keys import KeyChecker, KeyError_

TOKEN = "kvg_YWNtZQ.secret"


class Sidecar:
    """/internal/v1/keys/check, 20 ms an answer, 503 past 4 questions at once (an overloaded one)."""

    def __init__(self):
        self.asked, self.now, self.most, self.revoked = 0, 0, 0, False

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        self.asked += 1
        self.now += 1
        self.most = max(self.most, self.now)
        try:
            await asyncio.sleep(0.02)
            if self.now > 4:
                return httpx.Response(503)
            if self.revoked:
                return httpx.Response(404)
            return httpx.Response(200, json={"id": "k1", "scopes": ["infer"], "tenant": "acme"})
        finally:
            self.now -= 1


def checker(sidecar: Sidecar, **ttl) -> KeyChecker:
    keys = KeyChecker(token="kvg_ingest", url="http://sidecar", **ttl)
    keys._http = httpx.AsyncClient(base_url="http://sidecar", transport=httpx.MockTransport(sidecar))
    return keys


def expire(keys: KeyChecker, by: float) -> None:
    keys._known = {d: (t - by, k) for d, (t, k) in keys._known.items()}


def test_a_burst_of_64_requests_after_the_answer_expired_asks_once_and_meets_no_503():
    sidecar = Sidecar()
    keys = checker(sidecar)
    engine = SimpleNamespace(tokenizer=object(), max_model_len=128)  # /v1/models needs no model
    app = create_app(engine, keys, model_name="m", policy_name="none")

    async def burst() -> list[int]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://llm") as http:
            get = lambda: http.get("/v1/models", headers={"Authorization": f"Bearer {TOKEN}"})  # noqa: E731
            assert (await get()).status_code == 200
            expire(keys, keys.stale_s + 1)  # past the time a valid key is accepted unasked
            codes = [r.status_code for r in await asyncio.gather(*(get() for _ in range(64)))]
            return codes

    codes = asyncio.run(burst())
    assert codes == [200] * 64 and sidecar.asked == 2 and sidecar.most == 1 and keys.questions == 2


def test_a_key_in_use_is_asked_again_in_the_background_and_a_revocation_ends_it():
    sidecar = Sidecar()
    keys = checker(sidecar, ttl_s=5.0, stale_s=30.0)

    async def run() -> None:
        assert (await keys.check(TOKEN)).tenant == "acme"
        expire(keys, 10)  # old, within stale_s: accepted at once, one question in the background
        await asyncio.gather(*(keys.check(TOKEN) for _ in range(64)))
        assert len(keys._asking) == 1  # none waited for it
        await asyncio.sleep(0.05)  # it answered: still valid
        assert sidecar.asked == 2
        sidecar.revoked = True
        expire(keys, 10)
        await keys.check(TOKEN)  # accepted: the last answer said valid; this one asks again
        await asyncio.sleep(0.05)  # that answer says revoked
        with pytest.raises(KeyError_) as e:
            await keys.check(TOKEN)
        assert e.value.status == 401 and sidecar.asked == 3
        expire(keys, 60)  # an unknown key is asked again once its answer is old
        with pytest.raises(KeyError_):
            await keys.check(TOKEN)
        assert sidecar.asked == 4

    asyncio.run(run())


def test_an_unreachable_sidecar_fails_only_keys_it_never_vouched_for_recently():
    sidecar = Sidecar()
    keys = checker(sidecar)

    async def run() -> None:
        await keys.check(TOKEN)
        sidecar.now = 10  # every answer now 503
        expire(keys, 10)
        assert (await keys.check(TOKEN)).tenant == "acme"  # within stale_s
        await asyncio.sleep(0.05)
        expire(keys, 31)
        with pytest.raises(KeyError_) as e:
            await keys.check(TOKEN)
        assert e.value.status == 503

    asyncio.run(run())
