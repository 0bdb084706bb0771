"""ModelHost: assembles one model's runner, slots, scheduler and engine loop from Settings,
and owns their life. What api/ may call of it is its face (host_face.py).

The model loads on a background thread so that /health can answer 503 "loading" meanwhile.
"""

from __future__ import annotations

import gc
import re
import logging
import threading
from contextlib import nullcontext
from pathlib import Path
from typing import Callable

from localserve.models import answer_formats
from localserve.models.chat_template import (ChatTemplate, answer_markers, fallback_for,
                                            override_source)
from localserve.models.host_face import HostFace
from localserve.common.config import Settings
from localserve.models.model_specs import find_model
from localserve.engine.loop import AsyncEngine, EngineLoop
from localserve.engine.runner.placement import placements
from localserve.models.embeddings import Embeddings
from localserve.engine.runner import (LlamaRunner, RunnerConfig, add_servers, on_fatal_error,
                                      rpc_devices, supports_gpu_offload)
from localserve.engine.policies import make_scheduler
from localserve.engine.prompt_cache import PromptCache
from localserve.engine.prompt_disk import DiskTier
from localserve.engine.slots import SlotPool
from localserve.office.ledger import state_dir
from localserve.common.metrics import build_registry
import psutil
from localserve.models.resources import ContextChoice, check_memory, choose_context

log = logging.getLogger("localserve")
MIB = 1024 ** 2


# The start-up log's line on the model's memory, by kind (runner.core.memory_kind).
_WHOLE = ("a slot's cache is reused whole, each prompt's checkpoint goes to the prompt cache, "
          "no drafting and no step stopped midway (their rows could not be taken out again)")
MEMORY_KINDS = {
    "attention": "attention only: a slot's cache is cut back to any shared prefix",
    "sliding-window": "sliding-window layers keep their window only (as llama-server's): " + _WHOLE,
    "hybrid": "a recurrent state beside attention: " + _WHOLE,
    "recurrent": "a recurrent state: " + _WHOLE,
}


class ModelHost(HostFace):
    """One model's engine: runner, slots, scheduler, engine loop, template and tokenization.
    With several models (registry.py) each has its own host. What the office shares (keys,
    ledger, per-key counters) reaches it only as the observers and the share rule the registry
    hands it (`observers`, `shares`) before it loads."""

    def __init__(self, settings: Settings, kind: str = "chat"):
        self.settings = settings.validate()
        self.kind = kind  # "embedding": a model for /v1/embeddings only
        # Handed by the registry (office.py): extra engine observers, given the model id, and
        # whether keys are set, so that queue places and slots are shared per key.
        self.observers: Callable[[Callable[[], str]], list] = lambda model_id: []
        self.shares = False
        self.live_scope: Callable[[str | None], bool] = lambda scope: True  # kept prompts' owner
        # requests the HTTP side has accepted for this model and not yet submitted (its leases)
        self.arriving: Callable[[], int] = lambda: 0
        self.unloaded = False  # unloaded by the registry (idle, or to make room): loadable again
        self._forget_fatal = lambda: None  # undoes the engine loop's fatal-error handler
        self.model_path: Path | None = None
        self.runner: LlamaRunner | None = None
        self.loop: EngineLoop | None = None
        self.engine: AsyncEngine | None = None
        self.template: ChatTemplate | None = None
        self.user_marker: list[int] = []  # the tokens a user message starts with (user_turns)
        self.facts: dict | None = None  # model and backend, read once at load (for /props)
        self.load_error: str | None = None
        self.loaded = threading.Event()
        self.metrics_registry, self.metrics = build_registry(
            lambda: self.engine.snapshot if self.engine is not None else None)
        self.prompt_cache: PromptCache | None = None  # sequences kept beyond the slots
        self.context: ContextChoice | None = None  # the pool's size and why (context_choice)
        self.embeddings = Embeddings(self)  # /v1/embeddings and /api/embed (embeddings.py)
        self.ended = False  # the drain ran out (end_work): no input starts any more

    def context_choice(self, model_path: str | Path) -> ContextChoice:
        """The pool's size (-c, else fitted from the model and the machine), chosen once."""
        if self.context is None:
            self.context = choose_context(self.settings, str(model_path), supports_gpu_offload())
        return self.context

    def check_memory(self, model_path: str) -> str:
        return check_memory(self.settings, model_path, supports_gpu_offload(),
                            self.context_choice(model_path))

    def in_flight(self) -> int:
        """Requests accepted and not yet finished, embeddings included (what a drain waits for)."""
        own = self.loop.in_flight if self.loop is not None else 0
        return own + self.embeddings.running

    def chat_on_its_way(self, background: bool):
        """Around a chat's tokenizing: the engine's steps of background tasks make way for it
        (EngineLoop.chat_on_its_way); a frontend's own task makes no other task wait."""
        return self.loop.chat_on_its_way() if self.loop is not None and not background \
            else nullcontext()

    @property
    def model_file(self) -> Path:
        """The GGUF file the settings name (the embedded model's when none): SettingsError
        when it is missing."""
        return find_model(self.settings.model)

    @property
    def model_id(self) -> str:
        if self.settings.aliases:
            return self.settings.aliases[0]
        return self.model_path.stem if self.model_path else "loading"

    @property
    def ready(self) -> bool:
        return self.engine is not None and self.engine.healthy

    def start_loading(self) -> threading.Thread:
        thread = threading.Thread(target=self.load, name="localserve-load", daemon=True)
        thread.start()
        return thread

    def load(self) -> None:
        s = self.settings
        self.unloaded, self.load_error = False, None
        try:
            self.model_path = self.model_file
            log.info("loading %s", self.model_path)
            if s.rpc_servers:  # devices must exist before the model loads
                add_servers(list(s.rpc_servers))
            budget = s.step_token_budget(supports_gpu_offload())
            prefill_budget = s.prefill_token_budget(supports_gpu_offload())
            context = self.context_choice(self.model_path)
            self.runner = LlamaRunner(RunnerConfig(
                model_path=str(self.model_path), ctx_size=context.ctx_size, n_slots=s.parallel,
                n_batch=prefill_budget, n_threads=s.threads,
                n_gpu_layers=s.n_gpu_layers if context.n_gpu_layers is None else context.n_gpu_layers,
                main_gpu=s.main_gpu, tensor_split=s.tensor_split,
                tensor_overrides=placements(s.cpu_moe, max(s.n_cpu_moe, context.n_cpu_moe),
                                            s.override_tensor),
                cache_type_k=s.cache_type_k, cache_type_v=s.cache_type_v, flash_attn=s.flash_attn,
                swa_full=s.swa_full,
                mmproj=str(find_model(s.mmproj, "--mmproj")) if s.mmproj else None))
            facts = self.facts = self.runner.describe()
            facts["model"].update(id=self.model_id, path=str(self.model_path))
            if s.rpc_servers:  # asked once here: a worker that dies later must not be queried
                facts["rpc_devices"] = rpc_devices()
            pool = self._pool(context)
            shares = self.shares  # without keys no identity can be trusted to share by
            self.prompt_cache = self._new_prompt_cache(pool)
            scheduler = make_scheduler(s.scheduler, pool, self.runner, budget, s.max_num_seqs,
                                       prefill_budget=prefill_budget,
                                       slot_share=s.slot_share() if shares else None,
                                       prompt_cache=self.prompt_cache,
                                       speculative=s.drafting,
                                       max_long_prompts=s.max_long_prompts)
            self.template = ChatTemplate(self._template_source(), self.runner.bos_text,
                                         self.runner.eos_text)
            self.user_marker = self.tokenize(self.template.user_start_marker(), add_special=False)
            # gpt-oss's and Gemma 4's answers are read by their control tokens
            self.runner.show_specials(answer_markers(self.template.source))
            observers = [self.metrics, *self.observers(lambda: self.model_id)]
            self.loop = EngineLoop(scheduler, self.runner, s.max_queue, s.queue_timeout,
                                   observers=observers,
                                   max_queue_per_user=s.queue_share() if shares else None,
                                   arriving=self.arriving)
            self._forget_fatal = on_fatal_error(self.loop.fatal)
            self.loop.start()
            self.engine = AsyncEngine(self.loop)
            backend = facts["backend"]
            log.info("model: %s (%s, %d layers, trained on %d tokens)", self.model_id,
                     facts["model"]["description"], facts["model"]["n_layers"],
                     facts["model"]["n_ctx_train"])
            log.info("backend: %s, %d layers offloaded", backend["name"], backend["n_gpu_layers"])
            if backend["tensors_overridden"]:
                log.info("weights placed by --cpu-moe, --n-cpu-moe or -ot: %s", ", ".join(
                    f"{n} tensors to {where}" for where, n in backend["tensors_overridden"].items()))
            log.info("context: %d tokens, %s", pool.ctx_size, context.why)
            log.info("cache pool: %s", pool.describe())
            log.info("memory: %s", MEMORY_KINDS[self.runner.memory_kind])
            if self.reads_images:
                log.info("images: read with the projector %s", s.mmproj)
            log.info("tool calls: %s", answer_formats.describe(self.template.source))
            log.info("scheduler: " + s.scheduler + ", --max-num-batched-tokens %d (%d while nothing "
                     "decodes), --max-num-seqs %d, --max-queue %s", budget,
                     max(prefill_budget, budget), scheduler.limits().max_num_seqs, s.max_queue)
            if shares:
                log.info("shares per key: %s queue places, %s slots while others wait, %s "
                         "requests/s (burst %d), prefix cache %s", s.queue_share(), s.slot_share(),
                         s.rate_limit or "unlimited", s.rate_burst,
                         "shared across keys" if s.shared_prefix_cache else "per key")
            self._warn_if_slots_too_small(pool)
        except Exception as exc:
            self.load_error = str(exc)
            log.error("could not load the model: %s", exc)
        finally:
            self.loaded.set()

    def _pool(self, context: ContextChoice) -> SlotPool:
        """One pool of the context llama.cpp made (it may round -c up), each slot guaranteed
        its share; one request may use the model's trained context, at most the pool."""
        s, made = self.settings, self.runner.pool_cells  # unified: the whole pool
        if made != context.ctx_size:
            log.info("llama.cpp made a cache of %d tokens for -c %d", made, context.ctx_size)
        trained = self.runner.n_ctx_train
        if s.ctx_size and trained and made > trained:
            log.warning("the pool (%d tokens) is longer than the model was trained for (%d): "
                        "one request may use %d", made, trained, trained)
        window = self.runner.n_swa if self.runner.memory_kind == "sliding-window" else 0
        return SlotPool(made, s.parallel, n_ctx_per_slot=min(made, trained or made),
                        cuts_back=self.runner.cuts_back, window=window)

    def _new_prompt_cache(self, pool: SlotPool) -> PromptCache | None:
        """--cache-ram MiB, at most a quarter of the RAM free now. Where sequences cannot be
        cut back, it holds whole sequences and checkpoints (PromptCache.whole_only)."""
        s = self.settings
        if s.cache_ram == 0 or s.scheduler != "continuous":
            return None
        bound = min(s.cache_ram * MIB, psutil.virtual_memory().available // 4)
        log.info("prompt cache in RAM: up to %d MiB (--cache-ram %d, at most a quarter of free "
                 "RAM), per key unless --shared-prefix-cache", bound // MIB, s.cache_ram)
        disk = None
        if s.cache_disk:
            folder = state_dir(s) / "prompt-cache" / re.sub(r"[^\w.-]", "_", self.model_id)
            disk = DiskTier(folder, s.cache_disk * MIB, self.runner.state_fingerprint())
        cache = PromptCache(bound, disk, whole_only=not self.runner.cuts_back)
        if disk:
            gone = cache.keep_scopes(self.live_scope)
            log.info("prompt cache on disk: up to %d MiB in %s (--cache-disk), %d prompts kept "
                     "from before (%d of keys no longer in the key file deleted)",
                     s.cache_disk, disk.folder, len(cache.on_disk), gone)
        return cache

    def _keep_prompts(self) -> None:
        """Before the cache is freed (shutdown, unload): the slots' sequences into the prompt
        cache, and everything it holds to disk when there is a disk tier."""
        cache = self.prompt_cache
        if cache is None or cache.disk is None or self.loop is None or self.loop.is_alive():
            return
        self.loop.scheduler.keep_sequences(self.runner.read_sequence)
        log.info("prompt cache: %d prompts written to %s", cache.spill(), cache.disk.folder)

    def unload(self) -> None:
        """Free the weights and the cache (stop the loop first: nothing may be running)."""
        self.stop_engine()
        self._forget_fatal()
        self._keep_prompts()
        if self.runner is not None:
            self.runner.close()
        self.runner = self.loop = self.engine = self.template = None
        self.unloaded = True
        self.loaded.clear()
        gc.collect()

    def _template_source(self) -> str:
        """--chat-template(-file), else the GGUF's own, else a built-in one (said in the log)."""
        s = self.settings
        source = override_source(s.chat_template, s.chat_template_file) or self.runner.chat_template
        if source is None:
            name, source = fallback_for(self.runner.meta("general.architecture"))
            log.warning("%s carries no chat template: using the built-in %s format (choose "
                        "another with --chat-template)", self.model_id, name)
        return source

    def _warn_if_slots_too_small(self, pool: SlotPool, answer_room: int = 64) -> None:
        """A slot whose guaranteed share cannot hold a one-line chat plus a short answer
        serves its colleagues only by borrowing: say so."""
        one_line = self.template.render_parts([{"role": "user", "content": "Hello, how are you?"}])
        need = len(self.tokenize_parts(one_line)[0]) + answer_room
        if pool.guarantee < need:
            s = self.settings
            log.warning("each slot holds %d tokens of the pool for sure, but a one-line chat with "
                        "this model's template takes %d tokens with a %d-token answer: raise -c to "
                        "at least %d for --parallel %d, or lower --parallel", pool.guarantee, need,
                        answer_room, need * s.parallel, s.parallel)

    def stop_engine(self) -> None:
        """Stop the engine loop (a drain, shutdown); anything unfinished gets an error event."""
        if self.loop is not None and self.loop.is_alive():
            self.loop.stop()
            # A loop failed by llama.cpp may be parked inside it for good: do not wait on it.
            self.loop.join(timeout=0.5 if self.loop.failure else 10)

    def end_work(self) -> None:
        """A drain's end: unfinished chats get an error event, embeddings stop at their next
        input."""
        self.ended = True
        self.stop_engine()

    def stop(self) -> None:
        self.stop_engine()
        if self.runner is not None and (self.loop is None or not self.loop.is_alive()):
            self._keep_prompts()
            self.runner.close()
