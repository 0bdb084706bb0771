"""The service example starts as shipped: its ExecStart line, run with a home nobody can write
(as under ProtectHome=true), serves; a state folder that cannot be made is named as such;
SIGHUP rereads quotas; `localserve usage` names the ledger it read."""

import shlex
import signal
import subprocess
import sys
from pathlib import Path

import httpx

from conftest import ROOT, RunningServer, free_port, key_file, wait_for
from localserve.common.config import resolve_model

UNIT = ROOT / "examples" / "localserve.service"
UNWRITABLE = "/proc/localserve-home"  # not even root can make folders there


def exec_start() -> list[str]:
    text = UNIT.read_text().replace("\\\n", " ")
    line = next(line for line in text.splitlines() if line.startswith("ExecStart="))
    return shlex.split(line.removeprefix("ExecStart="))


def shipped_args(tmp_path, **overrides) -> list[str]:
    """The unit's arguments with its paths mapped into tmp_path (and loopback, a free port)."""
    keys = key_file(tmp_path, "alice:alice-key-0123456789:admin")
    config = tmp_path / "office.toml"
    config.write_text("[quotas.alice]\ntokens_per_day = 100000\n")
    mapping = {"/etc/localserve/keys.txt": str(keys), "/etc/localserve/office.toml": str(config),
               "/var/lib/localserve": str(tmp_path / "state"),
               "/opt/localserve/models/model.gguf": str(resolve_model(None)),
               "0.0.0.0": "127.0.0.1", **overrides}
    args = exec_start()
    assert args[:2] == ["/opt/localserve/.venv/bin/localserve", "up"]
    args = [mapping.get(a, a) for a in args[2:]]
    i = args.index("--port")
    del args[i:i + 2]  # RunningServer adds a free port
    return args + ["-c", "1024", "-np", "1", "-t", "2"]


def test_the_unit_serves_as_shipped_with_an_unwritable_home(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", UNWRITABLE)
    monkeypatch.delenv("XDG_DATA_HOME", raising=False)
    assert "ExecReload=/bin/kill -HUP $MAINPID" in UNIT.read_text()
    srv = RunningServer(*shipped_args(tmp_path), log_name="service")
    try:
        srv.wait_ready()
        r = httpx.post(srv.url + "/v1/chat/completions", timeout=120,
                       headers={"Authorization": "Bearer alice-key-0123456789"},
                       json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
        assert r.status_code == 200, r.text
        log = srv.log()
        assert f"state folder: {tmp_path / 'state'}" in log
        assert "keys: 1 loaded, 1 admin (alice)" in log and "quota [alice]" in log
        assert "chat page: http://localhost:" in log
    finally:
        srv.stop()


def test_a_state_folder_that_cannot_be_made_is_named_before_loading(tmp_path):
    run = subprocess.run([sys.executable, "-m", "localserve", "up", "--port", str(free_port()),
                          "--state-dir",
                          UNWRITABLE + "/state"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 2
    assert f"the state folder {UNWRITABLE}/state cannot be created or written" in run.stderr
    assert "--state-dir" in run.stderr and "could not load the model" not in run.stderr


def test_state_directory_from_systemd_is_the_default(tmp_path, monkeypatch):
    from localserve.office.ledger import default_state_dir

    monkeypatch.setenv("STATE_DIRECTORY", f"{tmp_path}/a:{tmp_path}/b")
    assert default_state_dir() == tmp_path / "a"
    monkeypatch.delenv("STATE_DIRECTORY")
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    assert default_state_dir() == tmp_path / "localserve"


def test_sighup_rereads_quotas_and_usage_names_its_ledger(tmp_path):
    srv = RunningServer(*shipped_args(tmp_path), log_name="sighup-quota")
    key = {"Authorization": "Bearer alice-key-0123456789"}
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    try:
        srv.wait_ready()
        assert httpx.post(srv.url + "/v1/chat/completions", json=body, headers=key,
                          timeout=120).status_code == 200
        (tmp_path / "office.toml").write_text("[quotas.alice]\ntokens_per_day = 1\n")
        srv.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: "SIGHUP: quota [alice] tokens_per_day = 1\n" in srv.log(),
                 what="the quota reload, as the TOML says it")
        r = httpx.post(srv.url + "/v1/chat/completions", json=body, headers=key, timeout=120)
        assert r.status_code == 429 and r.json()["error"]["param"] == "tokens_per_day"
    finally:
        srv.stop()
    run = subprocess.run([sys.executable, "-m", "localserve", "usage", "--state-dir",
                          str(tmp_path / "state")], cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 0 and f"ledger: {tmp_path / 'state' / 'ledger.db'}" in run.stderr


def test_the_readmes_office_toml_loads_as_shown(tmp_path):
    """The five-minute section's settings file is valid: every key known, quotas parsed."""
    import re

    from localserve.common.config import default_model_path, resolve_model
    from localserve.settings_loader import load_settings

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    section = readme.split("## Serve your team in five minutes", 1)[1]
    toml = re.search(r"```toml\n(.*?)```", section, re.S).group(1)
    toml = re.sub(r"(?m)^\s+", "", toml)  # the block is indented inside a list item
    (tmp_path / "office.toml").write_text(toml)
    settings = load_settings({}, environ={}, config_path=str(tmp_path / "office.toml"))
    assert settings.host == "0.0.0.0" and settings.parallel == 8
    assert set(settings.models) == {"chat", "coder"} and set(settings.quotas) == {"default", "bob"}
    assert all(resolve_model(m["path"]) == default_model_path() for m in settings.models.values())
