"""Tokenization and chat templates for the control plane, without torch or transformers.

Reads the model folder's `tokenizer.json` with the `tokenizers` library and renders the chat
template with a sandboxed Jinja environment configured as transformers configures its own
(trim_blocks, lstrip_blocks, loop controls, `raise_exception`), so the token ids match what
the data plane's offline API produces for the same text.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _FastTokenizer


def _raise_exception(message: str) -> None:
    raise ValueError(f"chat template: {message}")


def _tojson(value: Any, indent: int | None = None) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent)


class Tokenizer:
    def __init__(self, model_dir: Path | str) -> None:
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        # Without one (test models) only token-id prompts work, and text deltas stay empty.
        self._tok = _FastTokenizer.from_file(str(path)) if path.is_file() else None
        config_path = model_dir / "tokenizer_config.json"
        config: dict[str, Any] = json.loads(config_path.read_text()) if config_path.is_file() else {}
        self.special_tokens = {
            name: self._token_text(config.get(name))
            for name in ("bos_token", "eos_token", "pad_token", "unk_token")
        }
        template = config.get("chat_template")
        template_file = model_dir / "chat_template.jinja"
        if template is None and template_file.is_file():
            template = template_file.read_text()
        self.chat_template: str | None = template if isinstance(template, str) else None
        self._template: jinja2.Template | None = None

    @staticmethod
    def _token_text(value: Any) -> str | None:
        if isinstance(value, dict):
            return str(value.get("content"))
        return value if isinstance(value, str) else None

    @property
    def vocab_size(self) -> int:
        return 0 if self._tok is None else int(self._tok.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` with no special tokens added (as the engine tokenizes prompts)."""
        if self._tok is None:
            raise ValueError("this model has no tokenizer; send token ids")
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        if self._tok is None:
            return ""
        return str(self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens))

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """The conversation rendered; `tools` (OpenAI's JSON shape) are passed as transformers
        passes them, as the template's `tools` variable (unset when None)."""
        if self.chat_template is None:
            raise ValueError("chat: this model has no chat template; send a text prompt instead")
        if self._template is None:
            env = ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
            )
            env.filters["tojson"] = _tojson
            env.globals["raise_exception"] = _raise_exception
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            self._template = env.from_string(self.chat_template)
        extra: dict[str, Any] = {} if tools is None else {"tools": tools}
        return self._template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            **extra,
            **{k: v for k, v in self.special_tokens.items() if v is not None},
        )
