"""The README's examples run as written against the README's own team set-up: its keys made
by step 1's commands, its office.toml (two models, quotas), and every client example of "The
clients" (curl, OpenAI, Anthropic, Ollama) with alice's key in LOCALSERVE_API_KEY. Only the
address changes: the server listens on loopback and a free port instead of 0.0.0.0:8080."""

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import RunningServer

README = (Path(__file__).resolve().parent.parent / "README.md").read_text()


def blocks(section: str, language: str) -> list[str]:
    text = README.split(section, 1)[1].split("\n## ", 1)[0]
    return [textwrap.dedent(b) for b in re.findall(rf"```{language}\n(.*?)```", text, re.S)]


@pytest.fixture(scope="module")
def team(tmp_path_factory):
    home = tmp_path_factory.mktemp("home")
    step1 = blocks("## Serve your team in five minutes", "bash")[0]
    subprocess.run(["bash", "-euc", step1], env={**os.environ, "HOME": str(home)}, check=True)
    office = home / "office"
    toml = blocks("## Serve your team in five minutes", "toml")[0]
    toml = toml.replace('host = "0.0.0.0"', 'host = "127.0.0.1"')
    (office / "office.toml").write_text(re.sub(r"(?m)^port = \d+.*$", "", toml))
    keys = dict(line.split(":")[:2] for line in (office / "keys.txt").read_text().splitlines())
    server = RunningServer("--config", "office.toml", "-t", "2", log_name="readme-team",
                           cwd=office)
    try:
        yield server.wait_ready(), keys["alice"]
    finally:
        server.stop()


@pytest.fixture(scope="module")
def clients_python(tmp_path_factory):
    """A fresh environment with the clients installed by the README's own command."""
    text = README.split("## The clients", 1)[1].split("\n## ", 1)[0]
    install = re.search(r"`(pip install [^`]+)`", text.replace("\n", " ")).group(1)
    venv = tmp_path_factory.mktemp("clients") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    subprocess.run(["bash", "-euc", f"{venv}/bin/python -m {install}"], check=True, timeout=900,
                   capture_output=True)
    return str(venv / "bin" / "python")


def run_example(team, code: str, language: str, python: str = sys.executable) -> str:
    server, key = team
    code = code.replace("http://127.0.0.1:8080", server.url)
    command = [python, "-c", code] if language == "python" else ["bash", "-euc", code]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "LOCALSERVE_API_KEY": key})
    assert done.returncode == 0, (code, done.stdout, done.stderr)
    return done.stdout


def test_the_clients_examples_run_as_written_on_the_team_server(team, clients_python):
    """In a fresh environment with the clients the README's command installs; each answer
    greedy (the same twice), as the examples ask."""
    shell = blocks("## The clients", "bash")
    python = blocks("## The clients", "python")
    assert len(shell) == 1 and len(python) == 3  # curl; OpenAI, Anthropic, Ollama
    assert '"choices"' in run_example(team, shell[0], "bash")
    for code in python:
        first = run_example(team, code, "python", clients_python)
        assert first.strip() and run_example(team, code, "python", clients_python) == first, code
