"""The model fitted to GPU memory (models/fit.py, llama-server's --fit), pure: a table of fake
devices and two real models' sizes (as their Q4_K_M files have them). Every choice leaves
FIT_MARGIN free on each device, and is the largest that does (256 more tokens, or one more
layer, would not fit)."""

import pytest

from localserve.models.fit import FIT_MARGIN, FIT_MIN_CTX, Device, FitError, ModelSize, fit, needs

GIB = 1024 ** 3
# Llama 3.1 8B Instruct Q4_K_M: 32 layers, Q4_K embeddings, Q6_K output, 8 KV heads of 128
LLAMA_8B = ModelSize(layers=(131_000_000,) * 32, output=431_000_000, embeddings=295_500_000,
                     kv_per_token=32 * 8 * 128 * 2 * 2, n_ctx_train=131_072, n_vocab=128_256,
                     n_embd=4096)
# Qwen2.5 14B Instruct Q4_K_M: 48 layers
QWEN_14B = ModelSize(layers=(164_900_000,) * 48, output=638_000_000, embeddings=438_000_000,
                     kv_per_token=48 * 8 * 128 * 2 * 2, n_ctx_train=32_768, n_vocab=152_064,
                     n_embd=5120)


def card(gib, name="CUDA0", unified=False):
    return Device(name, int(gib * GIB), unified)


def fits(model, devices, ctx, ngl, split=()):
    return all(n <= d.free - FIT_MARGIN for n, d in zip(needs(model, devices, split, ctx, ngl), devices))


def assert_largest(model, devices, chosen, split=()):
    assert fits(model, devices, chosen.ctx_size, chosen.n_gpu_layers, split)
    assert list(chosen.needs) == needs(model, devices, split, chosen.ctx_size, chosen.n_gpu_layers)


def test_a_24_gb_card_holds_llama_8b_at_its_whole_trained_context():
    chosen = fit(LLAMA_8B, [card(23)])
    assert (chosen.ctx_size, chosen.n_gpu_layers) == (131_072, 33)
    assert "trained context" in chosen.why
    assert_largest(LLAMA_8B, [card(23)], chosen)


def test_a_16_gb_card_lowers_llama_8bs_context_first_and_keeps_every_layer():
    devices = [card(15)]
    chosen = fit(LLAMA_8B, devices)
    assert FIT_MIN_CTX < chosen.ctx_size < 131_072 and chosen.n_gpu_layers == 33
    assert not fits(LLAMA_8B, devices, chosen.ctx_size + 256, 33)
    assert "context lowered from 131072" in chosen.why
    assert_largest(LLAMA_8B, devices, chosen)


def test_an_8_gb_card_takes_fewer_layers_of_a_14b_model_at_the_fit_context():
    devices = [card(7.5)]
    assert not fits(QWEN_14B, devices, FIT_MIN_CTX, 49)
    chosen = fit(QWEN_14B, devices)
    assert chosen.ctx_size == FIT_MIN_CTX and 0 < chosen.n_gpu_layers < 49
    assert not fits(QWEN_14B, devices, FIT_MIN_CTX, chosen.n_gpu_layers + 1)
    assert f"{chosen.n_gpu_layers} of 49 layers on the GPU" in chosen.why
    assert_largest(QWEN_14B, devices, chosen)


def test_a_12_gb_card_serves_a_14b_model_with_a_lowered_context():
    chosen = fit(QWEN_14B, [card(11)])
    assert FIT_MIN_CTX <= chosen.ctx_size < 32_768 and chosen.n_gpu_layers == 49


@pytest.mark.parametrize("split,expected", [((3.0, 1.0), (24, 8)), ((), (16, 16))])
def test_two_cards_share_the_layers_by_tensor_split_else_by_free_memory(split, expected):
    devices = [card(11, "CUDA0"), card(11, "CUDA1")]
    chosen = fit(LLAMA_8B, devices, split=split)
    per_layer = LLAMA_8B.layers[0] + LLAMA_8B.kv_per_token // 32 * chosen.ctx_size
    assert chosen.needs[0] > chosen.needs[1] if split else chosen.needs[0] < chosen.needs[1]
    output = LLAMA_8B.output + 512 * LLAMA_8B.n_vocab * 4  # and its logits, on the last card
    assert chosen.needs[0] - chosen.needs[1] == (expected[0] - expected[1]) * per_layer - output
    assert_largest(LLAMA_8B, devices, chosen, split)


def test_apples_unified_memory_counts_what_stays_on_the_cpu_too():
    """On unified memory, moving layers to the CPU frees nothing: the host's share is the same
    RAM. The embeddings (always host-side) count against the device."""
    devices = [card(12, "Metal", unified=True)]
    chosen = fit(LLAMA_8B, devices)
    discrete = fit(LLAMA_8B, [card(12)])
    assert chosen.ctx_size < discrete.ctx_size and chosen.n_gpu_layers == 33
    assert chosen.needs[0] - needs(LLAMA_8B, [card(12)], (), chosen.ctx_size, 33)[0] \
        == LLAMA_8B.embeddings


def test_a_context_given_is_kept_and_the_layers_lowered_to_fit():
    chosen = fit(LLAMA_8B, [card(11)], ctx_given=65_536)
    assert chosen.ctx_size == 65_536 and 0 < chosen.n_gpu_layers < 33
    assert "33 layers" in chosen.why and "--fit-ctx" not in chosen.why


def test_layers_given_are_kept_and_the_context_lowered_to_fit():
    chosen = fit(LLAMA_8B, [card(11)], ngl_given=20)
    assert chosen.n_gpu_layers == 20 and chosen.ctx_size < 131_072


def test_a_context_and_layers_given_that_do_not_fit_are_refused_with_the_numbers():
    with pytest.raises(FitError) as refused:
        fit(LLAMA_8B, [card(11)], ctx_given=131_072, ngl_given=33)
    message = str(refused.value)
    assert "-c 131072 and -ngl 33" in message and "CUDA0 needs" in message
    assert "11.00 GiB free" in message and "about -c" in message and "about -ngl" in message


def test_what_fits_as_given_is_kept_as_given():
    chosen = fit(LLAMA_8B, [card(23)], ctx_given=8192, ngl_given=10)
    assert (chosen.ctx_size, chosen.n_gpu_layers) == (8192, 10)
    assert "-c 8192 and -ngl 10 fit" in chosen.why


def gpus(monkeypatch, *free_gib):
    import localserve.engine.runner as runner
    monkeypatch.setattr(runner, "offload_devices", lambda: [
        {"name": f"CUDA{i}", "free": int(g * GIB), "unified": False} for i, g in enumerate(free_gib)])


def test_the_start_fits_the_model_to_the_gpus_llama_cpp_lists(monkeypatch):
    """resources.choose_context with the devices the runner reports (faked: no GPU here) and
    the real file's tensors: the chosen layers go to the runner, the numbers to /props."""
    from localserve.common.config import Settings, resolve_model
    from localserve.models.resources import choose_context

    gpus(monkeypatch, 8)
    path = str(resolve_model(None))
    choice = choose_context(Settings(), path, gpu_offload=True)
    assert choice.ctx_size == choice.n_ctx_train and choice.n_gpu_layers == 31
    assert choice.as_json()["devices"][0]["name"] == "CUDA0" and "fit GPU memory" in choice.why
    assert choose_context(Settings(), path, gpu_offload=False).n_gpu_layers is None


def test_a_start_whose_context_cannot_fit_the_gpu_stops_with_the_numbers(monkeypatch):
    from localserve.common.config import Settings, SettingsError, resolve_model
    from localserve.models.resources import choose_context

    gpus(monkeypatch, 1.5)
    with pytest.raises(SettingsError, match=r"-c 1000000 and -ngl 31 do not fit .*CUDA0 needs"):
        choose_context(Settings(ctx_size=1_000_000, n_gpu_layers=31), str(resolve_model(None)), True)
    kept = choose_context(Settings(ctx_size=1_000_000, n_gpu_layers=31, memory_check=False),
                          str(resolve_model(None)), True)
    assert kept.ctx_size == 1_000_000 and "--no-memory-check" in kept.why


def test_an_image_projector_on_the_gpu_leaves_less_for_the_context():
    """llama-server's fit counts the projector (mtmd's weights and compute buffer) too: without
    it a multimodal model fitted to the last byte ran out of memory at its first image."""
    seeing = ModelSize(**{**LLAMA_8B.__dict__, "projector": 2 * GIB})
    blind, chosen = fit(LLAMA_8B, [card(15)]), fit(seeing, [card(15)])
    assert chosen.ctx_size < blind.ctx_size and chosen.n_gpu_layers == 33
    assert chosen.needs[0] - needs(LLAMA_8B, [card(15)], (), chosen.ctx_size, 33)[0] == 2 * GIB
    assert_largest(seeing, [card(15)], chosen)
    assert needs(seeing, [card(15)], (), 4096, 0) == needs(LLAMA_8B, [card(15)], (), 4096, 0)


def test_the_projector_counted_is_its_file_and_an_encoders_buffer(tmp_path):
    from localserve.common.config import Settings
    from localserve.models.fit import PROJECTOR_COMPUTE
    from localserve.models.resources import projector_bytes

    mmproj = tmp_path / "mmproj-tiny.gguf"
    mmproj.write_bytes(b"GGUF" + bytes(1000))
    assert projector_bytes(Settings(mmproj=str(mmproj))) == 1004 + PROJECTOR_COMPUTE
    assert projector_bytes(Settings()) == 0


# gpt-oss-20b (MXFP4): 24 layers, each ~480 MB of which ~450 MB are its 32 experts
GPT_OSS_20B = ModelSize(layers=(480_000_000,) * 24, output=580_000_000, embeddings=580_000_000,
                        kv_per_token=24 * 8 * 64 * 2 * 2, n_ctx_train=131_072, n_vocab=201_088,
                        n_embd=2880, experts=(450_000_000,) * 24)


def test_a_mixture_of_experts_keeps_its_context_on_a_16_gb_card_with_the_fewest_experts_moved():
    """llama-server's fit: the experts of the first layers go to host memory before the
    context is lowered; as few layers' as it takes."""
    devices = [card(15.5)]
    chosen = fit(GPT_OSS_20B, devices)
    assert chosen.ctx_size == 131_072 and chosen.n_gpu_layers == 25
    assert 0 < chosen.n_cpu_moe < 24 and f"--n-cpu-moe {chosen.n_cpu_moe}" in chosen.why
    assert list(chosen.needs) == needs(GPT_OSS_20B, devices, (), 131_072, 25, chosen.n_cpu_moe)
    one_less = needs(GPT_OSS_20B, devices, (), 131_072, 25, chosen.n_cpu_moe - 1)
    assert one_less[0] > devices[0].free - FIT_MARGIN and chosen.needs[0] <= devices[0].free - FIT_MARGIN


def test_experts_placed_by_flag_are_kept_and_a_dense_model_moves_none():
    devices = [card(15.5)]
    every = fit(GPT_OSS_20B, devices, moe=24)  # --cpu-moe
    assert (every.ctx_size, every.n_cpu_moe) == (131_072, 24)
    assert every.needs[0] < fit(GPT_OSS_20B, devices, moe=4).needs[0]
    assert fit(QWEN_14B, [card(11)]).n_cpu_moe == 0  # no experts: the context is lowered
    small = fit(GPT_OSS_20B, [card(6)])  # every expert moved, then the context lowered
    assert small.n_cpu_moe == 24 and small.ctx_size < 131_072 and "experts of 24 layers" in small.why


def test_a_hybrids_recurrent_states_count_whatever_the_context():
    """A hybrid's cache is mostly its recurrent states (one per slot, whatever the context:
    runner.memory_needs' kv_fixed) and a little attention per token: the fit counts both, so
    a state that fills the card leaves less for layers, never a context that cannot load."""
    attention_only = ModelSize(layers=(131_000_000,) * 32, output=431_000_000,
                               embeddings=295_500_000, kv_per_token=4 * 8 * 128 * 2 * 2,
                               n_ctx_train=131_072, n_vocab=128_256, n_embd=4096)
    hybrid = ModelSize(**{**attention_only.__dict__, "kv_fixed": 11 * GIB})
    assert fit(attention_only, [card(15)]).n_gpu_layers == 33
    chosen = fit(hybrid, [card(15)])
    assert chosen.ctx_size == FIT_MIN_CTX and chosen.n_gpu_layers < 33
    assert sum(needs(hybrid, [card(15)], (), FIT_MIN_CTX, 33)) > \
        sum(needs(attention_only, [card(15)], (), FIT_MIN_CTX, 33)) + 10.9 * GIB
    assert_largest(hybrid, [card(15)], chosen)


@pytest.mark.parametrize("ctx_size", [0, 2048])
def test_the_start_reads_the_files_cache_figures_once_at_the_chosen_context(monkeypatch, ctx_size):
    """Choosing the context and checking memory at it ask llama.cpp once (each ask reads the
    file's header: 0.5-0.8 s on Gemma 3); the figures carried are those at the chosen context,
    and a choice of another context than asked asks again at it."""
    from dataclasses import replace

    from localserve.common.config import Settings, resolve_model
    from localserve.engine import runner
    from localserve.models.resources import check_memory, choose_context, needs_at

    asked = []
    real = runner.memory_needs
    monkeypatch.setattr(runner, "memory_needs", lambda path, ctx, *a, **kw: asked.append(ctx)
                        or real(path, ctx, *a, **kw))
    settings, path = Settings(ctx_size=ctx_size), str(resolve_model(None))
    choice = choose_context(settings, path, gpu_offload=False)
    check_memory(settings, path, False, choice)
    assert asked == [ctx_size]
    assert choice.needs == real(path, choice.ctx_size, n_seq=settings.parallel,
                                n_batch=settings.prefill_token_budget(False))
    other = replace(choice, ctx_size=1024, needs=None)
    assert needs_at(settings, path, other, False)["kv_bytes"] < choice.needs["kv_bytes"]
    assert asked == [ctx_size, 1024]
