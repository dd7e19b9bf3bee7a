"""The contributing guide's HTTP API recipe: an API is its package plus one entry in ``app.APIS``.

A toy API (its request and reply models, its route, its own error object) is
mounted beside the three by that one entry, over a real daemon process: its
route runs a real count on the loaded model, it appears in ``/openapi.json``
with its declared replies, and every refusal on its paths (a bad field, a wrong
key, an unknown path) is its own error object, while the other APIs keep theirs.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi import APIRouter
from pydantic import Field
from starlette.testclient import TestClient

from harness.daemon import DaemonProcess
from modeld.front.api import HttpApi
from modeld.front.app import APIS, create_app
from modeld.front.core import Loose, Serving, Shape, TurnRequest, declared, prompt_message
from modeld.front.errors import ApiError
from modeld.front.pool import ClientPool
from modeld.settings import HttpSettings
from runtime.client import Client

KEY = "toy-key"


# --- the toy API: what a package of modeld/front/ holds (protocol, routes, its entry) ---------------------------
class CountIn(Loose):
    model: str
    text: str = Field(min_length=1)


class CountOut(Shape):
    tokens: int


class ToyErrorDetail(Shape):
    status: int
    reason: str


class ToyError(Shape):
    toy_error: ToyErrorDetail


def toy_error(err: ApiError) -> ToyError:
    return ToyError(toy_error=ToyErrorDetail(status=err.status, reason=err.message))


def toy_router(serving: Serving) -> APIRouter:
    r = APIRouter()

    @r.post("/toy/count", response_model=CountOut, responses=declared(CountOut, ToyError))
    async def count(body: CountIn) -> CountOut:
        got = await serving.acount(TurnRequest(messages=[prompt_message(0, role="user", content=body.text)],
                                               model=body.model))
        return CountOut(tokens=got.prompt_tokens)

    return r


TOY = HttpApi(lambda serving, _store: toy_router(serving), ("/toy",), toy_error)


# --- mounted with one entry ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def http(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    tmp: Path = tmp_path_factory.mktemp("toy")
    with DaemonProcess(tmp, "memory", None, "--model", "/models/ref", "--model-name", "ref").start(
        wait_state=("Ready",)
    ) as d:
        pool = ClientPool(lambda: Client(d.endpoint, timeout_s=60))
        serving = Serving(pool, HttpSettings(api_key=KEY, data_dir=tmp / "front"))
        app = create_app(serving, apis=(*APIS, TOY))
        with TestClient(app, headers={"Authorization": f"Bearer {KEY}"}) as client:
            yield client
        pool.close()


def test_a_mounted_api_serves_its_route_on_the_loaded_model(http: TestClient) -> None:
    short = http.post("/toy/count", json={"model": "ref", "text": "hi"})
    long = http.post("/toy/count", json={"model": "ref", "text": "hi " * 50})
    assert short.status_code == long.status_code == 200
    assert 0 < short.json()["tokens"] < long.json()["tokens"]
    spec = http.get("/openapi.json").json()
    declared_statuses = spec["paths"]["/toy/count"]["post"]["responses"]
    assert "200" in declared_statuses and "400" in declared_statuses


@pytest.mark.parametrize("case", ["bad field", "wrong key", "unknown path", "not json"])
def test_every_refusal_on_its_paths_is_its_own_error(http: TestClient, case: str) -> None:
    if case == "bad field":
        r = http.post("/toy/count", json={"model": "ref", "text": ""})
    elif case == "wrong key":
        r = http.post("/toy/count", json={"model": "ref", "text": "hi"}, headers={"Authorization": "Bearer no"})
    elif case == "unknown path":
        r = http.get("/toy/nothing-here")
    else:
        r = http.post("/toy/count", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code in (400, 401, 404)
    body = r.json()
    assert set(body) == {"toy_error"} and body["toy_error"]["status"] == r.status_code and body["toy_error"]["reason"]


def test_the_other_apis_keep_their_own_error_shapes(http: TestClient) -> None:
    anthropic = http.post("/v1/messages", json={"model": "ref"})
    assert anthropic.status_code == 400 and anthropic.json()["type"] == "error"
    openai = http.post("/v1/chat/completions", json={"model": "ref"})
    assert openai.status_code == 400 and openai.json()["error"]["type"] == "invalid_request_error"
    # a path no API owns, and one that only looks like an API's prefix, are answered in OpenAI's shape
    for path in ("/nowhere", "/toybox"):
        r = http.get(path)
        assert r.status_code == 404 and "error" in r.json(), path
