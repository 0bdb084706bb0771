"""Replicas behind LiteLLM's proxy (scripts/replicas-demo's driver). LiteLLM is large, so it
is not part of the test extras: this runs where scripts/replicas-demo has installed it into
.venv-litellm, and skips with that reason elsewhere (its output is quoted in the README)."""

import subprocess
import sys

import pytest

from conftest import ROOT

LITELLM = ROOT / ".venv-litellm" / "bin" / "litellm"


@pytest.mark.skipif(not LITELLM.exists(), reason="LiteLLM not installed: run scripts/replicas-demo once")
def test_two_replicas_behind_the_proxy_spread_drain_and_fail_over():
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "replicas_demo.py"),
                          "--litellm", str(LITELLM)], capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "16/16 succeeded" in run.stdout and "5xx seen by clients: 0" in run.stdout
    assert "every request of the second wave answered: True" in run.stdout
