"""ModelHost: one model's runner, slots, scheduler and engine loop (built from Settings by
assembly.py), their life (load, unload, drain), and the face the HTTP side uses, as Ollama's
`LlamaServer` interface is for its runner: tokens and text, the model's special tokens, grammar
checks, a read-only view of the cache pool and the scheduler's limits. Nothing in api/ reaches
the runner or the engine loop past the face (tests/test_layers.py), so a change of engine shows
here and nowhere else.

The model loads on a background thread so that /health can answer 503 "loading" meanwhile.
"""

from __future__ import annotations

import gc
import logging
import threading
from contextlib import nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from localserve.common.config import Settings
from localserve.common.metrics import build_registry
from localserve.engine.loop import AsyncEngine, EngineLoop
from localserve.engine.policies import make_scheduler
from localserve.engine.prompt_cache import PromptCache
from localserve.engine.runner import (LlamaRunner, add_servers, on_fatal_error, rpc_devices,
                                      supports_gpu_offload)
from localserve.models.assembly import (log_start_up, new_pool, new_prompt_cache, new_runner,
                                        template_source)
from localserve.models.chat_template import ChatTemplate, PromptPart, answer_markers
from localserve.models.embeddings import Embeddings
from localserve.models.image_inputs import (IMAGE_MARKER, DecodedImage, ImageError,
                                            PlacedImages)
from localserve.models.model_specs import find_model
from localserve.models.resources import ContextChoice, check_memory, choose_context
from localserve.engine.slots import SlotPool

if TYPE_CHECKING:
    from localserve.engine.scheduler_view import PoolLimits

log = logging.getLogger("localserve")


class ModelHost:
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
            self.runner = new_runner(s, str(self.model_path), context, prefill_budget)
            facts = self.facts = self.runner.describe()
            facts["model"].update(id=self.model_id, path=str(self.model_path))
            if s.rpc_servers:  # asked once here: a worker that dies later must not be queried
                facts["rpc_devices"] = rpc_devices()
            pool = new_pool(s, self.runner, context)
            shares = self.shares  # without keys no identity can be trusted to share by
            self.prompt_cache = new_prompt_cache(s, self.runner, self.model_id, self.live_scope)
            scheduler = make_scheduler(s.scheduler, pool, self.runner, budget, s.max_num_seqs,
                                       prefill_budget=prefill_budget,
                                       slot_share=s.slot_share() if shares else None,
                                       prompt_cache=self.prompt_cache,
                                       speculative=s.drafting,
                                       max_long_prompts=s.max_long_prompts)
            self.template = ChatTemplate(template_source(s, self.runner, self.model_id),
                                         self.runner.bos_text, self.runner.eos_text)
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
            log_start_up(s, facts, context, self.runner, self.template.source,
                         scheduler.limits(), shares)
            self._warn_if_slots_too_small(pool)
        except Exception as exc:
            self.load_error = str(exc)
            log.error("could not load the model: %s", exc)
        finally:
            self.loaded.set()

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

    # ==== the face: what api/ calls (the runner and the loop are read here, not there) ======
    # ---- tokens and text ------------------------------------------------------------------
    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        return self.runner.tokenize(text, add_special=add_special, parse_special=parse_special)

    def tokenize_prompt(self, text: str) -> list[int]:
        """Tokenize a caller's whole raw prompt (special tokens parsed), adding BOS unless the
        text already starts with it."""
        bos = self.runner.bos_text
        add_special = not (bos and text.startswith(bos))
        return self.runner.tokenize(text, add_special=add_special, parse_special=True)

    def tokenize_parts(self, parts: list[PromptPart],
                       images: list[DecodedImage] = ()) -> tuple[list[int], PlacedImages]:
        """Tokenize a rendered chat: the template's parts with special tokens parsed, callers'
        text as plain text, each IMAGE_MARKER in it as the next image's rows (placeholder ids,
        runner/images.py). BOS is added unless the template wrote it. (tokens, the images by
        hash)"""
        bos = self.runner.bos_text
        tokens: list[int] = []
        placed: PlacedImages = {}
        waiting = list(images)
        for i, part in enumerate(parts):
            add_bos = i == 0 and not (part.trusted and bos and part.text.startswith(bos))
            pieces = part.text.split(IMAGE_MARKER) if images and not part.trusted else [part.text]
            for j, text in enumerate(pieces):
                if j and not waiting:  # a template that writes a message twice
                    raise ImageError("the chat template placed an image twice; send it in a "
                                     "message the template writes once, or send text")
                if j:
                    tokens += self._image_rows(waiting.pop(0), placed)
                if text or (add_bos and j == 0):
                    tokens += self.runner.tokenize(text, add_special=add_bos and j == 0,
                                                   parse_special=part.trusted)
        if waiting:
            raise ImageError(f"{waiting[0].where}: the chat template left no place for this image")
        return tokens, placed

    def user_turns(self, tokens: list[int]) -> tuple[int, ...]:
        """Where each user message starts in a chat's tokens (llama-server's message spans:
        the template's user marker, ChatTemplate.user_start_marker, found among them): where
        sequences cannot be cut back, a prompt's chunk stops there as llama-server's batch
        does (reuse.PrefixBook.checkpoint); nothing where they can (unused there: a chat's
        whole prompt is walked for it)."""
        marker = self.user_marker
        if not marker or self.runner.cuts_back:
            return ()
        n = len(marker)
        return tuple(i for i, token in enumerate(tokens)
                     if token == marker[0] and tokens[i:i + n] == marker)

    def _image_rows(self, image: DecodedImage, placed: PlacedImages) -> list[int]:
        try:
            tokens, inputs = self.runner.projector.prepare(image.rgb, image.width, image.height,
                                                           image.raw)
        except ValueError as exc:
            raise ImageError(f"{image.where}: {exc}") from None
        for h, found in inputs.items():
            placed.setdefault(h, found)  # the same image twice: encoded once
        return tokens

    @property
    def template_source(self) -> str | None:
        """The chat template's Jinja source (None before the model is loaded)."""
        return self.template.source if self.template else None

    @property
    def reads_images(self) -> bool:
        """Whether this model was given a projector (--mmproj): images in its chats."""
        return getattr(self.runner, "projector", None) is not None

    def detokenize(self, tokens: list[int]) -> str:
        return b"".join(self.runner.piece(t) for t in tokens).decode("utf-8", "replace")

    def piece(self, token: int) -> bytes:
        """A token's bytes as the answer spells them (control tokens: none)."""
        return self.runner.piece(token)

    def token_text(self, token: int) -> str:
        """A token's text as the vocabulary writes it (control tokens too)."""
        return self.runner.token_text(token)

    @property
    def n_vocab(self) -> int:
        return self.runner.n_vocab

    @property
    def max_piece_bytes(self) -> int:
        """The longest token's bytes: what bounds the text n tokens can spell."""
        return self.runner.max_piece_bytes

    @property
    def fim_tokens(self) -> tuple[int, int, int] | None:
        """Fill-in-the-middle's prefix, suffix and middle tokens (None: the model has none)."""
        return self.runner.fim_tokens

    # ---- grammars ---------------------------------------------------------------------------
    def json_schema_grammar(self, schema_json: str) -> str:
        return self.runner.sampling.json_schema_grammar(schema_json)

    def grammar_error(self, gbnf: str) -> str | None:
        """llama.cpp's complaint about a grammar, or None when it parses."""
        return self.runner.sampling.grammar_error(gbnf)

    def grammar_refusal(self, user: str | None, grammar: str | None) -> str | None:
        """Why this key's grammar is refused at once (the engine lately ended it as too
        costly), else None."""
        return self.loop.scheduler.grammar_refusal(user, grammar)

    # ---- the pool -----------------------------------------------------------------------------
    def pool_view(self) -> PoolLimits:
        """The pool and the scheduler's limits, as /props and /slots show them."""
        return self.loop.scheduler.limits()

    @property
    def n_ctx_per_slot(self) -> int:
        """The most one request may use: the model's trained context, at most the pool."""
        return self.loop.scheduler.limits().n_ctx_per_slot

    @property
    def n_ctx_embedding(self) -> int:
        """The most one embedding input may hold: one slot's share of the pool."""
        return self.runner.n_ctx_embedding

    @property
    def n_embd(self) -> int:
        """The length of this model's vectors."""
        return self.runner.n_embd

    def embedder(self):
        """The model's embedder (engine/runner/embeddings.py; made on first use, blocking:
        call it on a worker thread): `embed(tokens)` gives one input's vector."""
        return self.runner.embedder(self.kind == "embedding")

    def context_bound(self) -> str:
        """What bounds one request, in the words a refusal uses (never a slot's share: a
        request borrows past it)."""
        limits, trained = self.loop.scheduler.limits(), self.runner.n_ctx_train
        if trained and limits.n_ctx_per_slot >= trained:
            return f"this model's context is {limits.n_ctx_per_slot} tokens (what it was trained on)"
        return (f"one request may use the whole cache pool, {limits.n_ctx_per_slot} tokens "
                f"(raise -c for more; the model was trained on {trained})")
