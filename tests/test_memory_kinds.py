"""Models whose cache cannot be cut back to a prefix, served with the defaults through the real
server: two hybrid models (random weights, scripts/make-memory-model: LFM2's shape, a convolution
state beside attention; Granite 4's, a Mamba-2 state beside attention) and a sliding-window one (Gemma 3 270M, scripts/setup-second-model).
A conversation's follow-up, Regenerate, its first turn again and its next turn after seven
colleagues took every slot all reuse cached tokens and answer as without the cache; n > 1 and
six colleagues at once are answered; the start-up log and /props say which memory the model has."""

from __future__ import annotations

import asyncio
import dataclasses
import sys
import subprocess
from pathlib import Path

import httpx
import pytest

from conftest import ROOT, free_port, running
from localserve.common.config import Settings
from localserve.models.resources import cache_needs

GEMMA = ROOT / "models" / "gemma-3-270m-q4_k_m.gguf"
FRESH = [f"fresh{i}-key-0123456789" for i in range(2)]  # keys whose cache starts empty
ALICE, CAROL = "alice-key-0123456789", "carol-key-0123456789"
SYSTEM = "You answer the office's questions about its rooms, its printers and its schedule. " * 4


def memory_model(kind: str) -> Path:
    return Path(subprocess.run([str(ROOT / "scripts/make-memory-model"), kind], check=True,
                               text=True, capture_output=True).stdout.strip())


# The model each served kind is tried on, and the memory /props names for it.
KINDS = {"hybrid": "hybrid", "hybrid-mamba": "hybrid", "sliding-window": "sliding-window"}


@pytest.fixture(scope="module", params=list(KINDS))
def served(request):
    if request.param == "sliding-window" and not GEMMA.is_file():
        pytest.skip("no Gemma 3 270M: scripts/setup-second-model")
    path = GEMMA if request.param == "sliding-window" else memory_model(request.param)
    keys = [arg for key in (ALICE, CAROL, *FRESH) for arg in ("--api-key", key)]
    with running("-m", str(path), "-c", "4096", "-np", "4", "-t", "2", *keys,
                 log_name=f"memory-{request.param}") as srv:
        yield request.param, srv


def chat(srv, messages, key=ALICE, n=1):
    r = httpx.post(srv.url + "/v1/chat/completions", timeout=300,
                   headers={"Authorization": f"Bearer {key}"},
                   json={"messages": messages, "max_tokens": 16, "temperature": 0, "n": n})
    assert r.status_code == 200, r.text
    body = r.json()
    return [c["message"]["content"] for c in body["choices"]], \
        body["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_a_conversation_reuses_its_cache_and_answers_as_without_it(served):
    """Equal greedy text where both sides computed the same rows in the same calls: a row
    decoded alone and the same row in a prompt's batch may differ in the last bits (llama.cpp's
    kernels), which a weak or random model's near-ties turn into another token. So a follow-up
    is compared with Regenerate (the prompt's checkpoint restored), turn 1 with turn 1 again,
    and turn 3 after an eviction with the same conversation on a key never evicted."""
    kind, srv = served
    turn1 = [{"role": "system", "content": SYSTEM},
             {"role": "user", "content": "Which printer is on the second floor?"}]
    (answer1,), cached = chat(srv, turn1)
    assert cached == 0 and chat(srv, turn1, key=FRESH[0]) == ([answer1], 0)
    turn2 = turn1 + [{"role": "assistant", "content": answer1},
                     {"role": "user", "content": "And who books the meeting rooms?"}]
    (answer2,), cached = chat(srv, turn2)
    assert cached > 0
    for what, messages, answer in (("regenerate", turn2, answer2), ("turn 1 again", turn1, answer1)):
        assert chat(srv, messages)[0] == [answer], what
        assert chat(srv, messages)[1] > 0, what
    turn3 = turn2 + [{"role": "assistant", "content": answer2},
                     {"role": "user", "content": "Thanks. When does the office close?"}]
    never_evicted = [chat(srv, turn, key=FRESH[1])[0] for turn in (turn1, turn2, turn3)][-1]
    asyncio.run(colleagues(srv, CAROL, 7))  # every slot taken: conversations saved
    answers, cached = chat(srv, turn3)
    assert cached > 0 and answers == never_evicted
    two, cached = chat(srv, turn3, n=2)  # both choices restore the prompt's checkpoint
    assert two == answers * 2 and cached > 0
    assert "Traceback" not in srv.log()


async def colleagues(srv, key: str, count: int) -> list[int]:
    async with httpx.AsyncClient(timeout=300) as client:
        async def one(i):
            r = await client.post(srv.url + "/v1/chat/completions",
                                  headers={"Authorization": f"Bearer {key}"},
                                  json={"messages": [{"role": "user", "content": f"Colleague {i} "
                                                      f"asks about room {i * 7}."}],
                                        "max_tokens": 8, "temperature": 0})
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["message"]["content"]
            return r.status_code
        return await asyncio.gather(*[one(i) for i in range(count)])


def test_six_colleagues_at_once_are_all_answered(served):
    _, srv = served
    assert asyncio.run(colleagues(srv, CAROL, 6)) == [200] * 6


def test_the_log_and_props_say_what_memory_the_model_has_and_what_it_gets(served):
    kind, srv = served
    props = httpx.get(srv.url + "/props", headers={"Authorization": f"Bearer {ALICE}"}).json()
    assert props["model"]["memory"] == KINDS[kind]
    said = {"hybrid": "memory: a recurrent state beside attention: a slot's cache is reused whole",
            "sliding-window": "memory: sliding-window layers keep their window only"}
    assert said[KINDS[kind]] in srv.log()
    assert "no drafting (greedy answers kept as llama-server's" in srv.log()  # --spec auto
    assert props["default_generation_settings"]["params"]["speculative"] is False
    assert props["context"]["kv_fixed_bytes"] > 0  # window cells or recurrent states
    assert "MiB of it whatever -c: windows and recurrent states" in srv.log()


def test_the_memory_check_sizes_each_kind_as_llama_cpp_allocates_it():
    """Before loading, the caches are sized as llama.cpp will make them (runner.memory_needs,
    through resources.cache_needs with the server's settings). Gemma 3 270M at -c 32768 with
    4 slots: 96 MiB for its 3 global layers and 37.5 MiB for its 15 window layers' windows,
    llama-server's own log for these settings (133.5 MiB, not every layer at full length,
    576 MiB). The Mamba-2 hybrid: only its 2 attention layers grow with the context, and each
    slot's state (the convolution and the SSM state of 4 layers, f32) is counted once; the LFM2
    one's, with the earlier states kept for drafts."""
    settings = Settings(ctx_size=32768, parallel=4)
    mamba = cache_needs(settings, str(memory_model("hybrid-mamba")), 32768, False)
    assert mamba["kv_bytes_per_token"] == 2 * 2 * 32 * 2 * 2  # layers, heads, head size, K+V, f16
    state = 4 * 4 * 4 * (3 * (256 + 2 * 16) + 16 * 256)  # layers, slots, f32, conv + SSM
    assert mamba["kv_fixed_bytes"] == pytest.approx(state, rel=0.02)
    assert mamba["kv_bytes"] == 32768 * mamba["kv_bytes_per_token"] + mamba["kv_fixed_bytes"]
    # LFM2's: drafting keeps 8 earlier convolution states beside each slot's (9 in all; the
    # report's MiB has two decimals), --spec off none
    lfm2 = [cache_needs(dataclasses.replace(settings, spec=spec), str(memory_model("hybrid")),
                        32768, False)["kv_fixed_bytes"] for spec in ("ngram", "off")]
    assert lfm2[0] > 6 * lfm2[1] > 0
    if GEMMA.is_file():
        assert cache_needs(settings, str(GEMMA), 32768, False)["kv_bytes"] == 133.5 * 1024 ** 2
        # --no-kv-unified: a stream per slot, llama.cpp's report one stream's cells: the
        # global layers the same 96 MiB, each stream a window of 1,024 cells (60 MiB)
        streams = cache_needs(dataclasses.replace(settings, kv_unified=False), str(GEMMA),
                              32768, False)
        assert streams["kv_bytes_per_token"] == 96 * 1024 ** 2 / 32768
        assert streams["kv_fixed_bytes"] == 60 * 1024 ** 2


def test_experts_kept_in_host_memory_by_flag_give_the_same_answer():
    """--n-cpu-moe and -ot as llama-server spells them: llama.cpp's loader places the experts'
    tensors (counted from its own report), and the greedy answer is the answer without them;
    a buffer type the build lacks stops the start with the ones it has."""
    path = str(memory_model("hybrid-moe"))
    question = [{"role": "user", "content": "Which printer is on the second floor?"}]
    answers = {}
    for flags, moved in (((), 0), (("--n-cpu-moe", "6"), 12),  # layers 2-5 have experts
                         (("-ot", r"blk\.[23]\.ffn_.*_exps=CPU"), 6)):
        with running("-m", path, "-c", "2048", "-np", "2", "-t", "2", *flags,
                     log_name="memory-moe") as srv:
            answers[flags] = chat(srv, question)[0]
            placed = httpx.get(srv.url + "/props").json()["backend"]["tensors_overridden"]
            assert sum(placed.values()) == moved
            assert set(placed) <= {"CPU", "CPU_REPACK"}  # host memory
    assert len(set(map(tuple, answers.values()))) == 1
    for placement, says in (("exps=NOPE", "no buffer type named NOPE for --override-tensor "
                                          "(this build has: CPU"),
                            ("exps", "'exps' is not PATTERN=BUFFER")):
        started = subprocess.run([sys.executable, "-m", "localserve", "up", "-m", path, "-ot",
                                  placement, "--port", str(free_port())], capture_output=True,
                                 text=True, timeout=120, cwd=ROOT)
        assert started.returncode != 0 and says in started.stderr, started.stderr[-500:]


def test_swa_full_serves_a_window_model_as_attention_with_drafting():
    """llama-server's --swa-full: window layers keep every position, so the model is served as
    a pure-attention one (drafting, prefixes cut back)."""
    if not GEMMA.is_file():
        pytest.skip("no Gemma 3 270M: scripts/setup-second-model")
    with running("-m", str(GEMMA), "-c", "2048", "-np", "2", "-t", "2", "--swa-full",
                 log_name="memory-swa-full") as srv:
        assert httpx.get(srv.url + "/props").json()["model"]["memory"] == "attention"
        assert "memory: attention only" in srv.log() and "no drafting" not in srv.log()
