"""Build Settings from four layers, highest first: CLI flags > LOCALSERVE_* environment >
a TOML file (--config) > defaults. Every value is coerced to its field's type here, and a bad
one is reported with where it came from (flag, variable or file key) and what was expected."""

from __future__ import annotations

import dataclasses
import os
import tomllib
from typing import Any, Mapping

from localserve.config import Settings, SettingsError

ENV_PREFIX = "LOCALSERVE_"
FIELDS = {f.name: f for f in dataclasses.fields(Settings)}
TRUE, FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off"}


def _expect(annotation: str) -> str:
    return annotation.replace(" | None", "")


def coerce(name: str, value: Any, source: str) -> Any:
    """Turn a raw value (string from the environment, TOML value, CLI value) into the type the
    Settings field declares; raise SettingsError naming the source on failure."""
    kind = _expect(FIELDS[name].type)
    optional = "None" in FIELDS[name].type
    if isinstance(value, str) and optional and value.strip().lower() in ("", "none"):
        return None
    try:
        if kind == "bool":
            if isinstance(value, bool):
                return value
            text = str(value).strip().lower()
            if text in TRUE | FALSE:
                return text in TRUE
            raise ValueError
        if kind == "int":
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            return int(value)
        if kind == "float":
            return float(value)
        if kind == "str":
            if not isinstance(value, str):
                raise ValueError
            return value
        if kind.startswith("tuple["):
            items = value.split(",") if isinstance(value, str) else list(value)
            item_type = float if "float" in kind else str
            return tuple(item_type(str(x).strip() if item_type is float else x) for x in items
                         if str(x).strip())
    except (TypeError, ValueError):
        pass
    raise SettingsError(f"{source}={value!r}: expected {_describe(kind)}")


def _describe(kind: str) -> str:
    return {"int": "a whole number", "float": "a number", "bool": "true or false", "str": "text",
            "tuple[str, ...]": "a list of text (comma-separated)",
            "tuple[float, ...]": "a list of numbers (comma-separated)"}.get(kind, kind)


def from_toml(path: str) -> dict:
    try:
        with open(path, "rb") as fh:
            data = tomllib.load(fh)
    except FileNotFoundError:
        raise SettingsError(f"--config {path}: no such file")
    except tomllib.TOMLDecodeError as exc:
        raise SettingsError(f"--config {path}: not valid TOML ({exc})")
    section = data.get("server", data)  # keys at top level or under [server]
    out = {}
    for key, value in section.items():
        name = key.replace("-", "_")
        if name not in FIELDS:
            raise SettingsError(f"{path}: unknown setting '{key}' (known: {', '.join(sorted(FIELDS))})")
        out[name] = coerce(name, value, f"{path}: {key}")
    return out


def from_env(environ: Mapping[str, str]) -> dict:
    out = {}
    for name in FIELDS:
        var = ENV_PREFIX + name.upper()
        if var in environ:
            out[name] = coerce(name, environ[var], var)
    return out


def load_settings(cli: Mapping[str, Any], environ: Mapping[str, str] | None = None,
                  config_path: str | None = None) -> Settings:
    """cli: only the flags the user actually gave (argparse.SUPPRESS defaults), by field name."""
    environ = os.environ if environ is None else environ
    config_path = config_path or environ.get(ENV_PREFIX + "CONFIG")
    values: dict = {}
    if config_path:
        values.update(from_toml(config_path))
    values.update(from_env(environ))
    for name, value in cli.items():
        if name in FIELDS:
            values[name] = coerce(name, value, "--" + name.replace("_", "-"))
    return Settings(**values).validate()
