"""Chat messages to a prompt: the model's own chat template (Jinja, from tokenizer_config.json), or ours.

The default template, for models that ship none, writes each turn as a role header line and its
content, and ends with the assistant's header so the model continues as the assistant:

    <|system|>
    You are terse.
    <|user|>
    Hi!
    <|assistant|>

Templates run in Jinja's immutable sandbox, as Hugging Face's `apply_chat_template` runs them, with
`messages`, `bos_token`, `eos_token` and `add_generation_prompt=True`, plus the two helpers such
templates call: `raise_exception(message)` and `strftime_now(format)`.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

from fivefold.checkpoint.files import read_json
from fivefold.data.tokenizer import load_tokenizer

DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message.role }}|>\n{{ message.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


class ChatTemplateError(ValueError):
    """The template refused the conversation (e.g. roles that do not alternate) or could not run."""


def _raise(message: str):
    raise ChatTemplateError(message)


class ChatTemplate:
    def __init__(self, template: str | None = None, bos_token: str = "", eos_token: str = ""):
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        self.source = template or DEFAULT_CHAT_TEMPLATE
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals.update(raise_exception=_raise, strftime_now=lambda fmt: datetime.now().strftime(fmt))
        # Hugging Face templates expect tojson to keep non-ASCII text as it is.
        env.filters["tojson"] = lambda value, indent=None: json.dumps(value, ensure_ascii=False, indent=indent)
        self.template = env.from_string(self.source)
        self.bos_token, self.eos_token = bos_token, eos_token

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The prompt text for `messages` ([{role, content}, ...]), ending where the assistant's reply begins;
        without `add_generation_prompt`, the conversation as it stands (fine-tuning renders both, to find
        where each assistant turn starts and ends)."""
        from jinja2 import TemplateError

        try:
            return self.template.render(messages=messages, bos_token=self.bos_token, eos_token=self.eos_token,
                                        add_generation_prompt=add_generation_prompt)
        except ChatTemplateError:
            raise
        except TemplateError as e:
            raise ChatTemplateError(f"the chat template failed on these messages: {e}") from None


def special_tokens(directory: str | Path) -> tuple[str, str]:
    """bos_token and eos_token as tokenizer_config.json spells them ("" where it has none); each may be
    a string or an AddedToken-style {"content": ...} table."""
    path = Path(directory) / "tokenizer_config.json"
    values = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}

    def text(token) -> str:
        if isinstance(token, dict):
            token = token.get("content")
        return token if isinstance(token, str) else ""

    return text(values.get("bos_token")), text(values.get("eos_token"))


def tokenizer_and_template(directory: Path, tokenizer: str | Path | None = None):
    """(tokenizers.Tokenizer or None, chat template or None) of a model directory; `tokenizer`: another
    tokenizer.json to use."""
    path = Path(tokenizer) if tokenizer else directory / "tokenizer.json"
    tok = load_tokenizer(path) if tokenizer or path.is_file() else None
    template = None
    config_path = directory / "tokenizer_config.json"
    if config_path.is_file():
        template = read_json(config_path).get("chat_template")
        if isinstance(template, list):  # several named templates: the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
    return tok, template
