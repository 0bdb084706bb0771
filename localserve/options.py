"""`localserve up`'s flags, one entry per Settings field (vLLM's EngineArgs.add_cli_args
pattern): the flag spellings and help live here, the default comes from Settings, the choices
from config.py, the type from the field's annotation. The parser, the environment variables
and the TOML keys are all derived from this one table (settings_loader.py), and
tests/test_settings.py checks that every field has its flag."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Callable

from localserve.common.config import CHOICES, Settings

FIELDS = {f.name: f for f in dataclasses.fields(Settings)}
# Fields set another way: [quotas.*] and [models.*] tables of the TOML, --config itself.
NOT_FLAGS = {"quotas", "models", "config"}


@dataclass(frozen=True)
class Option:
    field: str
    flags: tuple[str, ...]  # the long one names the environment variable and the TOML key
    help: str
    default_text: str | None = None  # what the default means, when the value alone does not say
    repeat: bool = False  # the flag may be given several times
    convert: Callable[[str], object] | None = None  # a spelling of llama-server's, translated

    @property
    def long(self) -> str:
        return next(f for f in self.flags if f.startswith("--"))


def _spec_type(value: str) -> str:
    return {"ngram-mod": "ngram", "ngram-simple": "ngram", "none": "off"}.get(value, value)


def _n_predict(value: str) -> int | None:
    return None if int(value) < 0 else int(value)


GROUPS: dict[str, list[Option]] = {
    "model": [
        Option("model", ("-m", "--model"), "path to a .gguf file, or a file name inside models/; "
               "repeat as --model NAME=PATH to serve several models, chosen by `model`",
               "the embedded SmolLM2-135M-Instruct", repeat=True),
        Option("models_dir", ("--models-dir",), "serve every .gguf in this folder too, named by "
               "file stem"),
        Option("max_loaded_models", ("--max-loaded-models",), "models loaded at once; others load "
               "on demand", "as memory allows"),
        Option("idle_unload", ("--idle-unload",), "unload a model idle this many seconds; 0 "
               "never does"),
        Option("model_switch_timeout", ("--model-switch-timeout",), "seconds a request for "
               "another model waits for the loaded one's requests before a 503; the loaded model "
               "keeps serving"),
        Option("memory_budget", ("--memory-budget",), "cap on the loaded models' memory, e.g. 6G",
               "free memory"),
        Option("model_alias", ("--alias",), "model id to report in /v1/models; several, "
               "comma-separated, as llama-server takes them: the first in sorted order is the "
               "id, all are listed as `aliases`", "the file stem"),
        Option("model_tags", ("--tags",), "comma-separated tags listed in /v1/models (llama-server's)"),
        Option("mmproj", ("--mmproj",), "the model's projector file (a path, or a file name "
               "inside models/): the model reads images in chats, as llama-server's --mmproj"),
        Option("memory_check", ("--no-memory-check",), "load even if the model and cache look "
               "larger than free memory"),
    ],
    "GPU offload (CUDA or Metal builds)": [
        Option("n_gpu_layers", ("-ngl", "--n-gpu-layers"), "layers to offload",
               "all when the build can offload, else 0"),
        Option("main_gpu", ("--main-gpu",), "GPU for the model"),
        Option("tensor_split", ("--tensor-split",), "share of the model per GPU, e.g. 3,1"),
        Option("cpu_moe", ("-cmoe", "--cpu-moe"), "keep every layer's mixture-of-experts "
               "weights in host memory, the rest on the GPU (llama-server's)"),
        Option("n_cpu_moe", ("-ncmoe", "--n-cpu-moe"), "keep the experts of the first N "
               "layers in host memory (llama-server's)", "0, or as --fit chooses"),
        Option("override_tensor", ("-ot", "--override-tensor"), "PATTERN=BUFFER: weights whose "
               "name the pattern finds go to that buffer type, e.g. 'exps=CPU' "
               "(llama-server's; comma-separated or repeated)", repeat=True),
        Option("rpc_servers", ("--rpc",), "llama.cpp RPC workers (localserve rpc-worker) as "
               "devices, e.g. 10.0.0.2:50052,10.0.0.3:50052; -ngl layers go to them (RPC builds "
               "only)"),
        Option("threads", ("-t", "--threads"), "CPU threads", "all cores"),
    ],
    "slots and scheduling": [
        Option("ctx_size", ("-c", "--ctx-size"), "the cache pool every slot draws from, in "
               "tokens; each slot is guaranteed ctx-size/parallel, and one request may use up to "
               "the model's trained context by borrowing what the others do not use",
               "0: the model's trained context, fitted to free memory (never under 4096)"),
        Option("parallel", ("-np", "--parallel"), "slots = requests decoded together"),
        Option("max_num_batched_tokens", ("--max-num-batched-tokens",), "tokens per engine step: "
               "small = smooth streams while long prompts arrive, large = faster prefill",
               "256 on CPU, 512 with -ngl"),
        Option("prefill_batch_tokens", ("--prefill-batch-tokens",), "tokens per step while no "
               "stream is decoding", "4x --max-num-batched-tokens"),
        Option("max_num_seqs", ("--max-num-seqs",), "cap on concurrent sequences", "one per slot"),
        Option("max_long_prompts", ("--max-long-prompts",), "requests computing at once a "
               "prompt longer than one step computes (a new document, not a conversation's next "
               "turn, whose prompt is cached), one key at most all but one of them while "
               "another's waits: the prompts in the pool, which every row attends over, stay "
               "few, and slots stay open for follow-ups"),
        Option("scheduler", ("--scheduler",), "continuous is the product; static and serial exist "
               "to be measured against (see localserve bench)"),
        Option("cache_ram", ("-cram", "--cache-ram"), "MiB of RAM for prompts kept beyond the "
               "slots, restored instead of recomputed when their conversation comes back, at most "
               "a quarter of free RAM; 0 turns it off"),
        Option("cache_disk", ("--cache-disk",), "MiB of files under --state-dir for prompts the "
               "RAM cache evicts and for all of them at shutdown, so conversations survive a "
               "restart; 0 turns it off; the files hold prompts' state, mode 600"),
        Option("spec", ("--spec",), "speculative decoding: ngram drafts each answer's "
               "next tokens from its own conversation, as many a step as measured acceptance "
               "and step cost say pay (no draft model; the text as without drafts, though greedy text "
               "beside other requests may differ either way: docs/api.md; faster on answers "
               "that copy text); auto (the default) is ngram on attention models and off on "
               "sliding-window and hybrid ones (greedy text as llama-server's); ngram drafts "
               "on those too (a hybrid where llama.cpp keeps earlier states for its family: 8 "
               "more recurrent states per slot, 8 drafts a step); off turns it off"),
        Option("spec", ("--spec-type",), "llama-server's spelling of --spec: ngram-mod or "
               "ngram-simple (both ngram), none (off)", convert=_spec_type),
        Option("cache_type_k", ("-ctk", "--cache-type-k"), "cache type for K; q8_0 fits ~1.9x "
               "the tokens"),
        Option("cache_type_v", ("-ctv", "--cache-type-v"), "cache type for V; a quantized V "
               "needs --flash-attn on"),
        Option("flash_attn", ("-fa", "--flash-attn"), "flash attention"),
        Option("swa_full", ("--swa-full",), "a sliding-window model's window layers keep every "
               "position, as llama-server's --swa-full: several times their cache, and the "
               "model then gets drafting and prefix reuse as a pure-attention one does"),
        Option("kv_unified", ("-no-kvu", "--no-kv-unified"), "a cache stream of -c / -np "
               "tokens for each slot, as llama-server's at an explicit -np: nothing borrowed, "
               "each slot's rows attend over its own cells only (faster long prompts side by "
               "side, greedy answers that do not depend on the neighbours: docs/flags.md)"),
        Option("max_queue", ("--max-queue",), "waiting requests beyond this get HTTP 503 + "
               "Retry-After"),
        Option("queue_timeout", ("--queue-timeout",), "seconds a request may wait for a slot "
               "before it gets 503", "none"),
    ],
    "defaults for requests that leave them out (llama-server's flags)": [
        Option("temp", ("--temp",), "temperature", "1.0, as OpenAI"),
        Option("top_k", ("--top-k",), "top-k", "0: off"),
        Option("top_p", ("--top-p",), "top-p", "1.0: off"),
        Option("seed", ("-s", "--seed"), "seed", "random per request"),
        Option("n_predict", ("-n", "--n-predict"), "max_tokens", "-1: until the slot is full",
               convert=_n_predict),
        Option("task_max_tokens", ("--task-max-tokens",), "the most a frontend's background "
               "task (Open WebUI's titles, tags, follow-ups, search queries) may generate, "
               "whatever max_tokens it sends"),
        Option("chat_template", ("--chat-template",), "the default model's chat template instead "
               "of its GGUF's: chatml, llama3, gemma, or a Jinja template"),
        Option("chat_template_file", ("--chat-template-file",), "the same, read from a Jinja "
               "file"),
        Option("reasoning_format", ("--reasoning-format",), "a <think> block at the start of an "
               "answer goes to reasoning_content: auto (when the chat template writes them), "
               "deepseek (always), none (left in the text)"),
    ],
    "network and access": [
        Option("host", ("--host",), "addresses to listen on, comma-separated (0.0.0.0 = the LAN), "
               "or a UNIX socket's path ending in .sock"),
        Option("port", ("--port",), "port"),
        Option("api_keys", ("--api-key",), "require this key (repeatable); clients send "
               "'Authorization: Bearer KEY'", repeat=True),
        Option("api_key_file", ("--api-key-file",), "file of 'name:key' lines; the name "
               "identifies the user"),
        Option("cors_origins", ("--cors-origin",), "allow browser frontends on this origin "
               "(repeatable), e.g. http://chat.lan:3000", repeat=True),
        Option("allowed_hosts", ("--allowed-host",), "a Host name to accept besides loopback "
               "names (repeatable); only matters on a loopback server without keys, where other "
               "Hosts are refused (DNS-rebinding guard)", repeat=True),
        Option("max_body_bytes", ("--max-body-bytes",), "largest request body, in bytes"),
        Option("ssl_key_file", ("--ssl-key-file",), "a PEM private key: serve HTTPS (with "
               "--ssl-cert-file), as llama-server's; plain HTTP to the port is then refused"),
        Option("ssl_cert_file", ("--ssl-cert-file",), "the PEM certificate (chain) for "
               "--ssl-key-file"),
        Option("image_urls", ("--image-urls",), "fetch the images that chats name by http(s) "
               "address (public addresses only, 20 MB and 10 s each at most, 2 at a time per "
               "key); off, such an image is refused and clients send the image itself"),
        Option("image_url_hosts", ("--image-url-host",), "a host --image-urls may fetch from "
               "even at a private or loopback address (the office's own image server; "
               "repeatable)", repeat=True),
        Option("header_timeout", ("--header-timeout",), "seconds a client may take to send its "
               "request headers"),
        Option("body_timeout", ("--body-timeout",), "seconds a client may take to send a request "
               "body once its headers are in"),
        Option("max_connections", ("--max-connections",), "open connections at most; at the cap "
               "the slowest header-sender is dropped"),
    ],
    "sharing between API keys (apply only when keys are set)": [
        Option("shared_prefix_cache", ("--shared-prefix-cache",), "let keys reuse each other's "
               "cached prompt prefixes (faster for a common system prompt, but one key can then "
               "probe what another sent)"),
        Option("max_queue_per_key", ("--max-queue-per-key",), "waiting requests one key may "
               "hold; more get 429", "half of --max-queue"),
        Option("max_slots_per_key", ("--max-slots-per-key",), "slots one key may hold while "
               "another key waits", "all but one"),
        Option("rate_limit", ("--rate-limit",), "requests per second per key, beyond the burst "
               "429 + Retry-After; 0 turns it off"),
        Option("rate_burst", ("--rate-burst",), "requests a key may send at once before "
               "--rate-limit applies"),
        Option("trusted_frontends", ("--trust-user-header",), "a key's name (repeatable) whose "
               "requests may name the colleague they are for in X-OpenWebUI-User-Email/-Name/-Id "
               "(Open WebUI's ENABLE_FORWARD_USER_INFO_HEADERS): usage, quotas, shares and "
               "the prompt cache are then that colleague's", "none: off", repeat=True),
    ],
    "lifecycle": [
        Option("drain_timeout", ("--drain-timeout",), "on Ctrl-C/SIGTERM, seconds to let running "
               "requests finish; a second Ctrl-C exits at once"),
        Option("state_dir", ("--state-dir",), "where the ledger, conversations and disk cache "
               "live", "~/.local/share/localserve, or systemd's $STATE_DIRECTORY"),
        Option("ledger", ("--no-ledger",), "keep no per-request usage"),
        Option("web", ("--no-web",), "no chat page at / (the API and the dashboard are "
               "unchanged)"),
    ],
}
OPTIONS = [option for options in GROUPS.values() for option in options]


def flag_names() -> dict[str, str]:
    """Each long flag's name as a setting's name (--api-key: api_key) -> its field, for the
    environment variables and TOML keys; only those that differ from their field's name."""
    names = {}
    for option in OPTIONS:
        name = option.long[2:].replace("-", "_")
        if name != option.field and not name.startswith("no_") and option.convert is None:
            names[name] = option.field
    return names


def add_settings_flags(parser: argparse.ArgumentParser) -> None:
    """Every option, in its group, with the default and choices written once elsewhere."""
    for title, options in GROUPS.items():
        group = parser.add_argument_group(title)
        for option in options:
            group.add_argument(*option.flags, dest=option.field, **_argument(option))


def _argument(option: Option) -> dict:
    field = FIELDS[option.field]
    default, kind = _default_value(field), field.type.replace(" | None", "")
    if kind == "bool":  # a flag that turns on what is off, or --no-X for what is on
        return {"action": "store_false" if default else "store_true", "help": option.help}
    said = _said_default(option)
    help_text = option.help + (f" (default: {said})" if said is not None else "")
    argument = {"help": help_text, "choices": CHOICES.get(option.field)}
    if option.convert is not None:
        argument["type"] = option.convert  # argparse checks the choices after it
        argument["metavar"] = option.long.lstrip("-").upper()  # the help names the spellings
    elif kind in ("int", "float"):
        argument["type"] = int if kind == "int" else float
    if option.repeat:
        argument["action"] = "append"
    return argument


def flags_markdown() -> str:
    """docs/flags.md's tables, one per group, from the same entries as `up --help`
    (tests/test_docs.py checks the file holds exactly this; scripts/flags-doc rewrites it)."""
    out = []
    for title, options in GROUPS.items():
        out += [f"### {title[0].upper()}{title[1:]}", "", "| flag | default | meaning |",
                "|---|---|---|"]
        for option in options:
            flags = "`" + "`, `".join(option.flags) + "`" + (" (repeatable)" if option.repeat else "")
            meaning = option.help
            if CHOICES.get(option.field) and option.convert is None:
                meaning += "; one of " + ", ".join(f"`{c}`" for c in CHOICES[option.field])
            out.append(f"| {flags} | {_default_text(option)} | {meaning} |")
        out.append("")
    return "\n".join(out)


def _default_text(option: Option) -> str:
    if FIELDS[option.field].type.replace(" | None", "") == "bool":
        return "not set"
    said = _said_default(option)
    return "none" if said is None else str(said)


def _said_default(option: Option) -> object | None:
    """What `--help` and the flags page say the default is: its meaning, else its value."""
    default = _default_value(FIELDS[option.field])
    return option.default_text or (None if default in (None, ()) else default)


def _default_value(field: dataclasses.Field) -> object | None:
    return field.default if field.default is not dataclasses.MISSING else None
