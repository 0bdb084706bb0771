"""The writers, pure (no model): each API shape written from the pieces of events a pure
scheduler emitted (fakes.ScriptedChoices). Their counts, stop types and texts come from the
pieces alone (answer.py), so these pin what every client reads at the end of an answer."""

import asyncio
import json
import time

from fakes import EventChoices, ScriptedChoices

from localserve.api.answer import ChoiceReader, Finish, Timings, Usage, whole_answers
from localserve.api.message_reply import MessageReply
from localserve.api.native_reply import NativeReply
from localserve.api.ollama_reply import OllamaReply
from localserve.api.replies import Reply, usage
from localserve.api.response_reply import ResponseReply
from localserve.api.routes_native import NativeCompletion
from localserve.api.routes_responses import ResponsesRequest
from localserve.api.schemas import ChatCompletionRequest, CompletionRequest, OpenAIError
from localserve.engine.request import Request, SamplingParams, TokenEvent

HELLO = [7, 4, 11, 11, 14, 0]  # "hello", then end-of-generation (fakes.FakeVocab)
HEY = [7, 4, 24, 0]  # "hey"


def whole(reply_collect, choices):
    return asyncio.run(reply_collect(choices, None))


def events(generator) -> list:
    async def drain():
        return [item async for item in generator]
    return asyncio.run(drain())


def handcrafted(events: list) -> EventChoices:
    """One choice answering with these events (fakes.EventChoices)."""
    return EventChoices([Request([1, 2, 3], SamplingParams(), request_id="r")],
                        [(0, event) for event in events])


def chat(**extra) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], **extra)


def test_the_end_piece_carries_counts_stop_type_timings_and_tokens():
    for scripts, max_tokens, stop, text, kind in [
            (HELLO, 100, (), "hello", "eos"), (HELLO, 3, (), "hel", "limit"),
            (HELLO, 100, ("ll",), "he", "word")]:
        choices = ScriptedChoices({"a": scripts}, n_prompt=4, max_tokens=max_tokens, stop=stop)
        [answer] = asyncio.run(whole_answers(choices, [ChoiceReader()], None))
        end = answer.end
        assert (answer.text, end.stop) == (text, kind)
        assert end.reason == ("length" if kind == "limit" else "stop")
        n_out = {"eos": 6, "limit": 3, "word": 4}[kind]
        assert end.usage == Usage(4, n_out, 0, 0) and end.tokens == tuple(HELLO[:n_out])
        assert isinstance(end.timings, Timings) and min(end.timings.__dict__.values()) >= 0
        assert choices.cancelled  # the reader leaves: whatever still runs is cancelled


def test_chat_completion_whole_n_choices_and_their_summed_usage():
    choices = ScriptedChoices({"a": HELLO, "b": HEY}, n_prompt=5)
    body = whole(Reply("chat.completion", "m", chat(n=2), "fp").collect, choices)
    assert [(c["index"], c["message"]["content"], c["finish_reason"]) for c in body["choices"]] \
        == [(0, "hello", "stop"), (1, "hey", "stop")]
    assert body["object"] == "chat.completion" and body["model"] == "m"
    assert body["system_fingerprint"] == "fp" and body["id"].startswith("chatcmpl-")
    assert body["choices"][0]["message"]["role"] == "assistant"
    assert body["usage"] == {"prompt_tokens": 10, "completion_tokens": 10, "total_tokens": 20,
                             "prompt_tokens_details": {"cached_tokens": 0},
                             "completion_tokens_details": {"reasoning_tokens": 0}}


def test_text_completion_whole_with_its_echoed_prefix():
    reply = Reply("text_completion", "m", CompletionRequest(model="m", prompt="x"), "fp")
    reply.prefix = "x"
    body = whole(reply.collect, ScriptedChoices({"a": HELLO}, max_tokens=2))
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert body["choices"] == [{"index": 0, "text": "xhe", "logprobs": None,
                                "finish_reason": "length"}]


def test_chat_stream_role_first_text_then_the_finish_alone_then_usage_and_done():
    reply = Reply("chat.completion", "m", chat(stream=True, stream_options={"include_usage": True}),
                  "fp")
    sent = events(reply.sse(ScriptedChoices({"a": HEY})))
    assert sent[-1] == {"data": "[DONE]"}
    chunks = [json.loads(e["data"]) for e in sent[:-1]]
    deltas = [(c["choices"][0]["delta"], c["choices"][0]["finish_reason"])
              for c in chunks if c["choices"]]
    assert deltas[0] == ({"role": "assistant", "content": ""}, None)
    assert "".join(d.get("content", "") for d, _ in deltas) == "hey"
    assert deltas[-1] == ({}, "stop")
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)


def test_usage_sums_each_choices_billed_counts():
    from localserve.api.answer import Finish
    ends = {0: Finish("stop", "eos", Usage(7, 2, 3, 1), Timings(0, 0, 0), ()),
            1: Finish("length", "limit", Usage(0, 5, 0, 0), Timings(0, 0, 0), ())}
    assert usage(ends) == {"prompt_tokens": 7, "completion_tokens": 7, "total_tokens": 14,
                           "prompt_tokens_details": {"cached_tokens": 3},
                           "completion_tokens_details": {"reasoning_tokens": 1}}


def native(**fields) -> NativeReply:
    return NativeReply("m", NativeCompletion(prompt="p", **fields), lambda t: b"x")


def test_native_final_object_says_stop_type_counts_and_tokens():
    for max_tokens, stop, kind, n_out in [(100, (), "eos", 6), (2, (), "limit", 2),
                                          (100, ("ll",), "word", 4)]:
        body = whole(native(return_tokens=True).collect,
                     ScriptedChoices({"a": HELLO}, n_prompt=4, max_tokens=max_tokens, stop=stop))
        assert (body["stop_type"], body["tokens_predicted"], body["tokens_evaluated"]) == \
            (kind, n_out, 4)
        assert body["tokens"] == HELLO[:n_out] and body["stop"] is True
        assert body["tokens_cached"] == 0 and body["model"] == "m" and body["prompt"] == "p"
        timings = body["timings"]
        assert (timings["prompt_n"], timings["predicted_n"]) == (4, n_out)
        assert timings["prompt_ms"] >= 0 and timings["predicted_ms"] > 0
    assert whole(native().collect, ScriptedChoices({"a": HEY}))["tokens"] == []


def test_native_timings_are_llama_servers_milliseconds_and_rate_from_the_end_piece():
    """result_timings as llama-server writes them (server_slot_stats::to_json): prompt_n
    excludes cached tokens, times in ms, the decoding rate over the tokens after the first
    (which the prompt's last step gave); no decode time or no tokens never divides by 0."""
    end = Finish("stop", "eos", Usage(12, 10, 4), Timings(0.1, 0.25, 0.5), (1, 2))
    timings = native()._final("hi", end)["timings"]
    assert timings == {"cache_n": 4, "prompt_n": 8, "prompt_ms": 250.0,
                       "prompt_per_token_ms": 31.25, "prompt_per_second": 32.0,
                       "predicted_n": 10, "predicted_ms": 500.0,
                       "predicted_per_token_ms": 500.0 / 9, "predicted_per_second": 18.0}
    instant = native()._final("", Finish("stop", "eos", Usage(3, 2, 0), Timings(0, 0, 0), ()))
    assert instant["timings"]["predicted_ms"] == 1e-3  # llama-server's 1 us at least
    assert instant["timings"]["predicted_per_second"] >= 1e6
    nothing = native()._final("", Finish("length", "limit", Usage(3, 0, 0), Timings(0, 0, 1), ()))
    assert nothing["timings"]["predicted_per_second"] == 0.0
    by_tokens = NativeReply("m", NativeCompletion(prompt=[1, 2]), lambda t: b"x")
    assert by_tokens._final("", end)["prompt"] == ""  # llama-server echoes text prompts only


def test_native_stream_sends_text_chunks_then_the_final_object():
    sent = [json.loads(e["data"]) for e in events(native().events(ScriptedChoices({"a": HEY})))]
    assert "".join(c["content"] for c in sent[:-1]) == "hey"
    assert all(c["stop"] is False and c["id_slot"] == -1 for c in sent[:-1])
    assert sent[-1]["stop"] is True and sent[-1]["stop_type"] == "eos"
    assert sent[-1]["content"] == ""


def test_ollama_final_line_counts_and_done_reason():
    for max_tokens, reason, n_out in [(100, "stop", 4), (2, "length", 2)]:
        reply = OllamaReply("m", True, None, False, True, 0.0, 0.0)
        body = whole(reply.collect, ScriptedChoices({"a": HEY}, n_prompt=5, max_tokens=max_tokens))
        assert body["done"] is True and body["done_reason"] == reason
        assert (body["prompt_eval_count"], body["eval_count"]) == (5, n_out)
        assert body["message"] == {"role": "assistant", "content": "hey"[:n_out]}
        assert all(body[k] >= 0 for k in ("total_duration", "load_duration",
                                          "prompt_eval_duration", "eval_duration"))
    lines = [json.loads(line) for line in events(
        OllamaReply("m", False, None, False, True, 0, 0).lines(ScriptedChoices({"a": HEY})))]
    assert "".join(line["response"] for line in lines[:-1]) == "hey"
    assert lines[-1]["done"] is True and lines[-1]["eval_count"] == 4


def test_messages_whole_and_streamed_say_the_stop_reason_and_output_tokens():
    for max_tokens, reason, n_out in [(100, "end_turn", 4), (2, "max_tokens", 2)]:
        reply = MessageReply("m", 5, None, False)
        body = whole(reply.collect, ScriptedChoices({"a": HEY}, n_prompt=5, max_tokens=max_tokens))
        assert body["stop_reason"] == reason and body["content"] == [
            {"type": "text", "text": "hey"[:n_out]}]
        assert body["usage"] == {"input_tokens": 5, "output_tokens": n_out,
                                 "cache_read_input_tokens": 0, "cache_creation_input_tokens": 0}
    reply = MessageReply("m", 5, None, False)
    sent = events(reply.events(ScriptedChoices({"a": HEY}, max_tokens=2)))
    delta = [json.loads(e["data"]) for e in sent if e["event"] == "message_delta"]
    assert delta == [{"type": "message_delta", "delta": {"stop_reason": "max_tokens",
                                                         "stop_sequence": None},
                      "usage": {"output_tokens": 2}}]


def test_a_response_cut_by_its_limit_is_incomplete_with_its_usage():
    for max_tokens, status, n_out in [(100, "completed", 4), (2, "incomplete", 2)]:
        body = ResponsesRequest(model="m", input="hi")
        reply = ResponseReply("m", body, 5, None, False)
        response = whole(reply.collect, ScriptedChoices({"a": HEY}, max_tokens=max_tokens))
        assert response["status"] == status and abs(response["created_at"] - time.time()) < 60
        assert response["incomplete_details"] == (
            {"reason": "max_output_tokens"} if status == "incomplete" else None)
        assert response["usage"] == {"input_tokens": 5, "input_tokens_details": {"cached_tokens": 0},
                                     "output_tokens": n_out,
                                     "output_tokens_details": {"reasoning_tokens": 0},
                                     "total_tokens": 5 + n_out}


def test_a_streamed_response_the_store_refuses_ends_with_an_error_event_and_no_completion():
    """The answer streamed, then the store refused it (its room is gone): the client is told
    with Responses' `error` event, code and message, and never reads response.completed."""
    reply = ResponseReply("m", ResponsesRequest(model="m", input="hi"), 5, None, False)

    async def refuse(response, messages):
        raise OpenAIError(413, "the response store is full", code="store_full")
    reply.keep = refuse
    sent = [(e["event"], json.loads(e["data"])) for e in events(
        reply.events(ScriptedChoices({"a": HEY})))]
    assert [kind for kind, _ in sent][-2:] == ["response.output_text.delta", "error"]
    assert {k: v for k, v in sent[-1][1].items() if k != "sequence_number"} == {
        "type": "error", "code": "store_full", "message": "the response store is full",
        "param": None}


def test_a_reply_is_one_json_body_or_an_event_stream_with_the_ignored_fields_named():
    from fastapi.responses import JSONResponse
    from sse_starlette.sse import EventSourceResponse

    from localserve.api.replies import respond_with, ignored_header

    async def collect(stream, request):
        return {"whole": stream.n}

    async def one_event(stream):
        yield {"data": "x"}
    headers = ignored_header(["foo", "bar"])
    assert headers == {"X-Ignored-Fields": "foo, bar"} and ignored_header([]) is None
    whole = asyncio.run(respond_with(collect, one_event, ScriptedChoices({"a": HEY}), None, False,
                                     headers))
    assert isinstance(whole, JSONResponse) and json.loads(whole.body) == {"whole": 1}
    assert whole.headers["x-ignored-fields"] == "foo, bar"

    async def streamed():
        return await respond_with(collect, one_event, ScriptedChoices({"a": HEY}), None, True,
                                  headers)
    sse = asyncio.run(streamed())
    assert isinstance(sse, EventSourceResponse) and sse.headers["x-ignored-fields"] == "foo, bar"
    assert (sse.ping_interval, sse.sep) == (10, "\n")  # LF between events (module doc)
    assert events(sse.body_iterator) == [{"data": "x"}]
    chat_sse = asyncio.run(Reply("chat.completion", "m", chat(stream=True), "fp").respond(
        ScriptedChoices({"a": HEY}), None))
    assert chat_sse.ping_interval == 15
    assert events(chat_sse.body_iterator)[-1] == {"data": "[DONE]"}
    reply = Reply("chat.completion", "m", chat(stream=False, unknown_field=1), "fp")
    body = asyncio.run(reply.respond(ScriptedChoices({"a": HEY}), None))
    assert body.headers["x-ignored-fields"] == "unknown_field"
    assert json.loads(body.body)["choices"][0]["message"]["content"] == "hey"


def test_header_names_are_safe_and_bounded_and_the_fingerprint_names_build_and_file():
    from pathlib import Path
    from types import SimpleNamespace

    from localserve import __version__
    from localserve.api.replies import fingerprint, header_list

    assert header_list(["a", "b c", "", "x\u00e9"]) == 'a, "b c", "", "x\\u00e9"'
    names = [f"n{i}" for i in range(20)]
    assert header_list(names) == ", ".join(names[:16]) + ", and 4 more"
    assert header_list(["a" * 80]) == '"' + "a" * 64 + '"'
    one = fingerprint(SimpleNamespace(model_path=Path("/m/one.gguf")))
    assert one.startswith(f"localserve-{__version__}-") and len(one.rsplit("-", 1)[1]) == 8
    assert one != fingerprint(SimpleNamespace(model_path=Path("/m/two.gguf")))
    assert fingerprint(SimpleNamespace(model_path=None)).startswith(f"localserve-{__version__}-")


class HangingUp:
    """A client that hangs up at its n-th disconnect check (never: None)."""

    def __init__(self, at: int | None):
        self.at, self.checks = at, 0

    async def is_disconnected(self) -> bool:
        self.checks += 1
        return self.at is not None and self.checks >= self.at


class Running:
    def __init__(self, finished: bool = False):
        self.finished, self.cancelled = finished, 0

    def cancel(self):
        self.cancelled += 1
        self.finished = True


def test_a_whole_answers_client_that_hangs_up_cancels_it_once_and_a_finished_one_is_left(
        monkeypatch):
    from localserve.api import answer

    async def no_wait(_):
        return None

    monkeypatch.setattr(answer.asyncio, "sleep", no_wait)
    gone, stream = HangingUp(at=3), Running()
    asyncio.run(answer.cancel_on_disconnect(gone, stream))
    assert stream.cancelled == 1 and gone.checks == 3
    done, finished = HangingUp(at=1), Running(finished=True)
    asyncio.run(answer.cancel_on_disconnect(done, finished))
    assert finished.cancelled == 0 and done.checks == 0  # nothing left to watch


class Stalls(ScriptedChoices):
    """A choice that sends "h", then nothing more until it is cancelled."""

    def __init__(self):
        super().__init__({"a": HELLO})
        self.events, self.woken = self.events[:1], None

    @property
    def finished(self) -> bool:
        return self.cancelled

    def cancel(self) -> None:
        super().cancel()
        if self.woken is not None:
            self.woken.set()

    async def _events(self):
        self.woken = asyncio.Event()
        yield self.events[0]
        await self.woken.wait()


def test_every_whole_answer_is_cancelled_when_its_client_hangs_up(monkeypatch):
    """Each writer hands its request to the reader, whose watcher cancels the answer when the
    client hangs up (a whole answer has no generator for sse-starlette to cancel)."""
    from localserve.api import answer

    async def no_wait(_):
        return None

    async def answered(collect):
        return await asyncio.wait_for(collect(stream, HangingUp(at=1)), timeout=5)

    monkeypatch.setattr(answer.asyncio, "sleep", no_wait)
    responses = ResponsesRequest(model="m", input="hi")
    for collect in (Reply("chat.completion", "m", chat(), "fp").respond,  # via respond_with
                    Reply("chat.completion", "m", chat(), "fp").collect,
                    Reply("text_completion", "m", CompletionRequest(model="m", prompt="x"),
                          "fp").collect,
                    NativeReply("m", NativeCompletion(prompt="p"), lambda t: b"x").collect,
                    OllamaReply("m", True, None, False, True, 0, 0).collect,
                    MessageReply("m", 3, None, False).collect,
                    ResponseReply("m", responses, 3, None, False).collect):
        stream = Stalls()
        try:
            asyncio.run(answered(collect))
        except OpenAIError as gone:
            assert gone.status == 499, collect
        else:
            raise AssertionError(f"{collect} answered a client that had gone")
        assert stream.cancelled, collect


def test_the_end_piece_times_the_queue_the_prompt_and_the_answer_from_the_requests_clocks():
    from localserve.api.answer import finish

    r = Request([1, 2, 3], SamplingParams(), request_id="r")
    now = time.monotonic()
    r.arrival_time, r.admitted_time, r.first_token_time = now - 10, now - 7, now - 3
    end = finish("stop", TokenEvent("", prompt_tokens=3), r, 0).timings
    assert [round(x) for x in (end.queued, end.prompt, end.decode)] == [3, 4, 3]
    r.admitted_time = r.first_token_time = None  # ended before any token (a refusal, a cut)
    end = finish("stop", TokenEvent("", prompt_tokens=3), r, 0).timings
    assert [round(x) for x in (end.queued, end.prompt, end.decode)] == [10, 0, 0]


def test_every_token_spent_in_a_think_block_counts_as_reasoning_up_to_an_unclosed_end():
    from localserve.engine.finish import FinishReason

    thinking = [TokenEvent("<think>", (3,)), TokenEvent("a", (4,)), TokenEvent("b", (5,)),
                TokenEvent("</th", (6,), FinishReason.LENGTH, prompt_tokens=3,
                           completion_tokens=4, stop_type="limit")]
    [answer] = asyncio.run(whole_answers(handcrafted(thinking), [ChoiceReader(reasoning=True)],
                                         None))
    assert (answer.thought, answer.text, answer.end.usage.reasoning) == ("ab</th", "", 3)


def test_ollama_writes_utc_times_nanoseconds_and_generates_thinking_beside_the_response():
    from datetime import datetime, timezone

    from localserve.api.ollama_reply import now_iso, ns
    from localserve.api.structured import ToolPlan
    from localserve.models.answer_formats import FORMATS
    from localserve.engine.finish import FinishReason

    stamp = now_iso()
    assert stamp.endswith("Z") and abs(datetime.fromisoformat(stamp[:-1] + "+00:00").timestamp()
                                       - datetime.now(timezone.utc).timestamp()) < 60
    assert (ns(1.5), ns(0), ns(-2)) == (1_500_000_000, 0, 0)

    def choices(*texts):
        ended = TokenEvent("", (9,), FinishReason.STOP, prompt_tokens=3, completion_tokens=1,
                           stop_type="eos")
        return handcrafted([TokenEvent(t, (4,)) for t in texts] + [ended])
    now = time.monotonic()
    thinking = OllamaReply("m", False, None, True, True, now - 2, now - 1.5)
    lines = [json.loads(line) for line in events(thinking.lines(choices(
        "<think>", "a", "</think>", "Hi")))]
    assert [(line.get("thinking"), line["response"]) for line in lines[:-1]] == [
        ("a", ""), (None, "Hi")]
    final = lines[-1]
    assert round(final["total_duration"] / 1e8) == 20 and round(final["load_duration"] / 1e8) == 5
    hermes = next(f for f in FORMATS if f.name == "hermes")
    silent = OllamaReply("m", False, ToolPlan(allow_text_response=True, native=hermes), False,
                         True, now, now)
    assert [json.loads(line)["done"] for line in events(silent.lines(choices("")))] == [True]
