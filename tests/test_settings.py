"""Settings precedence (CLI > environment > TOML file > defaults) and validation messages."""

import subprocess
import sys

import pytest

from localserve.common.config import Settings, SettingsError
from localserve.server import exposure_warning
from localserve.settings_loader import load_settings


def write(tmp_path, text):
    path = tmp_path / "localserve.toml"
    path.write_text(text)
    return str(path)


def test_precedence_cli_over_env_over_file_over_defaults(tmp_path):
    cfg = write(tmp_path, 'ctx_size = 4096\nparallel = 2\nport = 9000\nhost = "0.0.0.0"\n')
    env = {"LOCALSERVE_CTX_SIZE": "16384", "LOCALSERVE_PARALLEL": "8"}
    s = load_settings({"parallel": 3}, environ=env, config_path=cfg)
    assert s.parallel == 3  # CLI
    assert s.ctx_size == 16384  # environment beats the file
    assert s.port == 9000 and s.host == "0.0.0.0"  # file beats defaults
    assert s.max_queue == Settings().max_queue  # default


def test_config_file_from_environment_and_server_section(tmp_path):
    cfg = write(tmp_path, '[server]\nmax-queue = 5\ncors_origins = ["http://a:1", "http://b:2"]\n')
    s = load_settings({}, environ={"LOCALSERVE_CONFIG": cfg})
    assert s.max_queue == 5 and s.cors_origins == ("http://a:1", "http://b:2")


def test_env_lists_bools_and_none():
    s = load_settings({}, environ={"LOCALSERVE_TENSOR_SPLIT": "3,1", "LOCALSERVE_WEB": "no",
                                   "LOCALSERVE_MAX_QUEUE": "none"})
    assert s.tensor_split == (3.0, 1.0) and s.web is False and s.max_queue is None


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(environ={"LOCALSERVE_CTX_SIZE": "lots"}), "LOCALSERVE_CTX_SIZE='lots': expected a whole number"),
    (dict(cli={"parallel": 0}), "-np/--parallel 0: must be at least 1"),
    (dict(cli={"port": 70000}), "--port 70000"),
    (dict(cli={"ctx_size": 64, "parallel": 8}), "under 16 tokens per slot"),
    (dict(cli={"api_keys": ["short"]}), "at least 8 characters"),
    (dict(cli={"drain_timeout": -1}), "--drain-timeout"),
])
def test_bad_values_name_the_field_and_value(kwargs, fragment):
    with pytest.raises(SettingsError) as info:
        load_settings(kwargs.get("cli", {}), environ=kwargs.get("environ", {}))
    assert fragment in str(info.value)


def test_bad_file_keys_and_types_are_named(tmp_path):
    with pytest.raises(SettingsError, match="unknown setting 'ctx'"):
        load_settings({}, environ={}, config_path=write(tmp_path, "ctx = 5\n"))
    with pytest.raises(SettingsError, match="ctx_size='big': expected a whole number"):
        load_settings({}, environ={}, config_path=write(tmp_path, 'ctx_size = "big"\n'))
    with pytest.raises(SettingsError, match="no such file"):
        load_settings({}, environ={}, config_path=str(tmp_path / "missing.toml"))


def test_exposure_warning_only_off_loopback_without_keys():
    assert exposure_warning(Settings(host="127.0.0.1"), keys_loaded=0) is None
    assert exposure_warning(Settings(host="0.0.0.0"), keys_loaded=1) is None
    text = exposure_warning(Settings(host="0.0.0.0", api_key_file="keys.txt"), keys_loaded=0)
    assert "WITHOUT an API key" in text and "--api-key" in text


def test_models_lists_the_embedded_default_and_files_in_models_dir(tmp_path, monkeypatch):
    import localserve.common.config as config

    monkeypatch.setattr(config, "MODELS_DIR", tmp_path)
    (tmp_path / "mine.gguf").write_bytes(b"GGUF")
    names = [name for name, _ in config.available_models()]
    assert names == ["mine.gguf", "(default, embedded)"]
    assert config.resolve_model("mine.gguf") == (tmp_path / "mine.gguf").resolve()
    with pytest.raises(SettingsError, match="no such file"):
        config.resolve_model("absent.gguf")


def test_a_file_put_in_the_repositorys_models_folder_is_listed_and_resolved():
    """The README's step as written: a GGUF put in models/ (the repository's, beside README.md)
    is listed by `localserve models` and served by `-m NAME.gguf`. No monkeypatching: the
    default folder itself is under test."""
    import os
    import subprocess
    import sys
    import uuid
    from pathlib import Path

    from localserve.common.config import default_model_path, resolve_model

    root = Path(__file__).resolve().parents[1]
    placed = root / "models" / f"test-placed-{uuid.uuid4().hex[:8]}.gguf"
    placed.symlink_to(default_model_path())
    try:
        listing = subprocess.run([sys.executable, "-m", "localserve", "models"], cwd=root,
                                 capture_output=True, text=True, timeout=60,
                                 env={**os.environ, "HOME": str(root / "models")})
        assert placed.name in listing.stdout, listing.stdout + listing.stderr
        assert resolve_model(placed.name) == placed.resolve()
    finally:
        placed.unlink()


def test_every_setting_has_one_flag_whose_help_shows_its_default_and_choices():
    """The CLI is generated from Settings (localserve/options.py): a new field without a flag,
    or a flag naming no field, fails here; defaults and choices are never restated by hand."""
    import dataclasses

    from localserve.cli import build_parser
    from localserve.common.config import CHOICES
    from localserve.options import NOT_FLAGS, OPTIONS

    fields = {f.name: f for f in dataclasses.fields(Settings)}
    assert {o.field for o in OPTIONS} == set(fields) - NOT_FLAGS
    up = build_parser()._subparsers._group_actions[0].choices["up"]
    actions = {a.option_strings[-1]: a for a in up._actions if a.option_strings}
    for option in OPTIONS:
        action = actions[option.flags[-1]]
        assert action.dest == option.field
        assert action.choices == CHOICES.get(option.field)
        default = fields[option.field].default
        if fields[option.field].type not in ("bool",) and default not in (None, (), dataclasses.MISSING):
            assert f"(default: {option.default_text or default})" in action.help, option.long


def test_generated_flags_parse_into_settings():
    from localserve.cli import build_parser, settings_from_args

    args = build_parser().parse_args(
        ["up", "-c", "4096", "-np", "2", "--spec-type", "ngram-mod", "-n", "-1", "--no-web",
         "--api-key", "k" * 12, "--api-key", "j" * 12, "--tensor-split", "3,1",
         "-ctk", "q8_0", "--rate-limit", "2.5"])
    s = settings_from_args(args)
    assert (s.ctx_size, s.parallel, s.spec, s.n_predict, s.web) == \
        (4096, 2, "ngram", None, False)
    assert s.api_keys == ("k" * 12, "j" * 12) and s.tensor_split == (3.0, 1.0)
    assert (s.cache_type_k, s.rate_limit, s.ledger) == ("q8_0", 2.5, True)


def test_a_missing_recommended_file_names_the_pull_that_fetches_it():
    """`localserve up -m Qwen2.5-7B-Instruct-Q4_K_M.gguf` before pulling it: the refusal says
    which `localserve pull` gives exactly that file (a file of no recommended model: no hint)."""
    from localserve.models.model_specs import find_model

    with pytest.raises(SettingsError, match=r"no such file .*`localserve pull qwen2.5-7b` fetches"):
        find_model("Qwen2.5-7B-Instruct-Q4_K_M.gguf")
    with pytest.raises(SettingsError, match=r"no such file \(looked as given and in [^)]*\)$"):
        find_model("absent.gguf")
    refused = subprocess.run([sys.executable, "-m", "localserve", "up", "-m",
                              "Qwen2.5-7B-Instruct-Q4_K_M.gguf", "--port", "1"],
                             capture_output=True, text=True, timeout=120)
    assert refused.returncode != 0 and "localserve pull qwen2.5-7b" in refused.stderr
