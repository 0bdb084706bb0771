"""Which tool-call form a model writes, read from its chat template (api/tool_formats.py lists
the forms and reads them): known here, in the model layer, so that the start-up log can say
how a model's tool calls will be read (`describe`)."""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass, replace

DSML = "｜DSML｜"  # DeepSeek V3.2's and V4's markup (api/call_forms.py)


@dataclass(frozen=True)
class NativeFormat:
    name: str
    trigger: str  # where calls begin in an answer
    marker: str  # what in a chat template says it is this format
    args_key: str = "arguments"
    name_key: str = "name"
    as_list: bool = False  # one JSON list after the trigger (else one object per block)
    close: str = ""  # what ends one block
    triggers: tuple[str, ...] = ()  # other openings of the same calls
    # each block's call as tagged text: "function" <function=NAME><parameter=KEY>value</parameter>,
    # "arg" NAME<arg_key>KEY</arg_key><arg_value>value</arg_value> (GLM); invoke elements,
    # "invoke" (MiniMax M2) or "dsml" (DeepSeek V3.2, V4): call_forms.py; "": JSON
    xml: str = ""
    named: str = ""  # NAME, a separator, its arguments' JSON: call_forms.NAMED's key (Kimi K2)
    # its template writes calls but not the tools (DeepSeek V3.1's): they go in a system
    # message, in the words of the model's card (call_forms.TOOL_PROMPTS)
    tools_unseen: bool = False

    def call_id(self) -> str:
        """An id for a call the model wrote none for: Mistral's templates insist on 9
        characters."""
        return uuid.uuid4().hex[:9] if self.name.startswith("mistral") else new_call_id()


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


FORMATS = (  # the first whose marker the template holds
    NativeFormat("harmony", "to=functions.", "<|channel|>"),  # gpt-oss's: read by harmony.py
    NativeFormat("gemma4", "<|tool_call>", "<|tool_call>", close="<tool_call|>"),  # gemma4.py
    NativeFormat("seed-oss", "<seed:tool_call>", "<seed:tool_call>", close="</seed:tool_call>",
                 xml="function"),
    NativeFormat("qwen3-coder", "<tool_call>", "<parameter=", close="</tool_call>", xml="function"),
    NativeFormat("glm", "<tool_call>", "<arg_key>", close="</tool_call>", xml="arg"),
    # DeepSeek V3.1: NAME<｜tool▁sep｜>{...} (its template's own words; R1's add a type first)
    NativeFormat("deepseek", "<｜tool▁calls▁begin｜>", "['name'] + '<｜tool▁sep｜>'",
                 triggers=("<｜tool▁call▁begin｜>",), named="deepseek", tools_unseen=True),
    NativeFormat("kimi", "<|tool_calls_section_begin|>", "<|tool_call_argument_begin|>",
                 triggers=("<|tool_call_begin|>",), named="kimi"),
    NativeFormat("minimax", "<minimax:tool_call>", "<minimax:tool_call>",
                 close="</minimax:tool_call>", xml="invoke"),
    NativeFormat("dsml", f"<{DSML}function_calls>", DSML, close=f"</{DSML}function_calls>",
                 triggers=(f"<{DSML}tool_calls>",), xml="dsml"),  # (V4's: detect)
    NativeFormat("minimax-m1", "<tool_calls>", "<end_of_sentence>", close="</tool_calls>"),
    NativeFormat("apriel", "<tool_calls>", "<tool_calls>", as_list=True, close="</tool_calls>"),
    NativeFormat("hermes", "<tool_call>", "<tool_call>", close="</tool_call>"),
    NativeFormat("mistral-args", "[TOOL_CALLS]", "[ARGS]"),  # NAME[ARGS]{...}: args_call
    NativeFormat("mistral", "[TOOL_CALLS]", "[TOOL_CALLS]", as_list=True),
    NativeFormat("granite", "<|tool_call|>", "<|tool_call|>", as_list=True),
    NativeFormat("llama3", '{"name"', "<|start_header_id|>", args_key="parameters",
                 triggers=("<|python_tag|>",)),
    NativeFormat("command-r", "<|START_ACTION|>", "<|START_ACTION|>", args_key="parameters",
                 name_key="tool_name", as_list=True),
)


def detect(template_source: str | None) -> NativeFormat | None:
    """The template's own format, when it renders `tools` and it is one of the known ones."""
    source = template_source or ""
    found = next((f for f in FORMATS if f.marker in source), None)
    if found is None or not (found.tools_unseen or re.search(r"\btools\b", source)):
        return None
    if found.xml == "dsml" and "function_calls" not in source:
        found = replace(found, trigger=f"<{DSML}tool_calls>", close=f"</{DSML}tool_calls>",
                        triggers=(f"<{DSML}function_calls>",))  # DeepSeek V4 names it so
    return found


def describe(template_source: str | None) -> str:
    """The start-up log's words for how this template's tool calls are read."""
    found = detect(template_source)
    if found is not None and found.tools_unseen:
        return (f"read and forced in the model's own form ({found.name}), the tools described "
                f"in a system message as its model card does (its template does not)")
    if found is not None:
        return f"read and forced in the template's own form ({found.name})"
    if not re.search(r"\btools\b", template_source or ""):
        return ("the generic JSON form, the tools described in a system message (the chat "
                "template does not show the model its tools)")
    return ("the generic JSON form, the tools described in a system message (the template's "
            "own form is not one localserve reads)")
