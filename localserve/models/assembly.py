"""What loading a model builds from Settings, beside ModelHost (model_host.py), which owns
their life and is what the HTTP side calls: the runner, the cache pool, the prompt cache
beyond the slots, the chat template's source, and what the start-up log says of them."""

from __future__ import annotations

import logging
import re
from typing import Callable

import psutil

from localserve.common.config import Settings
from localserve.engine.prompt_cache import PromptCache
from localserve.engine.prompt_disk import DiskTier
from localserve.engine.runner import LlamaRunner, RunnerConfig
from localserve.engine.runner.placement import placements
from localserve.engine.scheduler_view import PoolLimits
from localserve.engine.slots import SlotPool
from localserve.models import answer_formats
from localserve.models.chat_template import fallback_for, override_source
from localserve.models.model_specs import find_model
from localserve.models.resources import ContextChoice, rollback_drafts
from localserve.office.ledger import state_dir

log = logging.getLogger("localserve")
MIB = 1024 ** 2

# The start-up log's line on the model's memory, by kind (runner/model_file.memory_kind).
_WHOLE = ("a slot's cache is reused whole, each prompt's checkpoint goes to the prompt cache, "
          "no step stopped midway (its rows could not be taken out again)")
MEMORY_KINDS = {
    "attention": "attention only: a slot's cache is cut back to any shared prefix",
    "sliding-window": "sliding-window layers keep their window only (as llama-server's): "
                      + _WHOLE,
    "hybrid": "a recurrent state beside attention: " + _WHOLE,
    "recurrent": "a recurrent state: " + _WHOLE,
}
_WINDOW_TAKEN_OUT = "a step's rows are one physical batch, which leaves the window whole when " \
                    "they are taken out"
_STATES_TAKEN_OUT = "llama.cpp keeps {n} earlier states per slot to take them out"


def memory_line(s: Settings, runner: LlamaRunner) -> str:
    """The start-up line on the model's memory and, where it cannot be cut back, its drafts."""
    kind = runner.memory_kind
    line = MEMORY_KINDS[kind]
    if kind == "attention" or not s.drafting:
        return line
    if runner.draft_rollback:
        how = _WINDOW_TAKEN_OUT if kind == "sliding-window" else _STATES_TAKEN_OUT
        return line + (f", drafts of up to {runner.draft_rollback} tokens a step ("
                       + how.format(n=runner.draft_rollback) + ")")
    if s.spec == "auto":
        return line + (", no drafting (greedy answers kept as llama-server's; --spec ngram "
                       "drafts: docs/flags.md)")
    return line + (", no drafting (llama.cpp keeps no earlier state for this family: drafted "
                   "rows could not be taken out)")


def new_runner(s: Settings, model_path: str, context: ContextChoice,
               prefill_budget: int) -> LlamaRunner:
    """The model loaded, with a cache of the chosen context and llama.cpp's batch sized for
    the largest prompt step."""
    return LlamaRunner(RunnerConfig(
        model_path=model_path, ctx_size=context.ctx_size, n_slots=s.parallel,
        n_batch=prefill_budget, n_threads=s.threads,
        n_gpu_layers=s.n_gpu_layers if context.n_gpu_layers is None else context.n_gpu_layers,
        main_gpu=s.main_gpu, tensor_split=s.tensor_split,
        tensor_overrides=placements(s.cpu_moe, max(s.n_cpu_moe, context.n_cpu_moe),
                                    s.override_tensor),
        cache_type_k=s.cache_type_k, cache_type_v=s.cache_type_v, flash_attn=s.flash_attn,
        swa_full=s.swa_full, kv_unified=s.kv_unified, draft_rollback=rollback_drafts(s),
        mmproj=str(find_model(s.mmproj, "--mmproj")) if s.mmproj else None))


def new_pool(s: Settings, runner: LlamaRunner, context: ContextChoice) -> SlotPool:
    """One pool of the context llama.cpp made (it may round -c up), each slot guaranteed
    its share; one request may use the model's trained context, at most the pool (with
    --no-kv-unified: its slot's stream)."""
    made = runner.pool_cells
    if made != context.ctx_size:
        log.info("llama.cpp made a cache of %d tokens for -c %d", made, context.ctx_size)
    trained = runner.n_ctx_train
    if s.ctx_size and trained and made > trained:
        log.warning("the pool (%d tokens) is longer than the model was trained for (%d): "
                    "one request may use %d", made, trained, trained)
    window = runner.n_swa if runner.memory_kind == "sliding-window" else 0
    return SlotPool(made, s.parallel, n_ctx_per_slot=min(made, trained or made),
                    cuts_back=runner.cuts_back, window=window, streams=not s.kv_unified,
                    rollback=runner.draft_rollback)


def new_prompt_cache(s: Settings, runner: LlamaRunner, model_id: str,
                     live_scope: Callable[[str | None], bool]) -> PromptCache | None:
    """--cache-ram MiB, at most a quarter of the RAM free now. Where sequences cannot be
    cut back, it holds whole sequences and checkpoints (PromptCache.whole_only)."""
    if s.cache_ram == 0 or s.scheduler != "continuous":
        return None
    bound = min(s.cache_ram * MIB, psutil.virtual_memory().available // 4)
    log.info("prompt cache in RAM: up to %d MiB (--cache-ram %d, at most a quarter of free "
             "RAM), per key unless --shared-prefix-cache", bound // MIB, s.cache_ram)
    disk = None
    if s.cache_disk:
        folder = state_dir(s) / "prompt-cache" / re.sub(r"[^\w.-]", "_", model_id)
        disk = DiskTier(folder, s.cache_disk * MIB, runner.state_fingerprint())
    cache = PromptCache(bound, disk, whole_only=not runner.cuts_back)
    if disk:
        gone = cache.keep_scopes(live_scope)
        log.info("prompt cache on disk: up to %d MiB in %s (--cache-disk), %d prompts kept "
                 "from before (%d of keys no longer in the key file deleted)",
                 s.cache_disk, disk.folder, len(cache.on_disk), gone)
    return cache


def template_source(s: Settings, runner: LlamaRunner, model_id: str) -> str:
    """--chat-template(-file), else the GGUF's own, else a built-in one (said in the log)."""
    source = override_source(s.chat_template, s.chat_template_file) or runner.chat_template
    if source is None:
        name, source = fallback_for(runner.meta("general.architecture"))
        log.warning("%s carries no chat template: using the built-in %s format (choose "
                    "another with --chat-template)", model_id, name)
    return source


def log_start_up(s: Settings, facts: dict, context: ContextChoice, runner: LlamaRunner,
                 template_text: str, limits: PoolLimits, shares: bool) -> None:
    """What the model is (`facts`: runner.describe(), with its id), where its weights went,
    its pool (`limits`: the scheduler's), memory, images, tool calls, the step's limits and the
    keys' shares: the lines an admin reads at start-up."""
    budget, prefill_budget = limits.max_num_batched_tokens, runner.config.n_batch
    backend = facts["backend"]
    log.info("model: %s (%s, %d layers, trained on %d tokens)", facts["model"]["id"],
             facts["model"]["description"], facts["model"]["n_layers"],
             facts["model"]["n_ctx_train"])
    log.info("backend: %s, %d layers offloaded", backend["name"], backend["n_gpu_layers"])
    if backend["tensors_overridden"]:
        log.info("weights placed by --cpu-moe, --n-cpu-moe or -ot: %s", ", ".join(
            f"{n} tensors to {where}" for where, n in backend["tensors_overridden"].items()))
    log.info("context: %d tokens, %s", limits.ctx_size, context.why)
    log.info("cache pool: %s", limits.split)
    log.info("memory: %s", memory_line(s, runner))
    if runner.projector is not None:
        log.info("images: read with the projector %s", s.mmproj)
    log.info("tool calls: %s", answer_formats.describe(template_text))
    log.info("scheduler: " + s.scheduler + ", --max-num-batched-tokens %d (%d while nothing "
             "decodes), --max-num-seqs %d, --max-queue %s", budget,
             max(prefill_budget, budget), limits.max_num_seqs, s.max_queue)
    if shares:
        log.info("shares per key: %s queue places, %s slots while others wait, %s "
                 "requests/s (burst %d), prefix cache %s", s.queue_share(), s.slot_share(),
                 s.rate_limit or "unlimited", s.rate_burst,
                 "shared across keys" if s.shared_prefix_cache else "per key")
