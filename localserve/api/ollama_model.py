"""What Ollama's catalog routes say of a model (/api/tags, /api/ps, /api/show), from the
registry's entry: its file, and once loaded the facts llama.cpp read from it (family, size,
quantization, context, chat template)."""

from __future__ import annotations

import hashlib
from datetime import datetime, timezone

from localserve.common.config import SettingsError
from localserve.models.model_entry import Entry


def _file(entry: Entry):
    try:
        path = entry.host.model_file
        return path, path.stat()
    except (SettingsError, OSError):
        return None, None


def _size_label(n_params: int | None) -> str:
    if not n_params:
        return ""
    for unit, scale in (("B", 1e9), ("M", 1e6)):
        if n_params >= scale:
            return f"{n_params / scale:.1f}{unit}".replace(".0", "")
    return str(n_params)


def model_details(entry: Entry) -> dict:
    facts = (entry.host.facts or {}).get("model", {}) if entry.loaded else {}
    family = (facts.get("description") or "").split(" ")[0]
    return {"parent_model": "", "format": "gguf", "family": family,
            "families": [family] if family else [],
            "parameter_size": _size_label(facts.get("n_params")),
            "quantization_level": facts.get("quantization", "")}


def tags_entry(entry: Entry) -> dict:
    """One model as /api/tags lists it; the digest stands for the file (path, size, time)."""
    path, stat = _file(entry)
    name = entry.spec.name
    stamp = f"{path}:{stat.st_size}:{stat.st_mtime_ns}" if stat else name
    return {"name": name, "model": name,
            "modified_at": datetime.fromtimestamp(stat.st_mtime if stat else 0,
                                                  timezone.utc).isoformat(),
            "size": stat.st_size if stat else 0,
            "digest": hashlib.sha256(stamp.encode()).hexdigest(), "details": model_details(entry)}


def listed_with_capabilities(entry: Entry) -> dict:
    """One model in llama-server's `models` list of /v1/models (Ollama's shape): what it can
    do, "multimodal" when it is served with a projector (loaded or not)."""
    capabilities = (["embedding"] if entry.spec.kind == "embedding" else
                    ["completion"] + (["multimodal"] if entry.host.settings.mmproj else []))
    return {**tags_entry(entry), "capabilities": capabilities}


def show(entry: Entry, reasons: bool) -> dict:
    host, details = entry.host, model_details(entry)
    facts = (host.facts or {}).get("model", {}) if entry.loaded else {}
    capabilities = (["embedding"] if entry.spec.kind == "embedding"
                    else ["completion", "tools"] + (["thinking"] if reasons else [])
                    + (["vision"] if entry.loaded and host.reads_images else []))
    info = {"general.architecture": details["family"],
            "general.parameter_count": facts.get("n_params", 0)}
    if details["family"]:
        info[f"{details['family']}.context_length"] = facts.get("n_ctx_train", 0)
    s = host.settings
    parameters = "\n".join(f"{name} {value}" for name, value in (
        ("temperature", s.temp), ("top_k", s.top_k), ("top_p", s.top_p)) if value is not None)
    return {"modelfile": f"# served by localserve from {tags_entry(entry)['name']} (a GGUF file "
                         f"the admin configured)\n",
            "parameters": parameters,
            "template": (host.template_source or "") if entry.loaded else "",
            "details": details, "model_info": info, "capabilities": capabilities,
            "modified_at": tags_entry(entry)["modified_at"]}
