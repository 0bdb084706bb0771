"""LiteLLM's proxy in front of localserve, with an `ollama_chat/` entry (LiteLLM's async
transport labels its JSON body application/octet-stream) and an `openai/` entry, each asked
whole and streamed through the proxy by the official `openai` client. LiteLLM is large, so it
is not part of the test extras: this runs where .venv-litellm has it (scripts/replicas-demo
installs it) and skips with that reason elsewhere."""

import os
import subprocess

import openai
import pytest

from conftest import ROOT, answers_200, free_port, ledger_rows, running, wait_for

LITELLM = ROOT / ".venv-litellm" / "bin" / "litellm"
pytestmark = pytest.mark.skipif(not LITELLM.exists(),
                                reason="LiteLLM not installed: run scripts/replicas-demo once")
MASTER_KEY = "sk-office-proxy-0001"


def proxy_config(server_url: str) -> str:
    return f"""model_list:
  - model_name: via-ollama
    litellm_params:
      model: ollama_chat/any
      api_base: {server_url}
  - model_name: via-openai
    litellm_params:
      model: openai/any
      api_base: {server_url}/v1
      api_key: none
litellm_settings:
  drop_params: false
general_settings:
  master_key: os.environ/LITELLM_MASTER_KEY
"""


@pytest.fixture(scope="module")
def proxy(tmp_path_factory):
    folder = tmp_path_factory.mktemp("litellm")
    with running("-c", "4096", "-np", "2", "-t", "2", "--state-dir", str(folder / "state"),
                 log_name="litellm-localserve") as server:
        config = folder / "litellm.yaml"
        config.write_text(proxy_config(server.url))
        port = free_port()
        log = open(folder / "litellm.log", "w")
        process = subprocess.Popen([str(LITELLM), "--config", str(config), "--host", "127.0.0.1",
                                    "--port", str(port)], stdout=log, stderr=subprocess.STDOUT,
                                   env={**os.environ, "LITELLM_MASTER_KEY": MASTER_KEY})
        url = f"http://127.0.0.1:{port}"
        try:
            wait_for(lambda: answers_200(url + "/health/liveliness"), timeout=300, interval=1,
                     what="LiteLLM's proxy to start")
            yield url, folder / "state"
        finally:
            process.terminate()
            process.wait(timeout=60)
            log.close()


@pytest.mark.parametrize("model, route", [("via-ollama", "/api/chat"),
                                          ("via-openai", "/v1/chat/completions")])
def test_the_proxy_answers_whole_and_streamed_through_each_api(proxy, model, route):
    url, state = proxy
    client = openai.OpenAI(base_url=url, api_key=MASTER_KEY, max_retries=0, timeout=300)
    ask = {"model": model, "max_tokens": 8, "temperature": 0,
           "messages": [{"role": "user", "content": "Name a colour."}]}
    whole = client.chat.completions.create(**ask)
    assert whole.choices[0].message.content
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in
                       client.chat.completions.create(**ask, stream=True) if chunk.choices)
    assert streamed
    wait_for(lambda: len(ledger_rows(state, route)) >= 2, timeout=60,
             what=f"both requests billed through {route}")
