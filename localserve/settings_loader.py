"""Build Settings from four layers, highest first: CLI flags > LOCALSERVE_* environment >
a TOML file (--config) > defaults. Every value is coerced to its field's type here, and a bad
one is reported with where it came from (flag, variable or file key) and what was expected.

Names: a setting's environment variable and TOML key are its long flag, e.g. --ctx-size is
LOCALSERVE_CTX_SIZE and `ctx_size` (or `ctx-size`); repeatable flags take the plural too
(--api-key: LOCALSERVE_API_KEY or LOCALSERVE_API_KEYS). An unknown LOCALSERVE_* variable or
TOML key stops start-up naming the closest valid one: a misspelt key must never leave the
server open."""

from __future__ import annotations

import dataclasses
import difflib
import os
import tomllib
from typing import Any, Mapping

from localserve.common.config import Settings, SettingsError
from localserve.options import flag_names

ENV_PREFIX = "LOCALSERVE_"
FIELDS = {f.name: f for f in dataclasses.fields(Settings)}
TRUE, FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off"}
# Flag names that differ from their field's name (flag-derived spelling -> field).
ALIASES = flag_names()
# The TOML; scripts/setup's venv and its RPC build switch; the soak test's length.
NOT_SETTINGS = {"CONFIG", "VENV", "RPC", "SOAK_S"}


def field_name(key: str) -> str | None:
    """The Settings field a flag-style or field-style name means, or None."""
    name = key.strip().lower().replace("-", "_")
    name = ALIASES.get(name, name)
    return name if name in FIELDS else None


def _unknown(what: str, shown: str, bare: str, spell) -> SettingsError:
    known = sorted(set(FIELDS) | set(ALIASES))
    close = difflib.get_close_matches(bare.lower().replace("-", "_"), known, n=1, cutoff=0.6)
    hint = (f"; did you mean {spell(close[0])}?" if close
            else f" (known: {', '.join(spell(n) for n in known)})")
    return SettingsError(f"unknown {what} {shown}{hint}")


def _expect(annotation: str) -> str:
    return annotation.replace(" | None", "")


def coerce(name: str, value: Any, source: str) -> Any:
    """Turn a raw value (string from the environment, TOML value, CLI value) into the type the
    Settings field declares; raise SettingsError naming the source on failure."""
    kind = _expect(FIELDS[name].type)
    optional = "None" in FIELDS[name].type
    if optional and (value is None or isinstance(value, str)
                     and value.strip().lower() in ("", "none")):
        return None  # -n -1 and the like: "no limit"
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
    section = dict(data.get("server", data))  # keys at top level or under [server]
    out = {}
    tables = data.get("quotas", section.pop("quotas", {}))
    section.pop("quotas", None)
    if tables:
        from localserve.office.quotas import parse_quotas

        out["quotas"] = parse_quotas(tables, path)
    models = data.get("models", section.pop("models", {}))
    section.pop("models", None)
    if models:
        from localserve.models.model_specs import parse_model_tables

        out["models"] = parse_model_tables(models, path)
    for key, value in section.items():
        name = field_name(key)
        if name is None:
            raise _unknown("setting", f"'{key}' in {path}", key, lambda n: n)
        out[name] = coerce(name, value, f"{path}: {key}")
    return out


def from_env(environ: Mapping[str, str]) -> dict:
    out = {}
    for var, value in environ.items():
        if not var.startswith(ENV_PREFIX) or var[len(ENV_PREFIX):] in NOT_SETTINGS:
            continue
        name = field_name(var[len(ENV_PREFIX):])
        if name is None:
            raise _unknown("environment variable", var, var[len(ENV_PREFIX):],
                           lambda n: ENV_PREFIX + n.upper())
        out[name] = coerce(name, value, var)
    return out


def load_settings(cli: Mapping[str, Any], environ: Mapping[str, str] | None = None,
                  config_path: str | None = None) -> Settings:
    """cli: only the flags the user actually gave (argparse.SUPPRESS defaults), by field name."""
    environ = os.environ if environ is None else environ
    config_path = config_path or environ.get(ENV_PREFIX + "CONFIG")
    values: dict = {}
    if config_path:
        values.update(from_toml(config_path))
        values["config"] = config_path
    values.update(from_env(environ))
    for name, value in cli.items():
        if name == "models":  # --model NAME=PATH adds to (or replaces) the TOML's [models.*]
            values["models"] = {**values.get("models", {}), **value}
        elif name in FIELDS:
            values[name] = coerce(name, value, "--" + name.replace("_", "-"))
    return Settings(**values).validate()
