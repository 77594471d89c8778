"""The model's own chat template (shipped with the fragments), rendered with jinja2 as Hugging Face does.

Read from the fragment manifest and tokenizer file by this small loader, so the gateway needs neither the
engine nor its weights: only `manifest.json` and `tokenizer.json`.
"""

from __future__ import annotations

import json
from pathlib import Path

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from .errors import bad_param


class TemplateError(ValueError):
    """The fragments carry no usable chat template."""


def _raise(message: str):
    raise jinja2.TemplateError(message)


class ChatTemplate:
    def __init__(self, source: str, bos_token: str = "", eos_token: str = ""):
        # NOTE: the same environment as transformers' apply_chat_template (sandboxed, trim/lstrip blocks,
        # loop controls, raise_exception), so a template renders here as it does there.
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.globals["raise_exception"] = _raise
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise TemplateError(f"the chat template does not parse: {exc}") from None
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token

    @classmethod
    def from_fragments(cls, fragment_dir: str | Path) -> "ChatTemplate":
        manifest_path = Path(fragment_dir) / "manifest.json"
        if not manifest_path.is_file():
            raise TemplateError(f"{manifest_path} not found (build the fragments first: make serve does)")
        manifest = json.loads(manifest_path.read_text())
        meta = manifest.get("tokenizer", {})
        source = meta.get("chat_template")
        if not source:
            raise TemplateError(f"{manifest_path} has no tokenizer.chat_template")
        tokenizer = Tokenizer.from_file(str(Path(fragment_dir) / meta["file"]))
        config = manifest.get("config", {})

        def token(key: str) -> str:
            tid = config.get(key)
            return (tokenizer.id_to_token(tid) or "") if tid is not None else ""

        return cls(source, token("bos_token_id"), token("eos_token_id"))

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        try:
            return self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        except jinja2.TemplateError as exc:  # raise_exception() in the template: the conversation is refused
            raise bad_param("messages", f"the model's chat template refused them: {exc}") from None
