"""localserve bench: the knee logic on synthetic curves, and the command against two servers."""

import asyncio
import json
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from conftest import running
from localserve.bench.load import LevelSummary, make_workload
from localserve.bench.report import find_knee
from localserve.bench.office import document
from localserve.bench.same_text import same_text_speedup

ROOT = Path(__file__).resolve().parent.parent


def level(c, tput, p95):
    return LevelSummary(concurrency=c, requests=10, errors=0, wall_s=1, output_tok_s=tput,
                        prompt_tok_s=0, requests_s=1, ttft_p50=0, ttft_p95=0, itl_p50=0, itl_p95=0,
                        itl_max=0, e2e_p95=p95)


def test_knee_is_where_throughput_flattens_and_latency_climbs():
    curve = [level(1, 90, 1.0), level(4, 200, 1.3), level(16, 300, 2.0), level(32, 310, 4.1),
             level(64, 312, 8.0)]
    knee, reason = find_knee(curve)
    assert knee == 16 and "16 to 32" in reason


def test_no_knee_while_throughput_still_grows():
    knee, reason = find_knee([level(1, 90, 1.0), level(4, 200, 2.0), level(16, 420, 4.0)])
    assert knee is None and "still grew" in reason


def test_flat_throughput_with_flat_latency_is_not_a_knee():
    knee, _ = find_knee([level(1, 100, 1.0), level(4, 102, 1.05)])
    assert knee is None


def test_workload_is_seeded_mixed_and_heavy_tailed():
    jobs = make_workload(400, seed=3)
    assert jobs == make_workload(400, seed=3) and jobs != make_workload(400, seed=4)
    outs = sorted(j.max_tokens for j in jobs)
    assert outs[0] >= 16 and outs[-1] <= 128
    assert outs[len(outs) // 2] < 50 and outs[-1] > 100  # most short, a few long
    assert len({len(j.prompt) for j in jobs}) > 100


def test_doc_documents_differ_by_colleague_and_round():
    """Rounds of the doc workload measure different texts, not one prompt tuned on."""
    assert document(3, seed=1) == document(3, seed=1)
    assert len({document(c, seed) for c in range(3) for seed in range(3)}) == 9
    assert 900 <= len(document(0).split()) <= 1100  # about 1,050 tokens
    longer = document(0, paragraphs=19)  # longdoc's: about 1,800 tokens
    assert 1700 <= len(longer.split()) <= 1800 and longer[:200] != document(0)[:200]


def test_agents_prompts_are_seeded_and_past_a_slots_share():
    from localserve.bench.office import agent_prompt

    assert agent_prompt(1) == agent_prompt(1) != agent_prompt(2)
    assert json.loads(agent_prompt(0).split("# Tools\n")[1])[0]["type"] == "function"
    assert 15_000 <= len(agent_prompt(0)) <= 25_000  # about 5,000 tokens


def test_office_prompts_are_seeded_and_about_400_words():
    from localserve.bench.office import OFFICE_QUESTIONS, office_prompt

    assert office_prompt(1) == office_prompt(1) != office_prompt(2)
    assert 380 <= len(office_prompt(0).split()) <= 420 and len(OFFICE_QUESTIONS) == 4


@pytest.fixture(scope="module")
def second_server():
    with running("-c", "2048", "-np", "2", "-t", "2", log_name="second") as srv:
        yield srv


@pytest.mark.parametrize("which", ["server", "second_server"])
def test_bench_command_writes_json_and_png(which, request, tmp_path):
    url = request.getfixturevalue(which).url
    out = tmp_path / "out"
    run = subprocess.run([sys.executable, "-m", "localserve", "bench", "--url", url,
                          "--concurrency", "1,2", "--requests", "3", "--out", str(out)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    data = json.loads((out / "bench.json").read_text())
    assert [lv["concurrency"] for lv in data["levels"]] == [1, 2]
    assert all(lv["errors"] == 0 and lv["output_tok_s"] > 0 for lv in data["levels"])
    assert (out / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "operating limit" in run.stdout


def test_conversations_count_a_refused_turn_as_failed_not_as_a_fast_one(second_server):
    """An agent's ~4,100-token prompt on a 2,048-token server is refused: every turn is a
    failed turn, in neither turns per minute nor the first-token time (llama-server fails a
    full pool's requests inside a 200 stream; counted as turns, they read as a fast server).
    The office's ~600-token prompt on the same server is answered."""
    from localserve.bench.office import agents_workload, office_workload

    refused = asyncio.run(agents_workload(second_server.url, colleagues=2))
    assert refused["failed_turns"] == 8 and refused["turns_per_min"] == 0
    answered = asyncio.run(office_workload(second_server.url, colleagues=2, concurrency=2))
    assert answered["failed_turns"] == 0 and answered["turns_per_min"] > 0
    assert answered["followup_ttft_p50_s"] > 0


def test_bench_command_says_how_many_turns_failed(second_server, tmp_path):
    """`localserve bench --workload agents` on a server too small for the agent's prompt: the
    admin reads that every turn failed, not a speed."""
    run = subprocess.run([sys.executable, "-m", "localserve", "bench", "--url", second_server.url,
                          "--workload", "agents", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    assert "agents: 0.0 turns/min" in run.stdout and "16 turns FAILED" in run.stdout


def test_bench_longdoc_answers_every_turn_of_documents_longer_than_a_slots_share(server,
                                                                                tmp_path):
    """`localserve bench --workload longdoc`: ~1,800-token documents on 1,024-token shares of a
    4,096-token pool, two colleagues at once: borrowed cells, every turn answered, reused."""
    run = subprocess.run([sys.executable, "-m", "localserve", "bench", "--url", server.url,
                          "--workload", "longdoc", "--requests", "2", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    assert "longdoc: " in run.stdout and "FAILED" not in run.stdout
    result = json.loads((tmp_path / "bench-longdoc.json").read_text())["results"]
    assert result["failed_turns"] == 0 and result["prompt_tokens"] > 3 * 2 * 1750
    assert result["cached_tokens"] > 2 * 2 * 1750  # each follow-up reuses its document


def test_bench_copy_reports_what_the_drafts_did(second_server, tmp_path):
    """`localserve bench --workload copy`: an admin sees on their own machine what speculative
    decoding does: drafted tokens, the share kept, and the measured step costs behind them."""
    run = subprocess.run([sys.executable, "-m", "localserve", "bench", "--url", second_server.url,
                          "--workload", "copy", "--concurrency", "1", "--requests", "2",
                          "--out", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    assert "copy at concurrency 1:" in run.stdout and "tokens drafted" in run.stdout
    assert "step milliseconds, by batch rows: 1:" in run.stdout
    assert "by kind (tok/s of each answer): python " in run.stdout  # texts of kinds, not ours
    result = json.loads((tmp_path / "bench-copy.json").read_text())["results"]["1"]
    assert result["completion_tokens"] > 0 and result["tokens_per_step"] >= 1
    assert list(result["kinds"]) == ["python", "c"]  # --requests 2: the first two kinds
    assert all(kind["lookup_ceiling"] >= 1.0 for kind in result["kinds"].values())
    assert "drafting's ceiling on decoding, by kind" in run.stdout


def test_copy_runs_are_compared_on_the_beginning_both_answers_share():
    """Greedy answers differ between servers (batches change llama.cpp's numbers), so each
    side is timed to the end of the text both wrote: mine wrote "abcd" by 1 s, theirs by 2 s,
    whatever came after, and each decoded it in 0.5 s after its first piece (their prefill was
    the slower); an answer with nothing in common counts for its share only."""
    mine = [{"kind": "python", "text": "abcdXY", "marks": [(2, 0.5), (4, 1.0), (6, 9.0)]},
            {"kind": "csv", "text": "xyz", "marks": [(3, 1.0)]}]
    theirs = [{"kind": "python", "text": "abcdZ", "marks": [(1, 1.5), (3, 1.8), (5, 2.0)]},
              {"kind": "csv", "text": "q", "marks": [(1, 0.1)]}]
    got = same_text_speedup(mine, theirs)
    # decoding, from each side's first piece: mine 0.5 s (0.5 to 1.0), theirs 0.5 s (1.5 to 2.0)
    assert got["python"] == {"speedup": 2.0, "decoding": 1.0, "chars": 4, "share": 4 / 6}
    assert got["csv"] == {"speedup": None, "decoding": None, "chars": 0, "share": 0.0}
    assert got["all"] == {"speedup": 2.0, "decoding": 1.0, "chars": 4, "share": 4 / 9}


def test_copy_speed_by_kind_counts_decoding_from_each_answers_first_piece():
    """Each side's own whole answers: 11 tokens after the first piece in 2 s (a 1 s prefill
    left out), next to the tok/s from the request; an answer of one piece decoded nothing."""
    from localserve.bench.office import Streamed, speed_by_kind

    def answer(marks, seconds):
        return Streamed("", marks, {}, {}, False, seconds)
    done = [("csv", 12, answer([(5, 1.0), (20, 2.0), (40, 3.0)], 3.0)),
            ("json", 1, answer([(3, 0.5)], 0.5))]
    got = speed_by_kind(done)
    assert got["csv"] == {"tokens": 12, "seconds": 3.0, "tok_s": 4.0, "decoding_tok_s": 5.5}
    assert got["json"] == {"tokens": 1, "seconds": 0.5, "tok_s": 2.0, "decoding_tok_s": None}


def test_a_run_goes_on_from_the_best_place_in_the_context_and_into_its_own_copy():
    from localserve.bench.ceiling import longest_run

    prompt = [7, 1, 2, 3, 9, 1, 2, 3, 4, 5]
    assert longest_run(prompt, [0, 1, 2, 3, 4, 6], 1) == 4  # the second 1 2 3, not the first
    assert longest_run(prompt, [0, 8, 1], 1) == 0  # 8 is nowhere
    # a table whose row repeats: "5 1" was seen, and the copy runs on into what it writes
    assert longest_run([5, 1], [5, 1, 5, 1, 5, 1, 5], 2) == 5


def test_the_lookup_ceiling_prices_foresight_drafts_by_the_measured_steps():
    """An answer copying its prompt: one token a step costs 10 ms each; with a 64-row step
    at 20 ms, foresight drafts take 63 tokens a step. An answer found nowhere: no gain."""
    from localserve.bench.ceiling import lookup_ceiling, step_cost

    cost = step_cost({"1": 10.0, "64": 20.0})
    assert abs(cost(1) - 0.010) < 1e-12 and abs(cost(32) - (0.010 + 0.010 * 31 / 63)) < 1e-12
    assert abs(cost(128) - 0.040) < 1e-12  # past the largest: its cost per row
    prompt = list(range(1000, 1300))
    drafted, plain = lookup_ceiling(prompt, prompt[:1] + prompt[1:200], cost)
    assert abs(plain - 199 * 0.010) < 1e-9
    assert abs(drafted - (3 * 0.020 + cost(1 + 6))) < 1e-9  # 64 tokens a step, 3 times, then 7
    fresh = list(range(5000, 5100))
    drafted, plain = lookup_ceiling(prompt, fresh, cost)
    assert abs(drafted - 99 * 0.010) < 1e-9 and abs(plain - 99 * 0.010) < 1e-9
    # a step table where no draft pays (a busy machine's): never below 1 by a rounding
    flat = step_cost({"1": 7.3, "2": 14.6, "64": 7.3 * 64})
    drafted, plain = lookup_ceiling(prompt, prompt[:1] + prompt[1:200], flat)
    assert plain / drafted >= 1.0


def test_the_copy_corpus_has_every_kind_none_from_this_repository_and_varies_by_seed():
    from localserve.bench.corpus import KINDS, copy_corpus

    texts = copy_corpus(seed=1)
    headers = Path(sysconfig.get_paths()["include"], "Python.h").is_file()
    kinds = [k for k in KINDS if k != "c" or headers]  # C headers: where Python ships them
    assert [t.kind for t in texts] == kinds * 2
    ours = "\n".join(p.read_text() for p in (ROOT / "localserve").rglob("*.py"))
    assert not any(t.text.strip() and t.text in ours for t in texts)
    assert [t.text for t in copy_corpus(seed=1)] == [t.text for t in texts]
    assert [t.text for t in copy_corpus(seed=2)] != [t.text for t in texts]


def gguf_header(tmp_path: Path, strings: dict[str, str]) -> Path:
    """A GGUF file's header: the given string keys, between an array and a number."""
    import struct

    def text(s: str) -> bytes:
        return struct.pack("<Q", len(s.encode())) + s.encode()
    body = text("tokenizer.ggml.tokens") + struct.pack("<IIQ", 9, 8, 2) + text("a") + text("bc")
    for key, value in strings.items():
        body += text(key) + struct.pack("<I", 8) + text(value)
    body += text("general.alignment") + struct.pack("<II", 4, 32)
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, len(strings) + 2) + body)
    return path


def test_the_peer_gets_the_template_localserve_falls_back_to_where_the_file_has_none(tmp_path):
    """bench/office.py hands llama-server this as --chat-template-file: a Gemma file
    without a template is answered with Gemma's turns by localserve and with ChatML by
    llama-server's own fallback, different prompts and so different answers."""
    from localserve.models.gguf_meta import string_metadata, template_for_peer
    from localserve.common.config import resolve_model
    from localserve.models.chat_template import BUILTIN
    gemma = gguf_header(tmp_path, {"general.architecture": "gemma3"})
    assert string_metadata(gemma) == {"general.architecture": "gemma3"}
    assert template_for_peer(gemma) == BUILTIN["gemma"]
    embedded = resolve_model(None)  # SmolLM2 carries its own: both servers use it
    assert string_metadata(embedded)["general.architecture"] == "llama"
    assert template_for_peer(embedded) is None
    with pytest.raises(ValueError):
        string_metadata(Path(__file__))
