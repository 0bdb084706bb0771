"""Render chat messages with the model's own Jinja2 template (GGUF `tokenizer.chat_template`)."""

from __future__ import annotations

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Used only when a GGUF carries no template: ChatML, the most common format.
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


class ChatTemplateError(ValueError):
    """The messages could not be rendered (the template itself raised): a client error."""


def _raise(message: str):
    raise ChatTemplateError(message)


class ChatTemplate:
    def __init__(self, source: str | None, bos_token: str = "", eos_token: str = ""):
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        self.source = source or CHATML
        self.template = env.from_string(self.source)
        self.bos_token = bos_token
        self.eos_token = eos_token

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        try:
            return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                        bos_token=self.bos_token, eos_token=self.eos_token)
        except ChatTemplateError:
            raise
        except TemplateError as exc:
            raise ChatTemplateError(f"the model's chat template failed on these messages: {exc}")
