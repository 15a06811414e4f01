"""One model's tokenizer and chat template, loaded from its directory; a body's prompt tokens
counted as the replica counts them.

The directory is what vLLM loads: ``tokenizer.json`` (read with the ``tokenizers`` library,
the Rust tokenizer transformers' fast tokenizers wrap), the chat template from
``chat_template.jinja`` (and ``additional_chat_templates/*.jinja``) or ``tokenizer_config.json``'s
``chat_template``, and the special tokens the template may name (``bos_token``...).

Counting a chat body: the dialect's template inputs (``dialects.chat_input``), the
conversation vLLM makes of them (``tokens.conversation``), the template rendered
(``tokens.template``), the text encoded without special tokens (the template writes them;
vLLM's chat endpoints add none). A completion's prompt is encoded with special tokens.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from dialects.base import Dialect
from dialects.chat_input import ChatInput, NotCountable, TemplateTraits, TextInput
from tokens.conversation import conversation
from tokens.segments import SegmentCounter
from tokens.template import ChatTemplate, TemplateError

# The special tokens transformers hands every template as variables (SPECIAL_TOKENS_ATTRIBUTES).
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# Anthropic's efforts (vLLM's AnthropicEffort), to learn what ``thinking: disabled`` becomes.
EFFORTS = ("low", "medium", "high", "xhigh", "max")


class TokenizerError(Exception):
    """A tokenizer directory that cannot be used: what is missing or wrong."""


@dataclass(frozen=True, slots=True)
class ModelTokenizer:
    """A model's tokenizer, its chat templates by name (``default``, ``tool_use``...), the
    special tokens templates read, and what vLLM learns of the templates (``traits``)."""

    directory: Path
    tokenizer: Tokenizer
    templates: dict[str, ChatTemplate]
    special_tokens: dict[str, str]
    traits: TemplateTraits
    # Chat prompts counted piece by piece between special tokens, the pieces' counts kept
    # (None: this tokenizer's added tokens do not cut text cleanly; prompts encoded whole).
    segments: SegmentCounter | None = None

    @classmethod
    def load(cls, directory: Path) -> ModelTokenizer:
        """Everything read and compiled now; ``TokenizerError`` says what is wrong."""
        if not directory.is_dir():
            raise TokenizerError(f"{directory} is not a directory")
        path = directory / "tokenizer.json"
        try:
            tokenizer = Tokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers raises plain Exceptions for missing and malformed files
            raise TokenizerError(f"cannot read {path}: {exc}") from exc
        config = _json(directory / "tokenizer_config.json")
        special = {**_special_tokens(_json(directory / "special_tokens_map.json")), **_special_tokens(config)}
        try:
            templates = {name: ChatTemplate(source) for name, source in _template_sources(directory, config).items()}
        except TemplateError as exc:
            raise TokenizerError(f"{directory}: {exc}") from exc
        if not templates:
            raise TokenizerError(f"{directory} has no chat template (chat_template.jinja or tokenizer_config.json)")
        partial = cls(directory, tokenizer, templates, special, TemplateTraits())
        segments = SegmentCounter.for_tokenizer(tokenizer)
        return cls(directory, tokenizer, templates, special, partial._traits(), segments)

    def template(self, tools: list[dict[str, Any]] | None) -> ChatTemplate:
        """The template vLLM picks: ``tool_use`` for a request with tools where there is one,
        else ``default`` (the only one, mostly)."""
        if len(self.templates) == 1:
            return next(iter(self.templates.values()))
        if tools is not None and "tool_use" in self.templates:
            return self.templates["tool_use"]
        if "default" in self.templates:
            return self.templates["default"]
        raise NotCountable("several chat templates and none is 'default'")

    def count(self, dialect: Dialect, body: dict[str, Any]) -> int:
        """``body``'s prompt tokens; ``NotCountable`` or ``TemplateError`` when they cannot be known."""
        prompt = dialect.prompt_input(body, self.traits)
        if isinstance(prompt, TextInput):
            ids = sum(len(p) for p in prompt.prompts if isinstance(p, tuple))
            texts = [p for p in prompt.prompts if isinstance(p, str)]
            return ids + self.encoded_length(texts, prompt.add_special_tokens)
        if isinstance(prompt, ChatInput):
            text = self.render(prompt)
            return self.segments.count(text) if self.segments is not None else self.encoded_length([text], False)
        raise NotCountable(f"{dialect.name} has no prompt to count")

    def token_ids(self, dialect: Dialect, body: dict[str, Any]) -> list[int]:
        """``body``'s prompt as the replica's token ids (what its KV-cache blocks hold): the
        prompt encoded whole, which costs more than ``count`` (no piece counts kept), so it is
        asked for only where a replica's KV events are read (``routing.kv_index``)."""
        prompt = dialect.prompt_input(body, self.traits)
        if isinstance(prompt, TextInput):
            ids: list[int] = []
            texts = [p for p in prompt.prompts if isinstance(p, str)]
            encoded = iter(self.tokenizer.encode_batch_fast(texts, add_special_tokens=prompt.add_special_tokens))
            # vLLM takes one prompt per request here; a list of them is no single prefix.
            for p in prompt.prompts:
                ids.extend(p if isinstance(p, tuple) else next(encoded).ids)
            return ids
        if isinstance(prompt, ChatInput):
            return list(self.tokenizer.encode_batch_fast([self.render(prompt)], add_special_tokens=False)[0].ids)
        raise NotCountable(f"{dialect.name} has no prompt to count")

    def encoded_length(self, texts: list[str], add_special_tokens: bool) -> int:
        """The tokens of ``texts``. ``encode_batch_fast`` releases the GIL while it works (plain
        ``encode`` holds it) and skips the offsets no count needs."""
        if not texts:
            return 0
        return sum(len(e) for e in self.tokenizer.encode_batch_fast(texts, add_special_tokens=add_special_tokens))

    def render(self, prompt: ChatInput) -> str:
        """The chat prompt's text, as the replica's template writes it."""
        template = self.template(prompt.tools)
        # The content format is judged on the template for a request without tools, as vLLM does.
        content_format = self.template(None).content_format
        messages = conversation(prompt.messages, content_format, template.developer_role)
        return template.render(messages, prompt.tools, prompt.kwargs, self.special_tokens)

    def _traits(self) -> TemplateTraits:
        merge = any(t.system_first for t in {id(t): t for t in (self.template(None), self.template([]))}.values())
        return TemplateTraits(merge_inline_system=merge, disabled_thinking_effort=self._disabled_thinking_effort())

    def _disabled_thinking_effort(self) -> str:
        """``none`` unless the template refuses it or renders it as some effort (GLM's treats
        an unknown effort as the most), as vLLM's Messages endpoint probes it."""

        def rendered(effort: str) -> str | None:
            prompt = ChatInput(
                [{"role": "user", "content": "Hi"}],
                None,
                {"add_generation_prompt": True, "reasoning_effort": effort, "enable_thinking": effort != "none"},
            )
            try:
                return self.render(prompt)
            except (TemplateError, NotCountable):
                return None

        none = rendered("none")
        if none is None or any(rendered(effort) == none for effort in EFFORTS):
            return "low"
        return "none"


def _json(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise TokenizerError(f"cannot read {path}: {exc}") from exc
    return value if isinstance(value, dict) else {}


def _special_tokens(config: dict[str, Any]) -> dict[str, str]:
    out = {}
    for name in SPECIAL_TOKENS:
        value = config.get(name)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            out[name] = value
    return out


def _template_sources(directory: Path, config: dict[str, Any]) -> dict[str, str]:
    """The chat templates by name: the ``.jinja`` files (transformers v5 writes them) first,
    else ``tokenizer_config.json``'s ``chat_template`` (a string, or a list of named ones)."""
    sources: dict[str, str] = {}
    try:
        main = directory / "chat_template.jinja"
        if main.is_file():
            sources["default"] = main.read_text(encoding="utf-8")
        extra = directory / "additional_chat_templates"
        if extra.is_dir():
            for path in sorted(extra.glob("*.jinja")):
                sources[path.stem] = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise TokenizerError(f"cannot read the chat template in {directory}: {exc}") from exc
    if sources:
        return sources
    value = config.get("chat_template")
    if isinstance(value, str):
        return {"default": value}
    if isinstance(value, list):
        return {t["name"]: t["template"] for t in value if isinstance(t, dict) and "name" in t and "template" in t}
    return {}
