"""TLS built in (issue 81): --ssl-key-file and --ssl-cert-file as llama-server spells them. With a
self-signed certificate made here, the API answers over HTTPS to a client that trusts it (the
official OpenAI client too), plain HTTP to the same port gets no answer, the log's addresses say
https, and a key or certificate that cannot be used stops the start naming them."""

from __future__ import annotations

import ssl
import subprocess
import sys

import httpx
import pytest

from conftest import ROOT, RunningServer, free_port, wait_for


@pytest.fixture(scope="module")
def certificate(tmp_path_factory) -> tuple[str, str]:
    folder = tmp_path_factory.mktemp("tls")
    key, cert = folder / "key.pem", folder / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-keyout", str(key), "-out", str(cert), "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True)
    return str(key), str(cert)


def test_the_api_answers_over_https_and_plain_http_gets_nothing(certificate):
    key, cert = certificate
    trust = ssl.create_default_context(cafile=cert)
    srv = RunningServer("-c", "1024", "-np", "1", "-t", "2", "--api-key", "office-key-0123456789",
                        "--ssl-key-file", key, "--ssl-cert-file", cert, log_name="tls")
    https = f"https://127.0.0.1:{srv.port}"
    auth = {"Authorization": "Bearer office-key-0123456789"}

    def ready() -> bool:
        assert srv.proc.poll() is None, srv.log()
        try:
            return httpx.get(https + "/health", verify=trust, timeout=2).status_code == 200
        except httpx.HTTPError:
            return False
    try:
        wait_for(ready, 120, "the server over HTTPS", interval=0.2)
        assert httpx.get(https + "/v1/models", headers=auth, verify=trust).status_code == 200
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://127.0.0.1:{srv.port}/v1/models", headers=auth, timeout=5)
        from openai import OpenAI

        client = OpenAI(base_url=https + "/v1", api_key="office-key-0123456789",
                        http_client=httpx.Client(verify=trust))
        answer = client.chat.completions.create(model="m", max_tokens=4, messages=[
            {"role": "user", "content": "Hi"}])
        assert answer.choices[0].message.content is not None
        assert f"listening on https://127.0.0.1:{srv.port}/v1" in srv.log()
    finally:
        srv.stop()


@pytest.mark.parametrize("flags, says", [
    (["--ssl-key-file", "KEY"], "goes with --ssl-cert-file: give both, or neither"),
    (["--ssl-key-file", "KEY", "--ssl-cert-file", "KEY"], "cannot be used"),
])
def test_a_key_without_its_certificate_or_a_wrong_file_stops_the_start(certificate, flags, says):
    key, _ = certificate
    started = subprocess.run([sys.executable, "-m", "localserve", "up", "--port", str(free_port()),
                              *[key if f == "KEY" else f for f in flags]],
                             capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert started.returncode == 2 and says in started.stderr, started.stderr[-400:]
