"""A model's chat template, rendered as the replica renders it.

vLLM renders chat prompts with transformers' ``apply_chat_template``: a sandboxed Jinja
environment (``trim_blocks``, ``lstrip_blocks``, loop controls, the ``{% generation %}``
tag), its own ``tojson`` (plain ``json.dumps``: no HTML escaping, keys in their order),
``raise_exception`` and ``strftime_now``; the tokenizer's special tokens (``bos_token``...)
and the request's template keywords as variables. This module builds the same environment
with jinja2 alone, and learns what vLLM learns of a template before it renders one: whether
message content reaches it as a string or as a list of parts, whether it knows the
``developer`` role, whether a system message may come after the first turn.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
import jinja2.sandbox
from jinja2 import nodes

# The tag continue_final_message's message gets, to find where the template put its end
# (transformers' ``render_jinja_template``).
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class TemplateError(Exception):
    """A template that does not compile, or a conversation it refuses to render."""


class _Generation(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: marks the assistant's tokens for training;
    renders its body."""

    tags = {"generation"}  # noqa: RUF012 (jinja2 declares it an instance variable)

    def parse(self, parser: jinja2.parser.Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return str(caller())


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


class ChatTemplate:
    """One chat template, compiled once; ``render`` is thread-safe (Jinja templates are)."""

    def __init__(self, source: str) -> None:
        env = _environment()
        try:
            self._template = env.from_string(source)
            ast = env.parse(source)
        except jinja2.TemplateError as exc:
            raise TemplateError(f"the chat template does not compile: {exc}") from exc
        self.source = source
        # The environment's globals flattened once: rendering with them merged into the
        # variables (``shared``) spares Jinja copying its ChainMap of globals per render.
        self._globals = dict(self._template.globals)
        # The variables it reads: the request's template keywords reach it only when named here.
        self.variables = frozenset(jinja2.meta.find_undeclared_variables(ast))
        # "openai": it loops over a message's content parts; "string": it reads the content whole.
        self.content_format = "openai" if any(True for _ in _content_loops(ast)) else "string"
        self.developer_role = '"developer"' in source or "'developer'" in source
        self.system_first = _refuses_inline_system(source)

    def render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        kwargs: dict[str, Any],
        special_tokens: dict[str, str],
    ) -> str:
        """The prompt's text, as transformers' ``apply_chat_template(tokenize=False)`` writes it."""
        kwargs = dict(kwargs)
        add_generation_prompt = bool(kwargs.pop("add_generation_prompt", False))
        continue_final = kwargs.pop("continue_final_message", False)
        documents = kwargs.pop("documents", None)
        variables = {**self._globals, **special_tokens, **{k: v for k, v in kwargs.items() if k in self.variables}}
        variables.update(
            messages=messages, tools=tools, documents=documents, add_generation_prompt=add_generation_prompt
        )
        final_text: str | None = None
        if continue_final:
            variables["messages"], final_text = _tag_final(messages, self.source)
        template = self._template
        try:
            # Template.render without its copies of the variables: the request path renders every prompt.
            rendered = "".join(template.root_render_func(template.new_context(variables, shared=True)))
        except Exception as exc:  # a template raises what it likes (raise_exception, a type error)
            raise TemplateError(f"the chat template refused the conversation: {exc}") from exc
        if final_text is not None:
            rendered = _cut_at_tag(rendered, final_text)
        return rendered


def _tag_final(messages: list[dict[str, Any]], source: str) -> tuple[list[dict[str, Any]], str]:
    """The conversation with its last message's text tagged (so its end can be found), and that text."""
    if not messages or messages[-1].get("content") is None or "content" not in source:
        raise TemplateError("continue_final_message: the final message has no content to continue")
    last = dict(messages[-1])
    content = last["content"]
    if isinstance(content, list):
        parts = [dict(p) if isinstance(p, dict) else p for p in content]
        for part in reversed(parts):
            if isinstance(part, dict) and "text" in part:
                final = part["text"]
                part["text"] = final + _CONTINUE_TAG
                break
        else:
            raise TemplateError("continue_final_message: no text in the final message")
        last["content"] = parts
    else:
        final = content
        last["content"] = content + _CONTINUE_TAG
    return [*messages[:-1], last], str(final)


def _cut_at_tag(rendered: str, final_text: str) -> str:
    tag = _CONTINUE_TAG.strip()
    if final_text.strip() not in rendered or tag not in rendered:
        raise TemplateError("continue_final_message: the template dropped the final message")
    at = rendered.rindex(tag)
    if rendered[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return rendered[:at]
    return rendered[:at].rstrip()


def _refuses_inline_system(source: str) -> bool:
    """Whether the template refuses [system, user, system, user] (Qwen's ``loop.first``
    guard): vLLM then merges Messages' inline system turns into the leading one. vLLM tries
    it in a plain sandbox (no ``raise_exception``: calling it fails all the same)."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    turns = [{"role": r, "content": "t"} for r in ("system", "user", "system", "user")]
    try:
        env.from_string(source).render(messages=turns, add_generation_prompt=False)
    except jinja2.TemplateError:
        return True
    except Exception:  # vLLM would not start on such a template; nothing to learn from it
        return False
    return False


# -- the content format: does the template loop over a message's content? -------------------
# vLLM's detection (vllm/renderers/hf.py, _detect_content_format): find the loops over
# ``messages`` (or a variable set from it), then a loop over ``<message>.content`` (or over
# a variable named ``content``).


def _is_name(node: nodes.Node, name: str) -> bool:
    return isinstance(node, nodes.Name) and node.ctx == "load" and node.name == name


def _is_field(node: nodes.Node, name: str, key: str) -> bool:
    if isinstance(node, nodes.Getitem):
        return _is_name(node.node, name) and isinstance(node.arg, nodes.Const) and node.arg.value == key
    if isinstance(node, nodes.Getattr):
        return _is_name(node.node, name) and node.attr == key
    return False


def _reads(node: nodes.Node, name: str, key: str | None = None) -> bool:
    """Whether ``node`` is ``name`` (or ``name[key]``), possibly filtered, tested or sliced."""
    if isinstance(node, nodes.Filter | nodes.Test):
        return node.node is not None and _reads(node.node, name, key)
    if isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice):
        return _reads(node.node, name, key)
    return _is_field(node, name, key) if key else _is_name(node, name)


def _aliases(root: nodes.Template, name: str) -> list[str]:
    """``name`` and every variable set from it (transitively)."""
    found, queue = [name], [name]
    while queue:
        current = queue.pop(0)
        for assign in root.find_all(nodes.Assign):
            target = assign.target
            if _reads(assign.node, current) and isinstance(target, nodes.Name) and target.name != current:
                found.append(target.name)
                queue.append(target.name)
    return found


def _content_loops(root: nodes.Template) -> Iterator[nodes.For]:
    message_names = [
        loop.target.name
        for loop in root.find_all(nodes.For)
        for alias in _aliases(root, "messages")
        if _reads(loop.iter, alias) and isinstance(loop.target, nodes.Name)
    ]

    def is_content(node: nodes.Node) -> bool:
        return any(_reads(node, name, "content") for name in message_names)

    # Loops in macros, and the macro parameters that are given a message's content.
    macro_loops: dict[int, set[str]] = {}
    for macro in root.find_all(nodes.Macro):
        params = [a.name for a in macro.args]
        given: set[str] = set()
        for call in root.find_all(nodes.Call):
            if not _is_name(call.node, macro.name):
                continue
            given.update(params[i] for i, arg in enumerate(call.args[: len(params)]) if is_content(arg))
            given.update(kw.key for kw in call.kwargs if kw.key in params and is_content(kw.value))
        for loop in macro.find_all(nodes.For):
            macro_loops[id(loop)] = given
    for loop in root.find_all(nodes.For):
        if is_content(loop.iter):
            yield loop
        elif id(loop) in macro_loops:
            if isinstance(loop.iter, nodes.Name) and loop.iter.name in macro_loops[id(loop)]:
                yield loop
        elif _is_name(loop.iter, "content"):
            yield loop
