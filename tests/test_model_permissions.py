"""Which models a key may use (the key file's `:models=a,b`): every route that names a model
refuses the others with a 403 that says what the key may use, the catalogs list only those,
and a colleague of a trusted frontend gets the frontend key's models. The real server, with two
names for the embedded model and an embedding one, as an office with a big and a small model."""

import httpx
import pytest

from conftest import key_file, running
from localserve.common.config import Settings, default_model_path
from localserve.office.office import Office

INTERN, ROOT, WEBUI = "intern-key-0001", "root-key-000002", "webui-key-00003"
SMALL = {"model": "small", "max_tokens": 2}


@pytest.fixture(scope="module")
def office(tmp_path_factory):
    folder = tmp_path_factory.mktemp("permissions")
    path = default_model_path()
    config = folder / "models.toml"
    config.write_text(f"""
max_loaded_models = 2
[models.small]
path = "{path}"
ctx_size = 1024
parallel = 1
[models.big]
path = "{path}"
ctx_size = 2048
parallel = 1
[models.vectors]
path = "{path}"
kind = "embedding"
ctx_size = 512
parallel = 1
""")
    keys = key_file(folder, f"intern:{INTERN}:models=small", f"root:{ROOT}:admin",
                    f"webui:{WEBUI}:user:models=small")
    with running("--config", str(config), "-t", "2", "--api-key-file", str(keys),
                 "--trust-user-header", "webui", log_name="permissions") as srv:
        yield srv


def ask(srv, key, path, body, **headers):
    return httpx.post(srv.url + path, json=body, timeout=120,
                      headers={"Authorization": f"Bearer {key}", **headers})


def get(srv, key, path):
    return httpx.get(srv.url + path, headers={"Authorization": f"Bearer {key}"}, timeout=30)


CHAT = {"messages": [{"role": "user", "content": "hi"}]}
ROUTES = [  # (path, body) of every route that runs a model, the model left to add
    ("/v1/chat/completions", CHAT), ("/v1/completions", {"prompt": "hi"}),
    ("/v1/messages", CHAT), ("/v1/responses", {"input": "hi"}),
    ("/completion", {"prompt": "hi", "n_predict": 2}), ("/tokenize", {"content": "hi"}),
    ("/apply-template", CHAT), ("/api/chat", {**CHAT, "stream": False}),
    ("/api/generate", {"prompt": "hi", "stream": False}),
    ("/api/generate", {"keep_alive": -1}),  # Ollama's load call: no prompt
    ("/v1/embeddings", {"input": "hi"}), ("/api/embed", {"input": "hi"}),
    ("/api/show", {}), ("/v1/rerank", {"query": "a", "documents": ["b"]}),
]


@pytest.mark.parametrize("path,body", ROUTES, ids=[f"{p}{'-load' if 'keep_alive' in b else ''}"
                                                   for p, b in ROUTES])
def test_a_limited_key_gets_a_403_naming_its_models_on_every_route(office, path, body):
    for model in ("big", "vectors"):
        r = ask(office, INTERN, path, {**body, "model": model, "max_tokens": 2})
        assert r.status_code == 403, (model, r.text)
        said = r.text  # in each API's error shape
        assert "'small'" not in said and "use small" in said, said
        if path.startswith("/v1/") and path != "/v1/messages":
            assert r.json()["error"]["code"] == "model_not_permitted"


def test_a_limited_key_uses_its_model_and_an_unlimited_key_every_model(office):
    assert ask(office, INTERN, "/v1/chat/completions", {**CHAT, **SMALL}).status_code == 200
    for model in ("small", "big"):
        r = ask(office, ROOT, "/v1/chat/completions", {**CHAT, **SMALL, "model": model})
        assert r.status_code == 200, r.text


def test_the_catalogs_list_only_the_models_a_key_may_use(office):
    assert [c["id"] for c in get(office, INTERN, "/v1/models").json()["data"]] == ["small"]
    assert [m["name"] for m in get(office, INTERN, "/api/tags").json()["models"]] == ["small"]
    assert get(office, INTERN, "/v1/models/big").status_code == 403
    assert get(office, INTERN, "/v1/models/small").status_code == 200
    assert get(office, INTERN, "/slots?model=big").status_code == 403
    everything = [c["id"] for c in get(office, ROOT, "/v1/models").json()["data"]]
    assert everything == ["small", "big", "vectors"]


def test_the_start_up_log_names_the_trusted_frontend_and_each_keys_models(office):
    log = office.log()
    assert "trusted frontend: webui" in log
    assert "key intern may use only: small" in log and "key root may use only" not in log


def test_a_frontends_colleague_has_the_frontend_keys_models(office):
    colleague = {"X-OpenWebUI-User-Email": "alice@office.lan"}
    r = ask(office, WEBUI, "/v1/chat/completions", {**CHAT, **SMALL, "model": "big"},
            **colleague)
    assert r.status_code == 403, r.text
    r = ask(office, WEBUI, "/v1/chat/completions", {**CHAT, **SMALL}, **colleague)
    assert r.status_code == 200, r.text


def test_an_unknown_name_lists_only_what_the_key_may_use(office):
    r = ask(office, INTERN, "/v1/chat/completions", {**CHAT, **SMALL, "model": "gpt-4"})
    assert r.status_code == 404 and "small" in r.text and "big" not in r.text


def test_a_reload_audits_a_change_of_models(tmp_path):
    path = key_file(tmp_path, "alice:alice-key-0001:models=small")
    office = Office(Settings(api_key_file=str(path)))
    audits = []
    office.ledger = type("Audits", (), {"audit": lambda self, *row: audits.append(row)})()
    assert office.keys
    path.write_text("alice:alice-key-0001:models=small,big\n")
    office.reload_keys()
    assert audits == [("models_changed", "alice", "small -> big,small")]
