"""LlamaRunner: one context whose cache holds `n_slots` sequences (slot id = sequence id).
It turns a scheduler StepPlan into one llama_decode call (two when that is cheaper: calls.py;
an image's rows before them: image_steps.ImagePlacer) and samples a token for every row that
asked for logits, each with that slot's own sampler chain and grammar (sampling.SlotSamplers).
ctypes releases the GIL inside llama_decode, so the HTTP side keeps serving during a step.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time

import llama_cpp as C

from localserve.engine.drafts import MAX_DRAFT
from localserve.engine.errors import EngineFailed, RestoreFailed, RowsRefused
from localserve.engine.interfaces import RunnerConfig
from localserve.engine.runner.model_file import (FLASH_ATTN, OVERRIDDEN, context_params,
                                                 _load_progress, _quiet_llama,
                                                 memory_kind, reset_load_progress,
                                                 rollback_states, supports_gpu_offload)
from localserve.engine.plan import StepOutput, StepPlan
from localserve.engine.runner.batch import fill_tokens, undo_step
from localserve.engine.runner.calls import (compacts, decode_calls, interleaved, one_call,
                                            stream_call)
from localserve.engine.runner.image_steps import ImagePlacer
from localserve.engine.runner.interrupt import StepInterrupt
from localserve.engine.runner.placement import TensorOverrides
from localserve.engine.runner.sampling import SlotSamplers
from localserve.engine.runner.states import read_sequence, state_fingerprint, write_sequence
from localserve.engine.runner.upper_state import clear_upper_state

log = logging.getLogger("localserve.llama")


class LlamaRunner:
    def __init__(self, config: RunnerConfig):
        self.config = config
        _quiet_llama()
        mparams = C.llama_model_default_params()
        gpu = C.llama_supports_gpu_offload()  # a local GPU, or RPC workers (see supports_gpu_offload)
        self.n_gpu_layers = (999 if config.n_gpu_layers is None else config.n_gpu_layers) if gpu else 0
        mparams.n_gpu_layers = self.n_gpu_layers
        mparams.main_gpu = config.main_gpu
        if config.tensor_split:
            self._tensor_split = (ctypes.c_float * C.llama_max_devices())(*config.tensor_split)
            mparams.tensor_split = self._tensor_split
        self._overrides = TensorOverrides(config.tensor_overrides)  # alive while loading
        mparams.tensor_buft_overrides = self._overrides.pointer
        mparams.progress_callback = _load_progress
        reset_load_progress()
        OVERRIDDEN.clear()
        self.model = C.llama_model_load_from_file(config.model_path.encode(), mparams)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load the model file {config.model_path}")
        self.vocab = C.llama_model_get_vocab(self.model)
        self.memory_kind = memory_kind(self.model, config.swa_full)
        self.cuts_back = self.memory_kind == "attention"  # slots.SlotPool.cuts_back
        self.n_vocab = C.llama_vocab_n_tokens(self.vocab)
        threads = config.n_threads or os.cpu_count() or 1
        cparams = context_params(config.ctx_size, config.n_slots, config.n_batch,
                                 config.cache_type_k, config.cache_type_v, config.swa_full,
                                 config.kv_unified,
                                 rollback_states(self.memory_kind, config.draft_rollback))
        cparams.n_threads = threads
        cparams.n_threads_batch = threads
        cparams.flash_attn_type = FLASH_ATTN[config.flash_attn]
        cparams.no_perf = True
        self.ctx = C.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            C.llama_model_free(self.model)
            raise RuntimeError(f"llama.cpp could not create a context of {config.ctx_size} tokens")
        self.memory = C.llama_get_memory(self.ctx)
        self.draft_rollback = self._draft_rollback(config.draft_rollback)
        # CPU flash attention's tiles over one pool (calls.py); a stream per slot has its own
        self.cpu_tiles = self.n_gpu_layers == 0 and config.kv_unified
        self.interleaved_rows = 0  # written beside other sequences' since the pool was compacted
        self._interrupt = StepInterrupt(self.ctx)
        self.pool_cells = C.llama_n_ctx(self.ctx)  # every slot's cells (one pool, or streams)
        # an embedding context of one slot's share: its cache is a second one, beside the pool
        self.n_ctx_embedding = max(64, self.pool_cells // config.n_slots)
        self.batch = C.llama_batch_init(config.n_batch, 0, 1)
        self.sampling = SlotSamplers(self.ctx, self.vocab)  # every slot's chain and grammar
        self._embedder = None
        self._embedder_lock = threading.Lock()
        self._pieces: dict[int, bytes] = {}
        self._shown: set[int] = set()  # control tokens an answer format reads: spelled out
        # No token spells more bytes than this: n tokens never cover more than n * this bytes,
        # which lets the API refuse an impossible prompt without tokenizing it.
        self.max_piece_bytes = max(len(self.token_text(t).encode()) for t in range(self.n_vocab))
        self.images = ImagePlacer(config.mmproj, self.model, self.ctx, self.batch,
                                  config.n_batch, threads, self.n_gpu_layers > 0
                                  ) if config.mmproj else None  # a projector: images in prompts

    def _draft_rollback(self, asked: int) -> int:
        """A step's drafted rows this cache can take out again, where it cannot be cut back to
        any prefix (0: no drafts, or none asked): the earlier recurrent states llama.cpp
        granted (n_rs_seq); on window layers as many as on attention, since a step's rows are
        one physical batch (256 or 512 rows, llama.cpp's ubatch 512), whose writes spare every
        cell its first row sees, so the window stays whole when its later rows go
        (_window_whole checks each cut). Gemma 3 270M copying drafted up to 64 tokens a step
        ran 1.21x (1.16-1.36) what it ran with 8: docs/performance.md."""
        if rollback_states(self.memory_kind, asked):  # asked for: what llama.cpp granted
            return C.llama_n_rs_seq(self.ctx)
        return MAX_DRAFT if asked and self.memory_kind == "sliding-window" else 0

    # ---- model facts ------------------------------------------------------------------
    def meta(self, key: str) -> str | None:
        buf = ctypes.create_string_buffer(64 * 1024)
        n = C.llama_model_meta_val_str(self.model, key.encode(), buf, len(buf))
        return buf.value.decode("utf-8", "replace") if n >= 0 else None

    @property
    def chat_template(self) -> str | None:
        raw = C.llama_model_chat_template(self.model, None)
        return raw.decode("utf-8", "replace") if raw else None

    def token_text(self, token: int) -> str:
        """A special token's own spelling (e.g. '<|im_end|>'), for chat templates."""
        if token < 0:
            return ""
        buf = ctypes.create_string_buffer(256)
        n = C.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, True)
        return buf.raw[:max(n, 0)].decode("utf-8", "replace")

    @property
    def bos_text(self) -> str:
        return self.token_text(C.llama_vocab_bos(self.vocab))

    @property
    def eos_text(self) -> str:
        return self.token_text(C.llama_vocab_eos(self.vocab))

    @property
    def n_embd(self) -> int:
        return C.llama_model_n_embd(self.model)

    @property
    def fim_tokens(self) -> tuple[int, int, int] | None:
        """(prefix, suffix, middle) fill-in-the-middle tokens, if the model has them."""
        found = (C.llama_vocab_fim_pre(self.vocab), C.llama_vocab_fim_suf(self.vocab),
                 C.llama_vocab_fim_mid(self.vocab))
        return None if min(found) < 0 else found

    @property
    def n_swa(self) -> int:
        """The sliding-window size, 0 for a model without one."""
        return C.llama_model_n_swa(self.model)

    @property
    def projector(self):
        """The image projector (images.Projector), None for a model given none."""
        return self.images.projector if self.images is not None else None

    @property
    def n_ctx_train(self) -> int:
        return C.llama_model_n_ctx_train(self.model)

    def describe(self) -> dict:
        """Model and backend facts for /props and the start-up log."""
        buf = ctypes.create_string_buffer(256)
        C.llama_model_desc(self.model, buf, len(buf))
        description = buf.value.decode("utf-8", "replace")  # e.g. "llama 256M Q4_1"
        info = C.llama_print_system_info().decode("utf-8", "replace")
        backend = next((name for name in ("CUDA", "Metal", "Vulkan", "ROCm", "SYCL")
                        if name in info), "CPU")
        gpu = supports_gpu_offload()
        n_layers = C.llama_model_n_layer(self.model)
        return {
            "model": {"description": description,
                      "n_params": C.llama_model_n_params(self.model),
                      "size_bytes": C.llama_model_size(self.model), "n_layers": n_layers,
                      "n_ctx_train": self.n_ctx_train, "n_vocab": self.n_vocab,
                      "quantization": description.rsplit(" ", 1)[-1],
                      "name": self.meta("general.name"), "memory": self.memory_kind},
            "backend": {"name": backend.lower(), "gpu_offload": gpu,
                        "n_gpu_layers": min(self.n_gpu_layers, n_layers + 1),
                        "tensors_overridden": dict(OVERRIDDEN),
                        "system_info": info.strip(" |")},
        }

    # ---- vocabulary (the scheduler's Vocab protocol) ----------------------------------
    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        data = text.encode("utf-8")
        n_max = len(data) + 8
        buf = (C.llama_token * n_max)()
        n = C.llama_tokenize(self.vocab, data, len(data), buf, n_max, add_special, parse_special)
        if n < 0:
            n_max = -n
            buf = (C.llama_token * n_max)()
            n = C.llama_tokenize(self.vocab, data, len(data), buf, n_max, add_special, parse_special)
        return list(buf[:n])

    def piece(self, token: int) -> bytes:
        """The bytes a generated token adds to the text (control tokens add none). Cached."""
        cached = self._pieces.get(token)
        if cached is None:
            if self.vocab is None or token < 0:  # unloaded (several models): a late reply gets no
                # text; an image's row (images.py) has none
                return b""
            buf = ctypes.create_string_buffer(256)
            n = C.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, token in self._shown)
            cached = self._pieces[token] = buf.raw[:max(n, 0)]
        return cached

    def show_specials(self, spellings) -> None:
        """Spell these control tokens out in piece() (gpt-oss's <|channel|>...: what its answer
        format is read by), as llama-server shows a format's preserved tokens."""
        for text in spellings:
            if len(ids := self.tokenize(text, add_special=False)) == 1:
                self._shown.add(ids[0])
                self._pieces.pop(ids[0], None)

    def is_eog(self, token: int) -> bool:
        return bool(C.llama_vocab_is_eog(self.vocab, token))

    # ---- one step ---------------------------------------------------------------------
    def decode(self, plan: StepPlan) -> StepOutput:
        """Run the whole plan through llama_decode (calls.py); return what it sampled.
        Before it: last step's failed drafts leave their sequences, sequences the plan
        overwrites are saved to the prompt cache, dropped ones cleared, admitted ones copied
        from a sibling or restored from the cache, then trimmed to the prefix they keep.
        An interrupt() from before llama_decode until it ends stops the step (Interrupted)."""
        try:
            return self._decode(plan)
        finally:
            self._interrupt.clear()  # one meant for this step never stops the next

    def _decode(self, plan: StepPlan) -> StepOutput:
        refused = {slot_id: "its draft's rows could not be taken out of its cache"
                   for slot_id, kept in plan.trims if not self._cut(slot_id, kept)}
        saved = [(save, *read_sequence(self.ctx, save.slot_id)) for save in plan.saves]
        if refused:
            raise RowsRefused(refused, saved)
        for slot_id in plan.dropped:
            C.llama_memory_seq_rm(self.memory, slot_id, -1, -1)
        for admission in plan.admitted:
            if admission.copy_from is not None:  # whole sequence: cross-stream copies need it
                C.llama_memory_seq_rm(self.memory, admission.slot_id, -1, -1)
                C.llama_memory_seq_cp(self.memory, admission.copy_from, admission.slot_id, -1, -1)
            elif admission.restore is not None:
                self._restore(admission)
            if not self._cut(admission.slot_id, admission.kept_tokens):
                raise RestoreFailed(f"slot {admission.slot_id}'s cache could not be cut back to "
                                    f"{admission.kept_tokens} tokens", admission.restore)
            self.sampling.start(admission.slot_id, admission.request)
        self.sampling.new_step()
        if self.cpu_tiles and compacts(plan, self.interleaved_rows):
            self._compact(plan.num_tokens)
        whole, decode_s = plan, 0.0
        if self.images is not None:  # image rows first, in order (image_steps.py)
            plan, decode_s = self.images.place(plan, saved)
        for call in self._calls(plan):
            n, rows = fill_tokens(self.batch, call)
            started = time.perf_counter()
            rc = C.llama_decode(self.ctx, self.batch)
            clear_upper_state()  # else this thread's sampling runs ~17x slower (upper_state.py)
            decode_s += time.perf_counter() - started
            if rc != 0:
                undo_step(self.memory, whole, rc, n, saved)
            self.interleaved_rows += interleaved(call)
        decoded = time.perf_counter()
        sampling = self.sampling
        sampled = {chunk.slot_id: sampling.sample_drafted(chunk, row) if chunk.drafts
                   else [sampling.sample(chunk.slot_id, row)] for chunk, row in rows}
        return StepOutput(sampled, saved, sampling.logprobs(rows, sampled), decode_s=decode_s,
                          sample_s=time.perf_counter() - decoded,
                          costly_grammars=frozenset(sampling.costly_grammars),
                          grammar_s=sampling.grammar_seconds)

    def _calls(self, plan: StepPlan):
        """The plan's rows in llama_decode calls (calls.py)."""
        if self.cpu_tiles:
            return decode_calls(plan)
        return one_call(plan) if self.config.kv_unified else stream_call(plan)

    def _compact(self, room_after: int) -> None:
        """Write every sequence back in consecutive cells (calls.py says why). Skipped where a
        sequence cannot be serialized, or where cells shared between sequences (a sibling's
        copy) would, written once for each, not leave `room_after` cells free."""
        last = {s: C.llama_memory_seq_pos_max(self.memory, s) for s in range(self.config.n_slots)}
        held = [s for s, pos in last.items() if pos >= 0]
        cells = sum(last[s] - C.llama_memory_seq_pos_min(self.memory, s) + 1 for s in held)
        if cells + room_after > C.llama_n_ctx(self.ctx):
            return
        states = [(s, *read_sequence(self.ctx, s)) for s in held]
        if any(size == 0 for _, _, size in states):
            return
        C.llama_memory_clear(self.memory, False)
        self.interleaved_rows = 0
        for slot_id, state, size in states:
            if not write_sequence(self.ctx, slot_id, state, size):
                C.llama_memory_clear(self.memory, False)
                raise EngineFailed(f"the cache pool could not take back slot {slot_id}'s "
                                   f"{size} bytes while compacting it")

    def _cut(self, slot_id: int, keep: int) -> bool:
        """The slot's sequence cut back to its first `keep` tokens; where llama.cpp cannot (a
        recurrent state holds no earlier position), or where a window layer no longer holds
        what the next position sees, cleared instead, and False."""
        if C.llama_memory_seq_rm(self.memory, slot_id, keep, -1) and self._window_whole(
                slot_id, keep):
            return True
        C.llama_memory_seq_rm(self.memory, slot_id, -1, -1)
        return False

    def _window_whole(self, slot_id: int, keep: int) -> bool:
        """Whether a sliding-window model's window layers still hold every position the one
        at `keep` sees (from keep - window + 1 on: llama.cpp reuses the cells a batch's rows no
        longer see, the sequence's oldest first)."""
        if self.memory_kind != "sliding-window":
            return True
        return C.llama_memory_seq_pos_min(self.memory, slot_id) <= max(0, keep - self.n_swa + 1)

    def encode_ahead(self, images: list) -> None:
        """The images admission waits for, encoded on the projector's thread (image_steps.py)."""
        self.images.encode_ahead(images)

    def interrupt(self) -> None:
        """Any thread: stop the decode in flight at its next graph node (CPU backend), or the
        next one when none is in flight. Not where sequences cannot be cut back: a stopped
        step's rows could not be taken out again (the step runs to its end)."""
        if self.cuts_back:
            self._interrupt.request()

    def forget_interrupt(self) -> None:
        """One asked for after the last step ended (for it, too late) must not stop the next."""
        self._interrupt.clear()

    def read_sequence(self, slot_id: int) -> tuple[object, int]:
        """A slot's sequence serialized (state, bytes), for the prompt cache."""
        return read_sequence(self.ctx, slot_id)

    def state_fingerprint(self) -> str:
        return state_fingerprint(self.config.model_path, self.config.cache_type_k,
                                 self.config.cache_type_v)

    def _restore(self, admission) -> None:
        """Load the state the plan pinned; a missing one is an error, never a null buffer
        handed to llama.cpp (that is a segfault)."""
        entry, state = admission.restore, admission.restore_state
        C.llama_memory_seq_rm(self.memory, admission.slot_id, -1, -1)
        if state is None or not write_sequence(self.ctx, admission.slot_id, state, entry.nbytes):
            C.llama_memory_seq_rm(self.memory, admission.slot_id, -1, -1)
            raise RestoreFailed(f"could not restore a cached prompt of {len(entry.tokens)} "
                                "tokens", entry)

    def embedder(self, own_pooling: bool = False):
        """The /v1/embeddings context on this model, made on first use (its cache costs
        memory only once someone asks for embeddings); own_pooling: see Embedder."""
        with self._embedder_lock:
            if self._embedder is None:
                from localserve.engine.runner.embeddings import Embedder

                self._embedder = Embedder(self.model, self.n_ctx_embedding,
                                          self.config.n_threads or os.cpu_count() or 1,
                                          own_pooling, self.projector)
            return self._embedder

    def close(self) -> None:
        if self.images is not None:
            self.images.close()
            self.images = None
        if self._embedder is not None:
            self._embedder.close()
        self.sampling.close()
        if self.ctx:
            C.llama_batch_free(self.batch)
            C.llama_free(self.ctx)
            C.llama_model_free(self.model)
            self.ctx = self.vocab = None
