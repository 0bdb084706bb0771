"""Models' own tool-call formats (api/tool_formats.py), tested without a large model: real chat
templates (tests/templates/) render tools and tool history; each family's answers are read into
OpenAI tool calls, whole and streamed in fragments; on the real server, the embedded model with a
Qwen template override calls tools in Qwen's <tool_call> format."""

import json
from pathlib import Path

import httpx
import pytest

from conftest import running
from localserve.models.chat_template import ChatTemplate
from localserve.api.schemas import ChatCompletionRequest
from localserve.api.tool_formats import ProseThenCalls, parse, rename_rule
from localserve.api.structured import native_tool_setup
from localserve.models.answer_formats import detect

TEMPLATES = Path(__file__).parent / "templates"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
HISTORY = [
    {"role": "system", "content": "You are helpful."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [{"id": "call_abc123", "type": "function",
     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_abc123", "content": "Sunny, 21 C"},
]
FAMILIES = {
    "Qwen-Qwen2.5-7B-Instruct": "hermes", "NousResearch-Hermes-3-Llama-3.1-8B-tool_use": "hermes",
    "Qwen-Qwen3-0.6B": "hermes", "meta-llama-Llama-3.1-8B-Instruct": "llama3",
    "meta-llama-Llama-3.2-3B-Instruct": "llama3", "mistralai-Mistral-Nemo-Instruct-2407": "mistral",
    "ibm-granite-granite-3.3-2B-Instruct": "granite", "google-gemma-2-2b-it": None,
    "CohereForAI-c4ai-command-r7b-12-2024-tool_use": "command-r",
    "Qwen3.5-4B": "qwen3-coder", "Qwen3-Coder": "qwen3-coder",
    "NVIDIA-Nemotron-3-Nano-30B-A3B-BF16": "qwen3-coder", "ByteDance-Seed-OSS": "seed-oss",
    "openai-gpt-oss-120b": "harmony",  # read by harmony.py (tests/test_harmony.py)
    "google-gemma-4-31B-it": "gemma4",  # read by gemma4.py (tests/test_gemma4.py)
    "mistralai-Ministral-3-14B-Reasoning-2512": "mistral-args",
    "Mistral-Small-3.2-24B-Instruct-2506": "mistral-args",
    "unsloth-mistral-Devstral-Small-2507": "mistral-args",
    "GLM-4.6": "glm", "GLM-4.7-Flash": "glm", "moonshotai-Kimi-K2": "kimi",
    "MiniMax-M2": "minimax", "deepseek-ai-DeepSeek-V3.2": "dsml", "deepseek-ai-DeepSeek-V4": "dsml",
    "unsloth-Apriel-1.5": "apriel", "MiniMax-M1": "minimax-m1",  # call_forms.py: kimi to dsml
    "deepseek-ai-DeepSeek-V3.1": "deepseek",  # its template writes calls but not the tools
}


@pytest.mark.parametrize("name, family", FAMILIES.items())
def test_real_templates_render_tools_and_tool_history(name, family):
    source = (TEMPLATES / f"{name}.jinja").read_text()
    fmt = detect(source)
    assert (fmt.name if fmt else None) == family
    if fmt is None:
        return  # no tools in this template: the generic format applies
    body = ChatCompletionRequest(messages=HISTORY, tools=[WEATHER])
    messages, _, plan = native_tool_setup(None, body, body.tools, fmt)  # auto: no grammar
    rendered = "".join(p.text for p in ChatTemplate(source, "<s>", "</s>").render_parts(
        messages, tools=plan.template_tools))
    assert "get_weather" in rendered and "Sunny, 21 C" in rendered and "Paris" in rendered
    assert "Current weather of a city" in rendered  # the tool list itself reached the prompt


CANNED = [  # (format, the model's answer, expected content, expected calls)
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     None, [("get_weather", {"city": "Paris"})]),
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}'
               '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>',
     "Let me check.", [("get_weather", {"city": "Oslo"}), ("get_time", {"zone": "UTC"})]),
    ("mistral", '[TOOL_CALLS][{"name": "special_function", "arguments": {"arg1": 1}, "id": "123456789"}]',
     None, [("special_function", {"arg1": 1})]),
    ("granite", '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Rome"}}]',
     None, [("get_weather", {"city": "Rome"})]),
    ("llama3", '{"name": "get_weather", "parameters": {"city": "Lima"}}',
     None, [("get_weather", {"city": "Lima"})]),
    ("llama3", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Kyiv"}}',
     None, [("get_weather", {"city": "Kyiv"})]),
    ("command-r", 'I will look it up.<|START_ACTION|>[\n    {"tool_call_id": "0", "tool_name": '
                  '"get_weather", "parameters": {"city": "Oslo"}}\n]<|END_ACTION|>',
     "I will look it up.", [("get_weather", {"city": "Oslo"})]),
    ("qwen3-coder", "Let me check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis"
                    "\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>",
     "Let me check.", [("get_weather", {"city": "Paris", "days": 3})]),
    ("qwen3-coder", "<tool_call>\n<function=write>\n<parameter=text>\nline one\nline two\n"
                    "</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n"
                    "</function>\n</tool_call>",
     None, [("write", {"text": "line one\nline two"}), ("get_time", {})]),
    ("seed-oss", "<seed:tool_call>\n<function=get_weather>\n<parameter=city>Rome</parameter>\n"
                 "</function>\n</seed:tool_call>", None, [("get_weather", {"city": "Rome"})]),
    ("mistral-args", '[TOOL_CALLS]special_function[ARGS]{"arg1":1}', None,
     [("special_function", {"arg1": 1})]),  # Ministral 3, Devstral (test-chat.cpp)
    ("mistral-args", 'Hello, world!\nWhat\'s up?[TOOL_CALLS]special_function[ARGS]{"arg1": 1}',
     "Hello, world!\nWhat's up?", [("special_function", {"arg1": 1})]),
    ("mistral-args", '[TOOL_CALLS]special_function[ARGS]{"arg1": 1}[TOOL_CALLS]special_functi'
                     'on_with_opt[ARGS]{"arg1": 1, "arg2": 2}', None,
     [("special_function", {"arg1": 1}), ("special_function_with_opt", {"arg1": 1, "arg2": 2})]),
    ("mistral-args", '[TOOL_CALLS]special_function[CALL_ID]123456789[ARGS]{"arg1": 1}', None,
     [("special_function", {"arg1": 1})]),  # Mistral Small 3.2: the model's id is kept
    ("glm", "<tool_call>special_function\n<arg_key>arg1</arg_key>\n<arg_value>1</arg_value>\n"
            "</tool_call>", None, [("special_function", {"arg1": 1})]),  # GLM 4.6
    ("glm", "<tool_call>special_function<arg_key>arg1</arg_key><arg_value>1</arg_value>"
            "</tool_call><tool_call>special_function_with_opt<arg_key>arg1</arg_key><arg_value>1"
            "</arg_value><arg_key>arg2</arg_key><arg_value>2</arg_value></tool_call>", None,
     [("special_function", {"arg1": 1}), ("special_function_with_opt", {"arg1": 1, "arg2": 2})]),
    ("glm", "<tool_call>read_file_diff_md</tool_call>", None, [("read_file_diff_md", {})]),
    ("deepseek", '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{"city": "XYZCITY"}'
                 "<｜tool▁call▁end｜><｜tool▁calls▁end｜>", None, [("get_time", {"city": "XYZCITY"})]),
    ("deepseek", 'CONTENT<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{"city": '
                 '"Paris"}<｜tool▁call▁end｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": '
                 '"Paris"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>', "CONTENT",
     [("get_time", {"city": "Paris"}), ("get_weather", {"city": "Paris"})]),  # test-chat.cpp
    ("kimi", "<|tool_calls_section_begin|><|tool_call_begin|>functions.special_function:0"
             '<|tool_call_argument_begin|>{"arg1": 1}<|tool_call_end|><|tool_calls_section_end|>',
     None, [("special_function", {"arg1": 1})]),  # its id kept: functions.special_function:0
    ("minimax", '<minimax:tool_call>\n<invoke name="special_function">\n<parameter name="arg1">1'
                "</parameter>\n</invoke>\n</minimax:tool_call>", None,
     [("special_function", {"arg1": 1})]),
    ("minimax", 'Let me.\n<minimax:tool_call>\n<invoke name="empty_args">\n</invoke>\n'
                "</minimax:tool_call>", "Let me.", [("empty_args", {})]),
    ("dsml", '\n\n<｜DSML｜function_calls>\n<｜DSML｜invoke name="get_time">\n<｜DSML｜parameter '
             'name="city" string="true">Tokyo</｜DSML｜parameter>\n</｜DSML｜invoke>\n'
             "</｜DSML｜function_calls>", None, [("get_time", {"city": "Tokyo"})]),
    ("dsml", '<｜DSML｜function_calls>\n<｜DSML｜invoke name="special_function">\n<｜DSML｜parameter '
             'name="arg1" string="false">1</｜DSML｜parameter>\n</｜DSML｜invoke>\n<｜DSML｜invoke '
             'name="get_weather">\n<｜DSML｜parameter name="city" string="true">7</｜DSML｜parameter>'
             "\n</｜DSML｜invoke>\n</｜DSML｜function_calls>", None,
     [("special_function", {"arg1": 1}), ("get_weather", {"city": "7"})]),  # "true": text
    ("apriel", '<tool_calls>[{"name": "special_function", "arguments": {"arg1": 1}}]</tool_calls>',
     None, [("special_function", {"arg1": 1})]),
    ("minimax-m1", '<tool_calls>\n{"name": "special_function", "arguments": {"arg1": 1}}\n'
                   '{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_calls>', None,
     [("special_function", {"arg1": 1}), ("get_time", {"zone": "UTC"})]),
    ("hermes", "Hello, world!\nWhat's up?", "Hello, world!\nWhat's up?", []),
    ("hermes", '<tool_call>\n{"name": "get_weather", "argu', '<tool_call>\n{"name": "get_weather", "argu', []),
]


def formats():
    return {f.name: f for f in (detect((TEMPLATES / f"{n}.jinja").read_text()) for n in FAMILIES) if f}


@pytest.mark.parametrize("family, answer, content, calls", CANNED)
def test_canned_answers_are_read_whole_and_streamed(family, answer, content, calls):
    fmt = formats()[family]
    got_content, got_calls = parse(answer, fmt)
    shaped = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got_calls]
    assert (got_content, shaped) == (content, calls)
    assert all(c["id"] and c["type"] == "function" for c in got_calls)
    if family.startswith("mistral"):
        assert all(len(c["id"]) == 9 for c in got_calls)  # its template insists
    if "[CALL_ID]123456789" in answer:
        assert got_calls[0]["id"] == "123456789"
    if family == "kimi":
        assert got_calls[0]["id"] == "functions.special_function:0"
    for cut in range(0, len(answer) + 1, 3):  # streamed: prose out as it comes, calls at the end
        stream = ProseThenCalls(fmt)
        prose = stream.feed(answer[:cut]) + stream.feed(answer[cut:])
        rest, streamed_calls = stream.finish()
        text = prose + (rest or "")
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                for c in streamed_calls] == calls, cut
        assert (text.strip() or None) == (content if calls else answer), cut


def test_the_log_says_how_a_templates_tool_calls_are_read():
    from localserve.models.answer_formats import describe
    assert describe((TEMPLATES / "Qwen3.5-4B.jinja").read_text()).endswith("(qwen3-coder)")
    assert "does not show the model its tools" in describe(
        (TEMPLATES / "google-gemma-2-2b-it.jinja").read_text())
    assert "not one localserve reads" in describe("{{ tools }}<my_own_call_tag>")


def test_deepseek_v4_names_its_block_tool_calls():
    fmt = detect((TEMPLATES / "deepseek-ai-DeepSeek-V4.jinja").read_text())
    answer = ('Let me check the time</think>\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="get_time">'
              '\n<｜DSML｜parameter name="city" string="true">Tokyo</｜DSML｜parameter>\n'
              "</｜DSML｜invoke>\n</｜DSML｜tool_calls>")
    content, calls = parse(answer, fmt)
    assert content == "Let me check the time</think>"  # (reasoning is split off before this)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == \
        [("get_time", {"city": "Tokyo"})]


def test_renaming_a_rule_leaves_literals_alone():
    gbnf = 'root ::= "{" space "\\"root\\"" space [root] root-x\nroot-x ::= root'
    assert rename_rule(gbnf, "root", "tool-call") == (
        'tool-call ::= "{" space "\\"root\\"" space [root] root-x\nroot-x ::= tool-call')


@pytest.fixture(scope="module")
def qwen():
    with running("-c", "2048", "-np", "2", "-t", "2", "--chat-template-file",
                 str(TEMPLATES / "Qwen-Qwen2.5-7B-Instruct.jinja"), log_name="tool-formats") as srv:
        yield srv


def ask(srv, **extra):
    body = {"messages": [{"role": "user", "content": "What is the weather in Paris?"}],
            "tools": [WEATHER], "temperature": 0, "max_tokens": 60, **extra}
    r = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def test_the_model_is_prompted_in_its_own_format_and_called_tools_parse(qwen):
    shown = httpx.post(qwen.url + "/apply-template", json={"messages": HISTORY}).json()["prompt"]
    assert "<tool_call>" in shown  # the history's call, in Qwen's own words
    choice = ask(qwen, tool_choice="required", parallel_tool_calls=False)  # one <tool_call> block
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    call = choice["message"]["tool_calls"][0]
    assert call["function"]["name"] == "get_weather" and "city" in json.loads(call["function"]["arguments"])
    follow = ask(qwen, messages=HISTORY, tool_choice="none")  # the result goes back through the template
    assert follow["message"]["content"]


def test_auto_streams_prose_and_never_leaks_a_cut_call(qwen):
    for max_tokens in (3, 60):
        choice = ask(qwen, tool_choice="auto", max_tokens=max_tokens)
        content = choice["message"]["content"] or ""
        assert "</tool_call>" not in content
        if choice["message"].get("tool_calls"):
            assert "<tool_call>" not in content


def test_streamed_native_calls_arrive_as_tool_call_deltas(qwen):
    body = {"messages": [{"role": "user", "content": "What is the weather in Paris?"}],
            "tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": False,
            "temperature": 0, "max_tokens": 60, "stream": True}
    calls, finish, content = [], None, ""
    with httpx.stream("POST", qwen.url + "/v1/chat/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"][0]
                calls += choice["delta"].get("tool_calls") or []
                content += choice["delta"].get("content") or ""
                finish = choice["finish_reason"] or finish
    assert finish == "tool_calls" and content == ""
    assert [c["function"]["name"] for c in calls] == ["get_weather"]


def test_required_calls_are_written_in_command_r_form_and_parse():
    """Another family end to end: the whole answer constrained to <|START_ACTION|>[...] with
    `tool_name`/`parameters` keys, read back into OpenAI tool calls."""
    template = TEMPLATES / "CohereForAI-c4ai-command-r7b-12-2024-tool_use.jinja"
    with running("-c", "2048", "-np", "1", "-t", "2", "--chat-template-file", str(template),
                 log_name="tool-formats-command-r") as srv:
        choice = ask(srv, tool_choice="required", parallel_tool_calls=False)
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    [call] = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert "city" in json.loads(call["function"]["arguments"])


def test_qwen35_is_asked_for_its_xml_calls_and_its_forced_call_is_written_so():
    """Qwen3.5's own format, constrained (tool_choice "required") on the real server with its
    template: the answer is <tool_call><function=...><parameter=...>, each value as its schema
    types it, read back as OpenAI calls."""
    template = TEMPLATES / "Qwen3.5-4B.jinja"
    with running("-c", "2048", "-np", "1", "-t", "2", "--chat-template-file", str(template),
                 log_name="tool-formats-qwen35") as srv:
        choice = ask(srv, tool_choice="required", parallel_tool_calls=False, max_tokens=100,
                     tools=[CITY_AND_DAYS])
    assert choice["finish_reason"] == "tool_calls"
    [call] = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    arguments = json.loads(call["function"]["arguments"])
    assert set(arguments) <= {"city", "days"} and 0 < len(arguments["city"]) <= 24
    assert isinstance(arguments.get("days", 0), int)  # typed as its schema says


CITY_AND_DAYS = {"type": "function", "function": {  # values the XML grammar bounds by type
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "required": ["city"], "properties": {
        "city": {"type": "string", "maxLength": 24}, "days": {"type": "integer"}}}}}


def test_a_forced_call_is_written_in_mistrals_args_form_and_parses():
    """Mistral Small 3.2's own form end to end: [TOOL_CALLS]NAME[CALL_ID]...[ARGS]{...} in its
    template's history, and the forced answer [TOOL_CALLS]NAME[ARGS]{...} read back."""
    template = TEMPLATES / "Mistral-Small-3.2-24B-Instruct-2506.jinja"
    with running("-c", "2048", "-np", "1", "-t", "2", "--chat-template-file", str(template),
                 log_name="tool-formats-mistral-args") as srv:
        shown = httpx.post(srv.url + "/apply-template", json={"messages": HISTORY}).json()
        choice = ask(srv, tool_choice="required", parallel_tool_calls=False)
    assert "[TOOL_CALLS]get_weather[CALL_ID]" in shown["prompt"]  # 9 characters, as it insists
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    [call] = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather" and len(call["id"]) == 9
    assert "city" in json.loads(call["function"]["arguments"])


def test_a_forced_call_is_written_in_glms_form_and_parses():
    """GLM 4.7 Flash's own form end to end: <tool_call>NAME<arg_key>...<arg_value>... in its
    template's history and in the forced answer, read back (its prompt opens a <think> block,
    which the forced call answers from)."""
    template = TEMPLATES / "GLM-4.7-Flash.jinja"
    with running("-c", "2048", "-np", "1", "-t", "2", "--chat-template-file", str(template),
                 log_name="tool-formats-glm") as srv:
        shown = httpx.post(srv.url + "/apply-template", json={"messages": HISTORY}).json()
        choice = ask(srv, tool_choice="required", parallel_tool_calls=False, max_tokens=100,
                     tools=[CITY_AND_DAYS])
        assert "tool calls: read and forced in the template's own form (glm)" in srv.log()
    assert "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris" in shown["prompt"]
    assert choice["finish_reason"] == "tool_calls", choice
    [call] = choice["message"]["tool_calls"]
    arguments = json.loads(call["function"]["arguments"])
    assert call["function"]["name"] == "get_weather" and 0 < len(arguments["city"]) <= 24
