"""Which models a server offers: `-m` (the default), `--model NAME=PATH`, `--models-dir DIR` and
`[models.NAME]` tables of the TOML, each with its own slots and cache if it says so."""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from pathlib import Path

from localserve.common.config import Settings, SettingsError, resolve_model

KINDS = ("chat", "embedding")
TABLE_KEYS = {"path", "mmproj", "ctx_size", "parallel", "n_gpu_layers", "n_predict", "kind", "pin",
              "chat_template", "chat_template_file"}
SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)i?b?\s*$", re.IGNORECASE)


def find_model(model: str | None, named: str = "-m/--model") -> Path:
    """resolve_model's file; a missing one that a recommended model's file is named like says
    which `localserve pull NAME` fetches exactly it."""
    try:
        return resolve_model(model, named)
    except SettingsError as exc:
        from localserve.models.pull import RECOMMENDED

        wanted = Path(model or "").name
        pull = next((m.name for m in RECOMMENDED if m.file == wanted), None)
        if pull is None:
            raise
        raise SettingsError(f"{exc}; `localserve pull {pull}` fetches exactly it") from None


@dataclass(frozen=True)
class ModelSpec:
    """One model the server can load: a name clients send as `model`, and what differs from
    the server-wide settings (None: the server's own -c, -np, -ngl)."""

    name: str
    path: str | None  # None: the embedded default model
    ctx_size: int | None = None
    parallel: int | None = None
    n_gpu_layers: int | None = None
    n_predict: int | None = None  # its answers' default max_tokens (the server's -n when None)
    kind: str = "chat"  # "embedding": /v1/embeddings only, chat and completions refused
    pin: bool = False  # never unloaded, by idle time or to make room
    chat_template: str | None = None  # instead of the GGUF's (a built-in name or Jinja)
    chat_template_file: str | None = None
    mmproj: str | None = None  # its projector: images in its chats (runner/images.py)

    def settings(self, server: Settings) -> Settings:
        """The server's settings with this model's file and its own overrides."""
        changes = {"model": self.path, "model_alias": self.name,  # each model its own template
                   "chat_template": self.chat_template, "chat_template_file": self.chat_template_file,
                   "mmproj": self.mmproj}
        for name in ("ctx_size", "parallel", "n_gpu_layers", "n_predict"):
            if getattr(self, name) is not None:
                changes[name] = getattr(self, name)
        return replace(server, **changes).validate()


def parse_model_tables(tables: dict, source: str) -> dict[str, dict]:
    """[models.NAME] tables -> {name: {setting: value}}; unknown keys and kinds are refused."""
    out = {}
    for name, table in tables.items():
        if not isinstance(table, dict) or "path" not in table:
            raise SettingsError(f"{source}: [models.{name}] must be a table with at least path = ...")
        unknown = set(table) - TABLE_KEYS
        if unknown:
            raise SettingsError(f"{source}: [models.{name}] {sorted(unknown)[0]}: unknown key "
                                f"(known: {', '.join(sorted(TABLE_KEYS))})")
        if table.get("kind", "chat") not in KINDS:
            raise SettingsError(f"{source}: [models.{name}] kind = {table['kind']!r}: expected "
                                f"\"chat\" or \"embedding\"")
        for key in ("ctx_size", "parallel", "n_gpu_layers", "n_predict"):
            value = table.get(key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise SettingsError(f"{source}: [models.{name}] {key} = {value!r}: expected a whole number")
        out[name] = dict(table)
    return out


def split_model_flags(values: list[str]) -> tuple[str | None, dict[str, dict]]:
    """-m/--model given several times: PATH is the default model (once), NAME=PATH a named one."""
    default, named = None, {}
    for value in values:
        name, sep, path = value.partition("=")
        if not sep:
            if default is not None:
                raise SettingsError(f"-m/--model {value}: the default model is already {default}; "
                                    f"name the others as --model NAME=PATH")
            default = value
        elif not name or not path:
            raise SettingsError(f"--model {value}: expected NAME=PATH")
        else:
            named[name] = {"path": path}
    return default, named


def parse_size(text: str) -> int:
    """'6G', '512M', '1.5GiB' or a number of bytes."""
    match = SIZE.match(str(text))
    if not match:
        raise SettingsError(f"--memory-budget {text}: expected a size such as 6G or 512M")
    number, unit = float(match.group(1)), match.group(2).lower()
    return int(number * 1024 ** " kmgt".index(unit or " "))


def model_specs(settings: Settings) -> list[ModelSpec]:
    """Every model offered, the default first: -m (or the embedded model) unless only named
    models are given, in which case the first of them is the default."""
    named = dict(settings.models)
    if settings.models_dir:
        folder = Path(settings.models_dir).expanduser()
        if not folder.is_dir():
            raise SettingsError(f"--models-dir {settings.models_dir}: no such folder")
        for path in sorted(folder.glob("*.gguf")):
            if not path.name.startswith("mmproj"):  # a projector is no model (--mmproj)
                named.setdefault(path.stem, {"path": str(path)})
    specs = []
    if settings.model is not None or not named:
        path = find_model(settings.model)
        if settings.mmproj:
            find_model(settings.mmproj, "--mmproj")  # refused at start, named
        specs.append(ModelSpec((settings.aliases or [path.stem])[0], settings.model,
                               chat_template=settings.chat_template,
                               chat_template_file=settings.chat_template_file,
                               mmproj=settings.mmproj))
    for name, table in named.items():
        find_model(table["path"], f"[models.{name}] path =")  # refused at start, named
        if table.get("mmproj"):
            find_model(table["mmproj"], f"[models.{name}] mmproj =")
        specs.append(ModelSpec(name, **table))
    names = [s.name for s in specs]
    duplicate = next((n for n in names if names.count(n) > 1), None)
    if duplicate:
        raise SettingsError(f"--model {duplicate}: two models have this name; use --alias or "
                            f"another NAME")
    return specs
