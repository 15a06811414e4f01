"""A request body read into a ``Call`` by its dialect, and the checks the gateway adds.

The dialect (``dialects``) knows the API's body; this module turns its refusal into the
gateway's 400 and refuses a prompt that cannot fit the model's context.
"""

from __future__ import annotations

from dialects.base import Call, Dialect, InvalidBody
from gateway.errors import BadRequest


def parse_call(dialect: Dialect, raw: bytes, content_type: str | None = None) -> Call:
    """Validate ``raw`` for ``dialect``; raise ``BadRequest`` with ``param`` set."""
    try:
        return dialect.parse(raw, content_type)
    except InvalidBody as exc:
        raise BadRequest(exc.message, param=exc.param, code=exc.code) from exc


def context_overflow(call: Call, max_model_len: int) -> BadRequest | None:
    """OpenAI's 400 ``context_length_exceeded`` when the prompt and ``max_tokens`` cannot fit
    in a context of ``max_model_len`` tokens; None when they may.

    The prompt's size is the model's tokenizer's count where it has one (``tokens``): the
    replica's own. Otherwise it is the estimate (``CHARS_PER_TOKEN``), so a prompt near the
    limit may be judged either way; the point is then to refuse a request that plainly
    cannot fit before it takes a quota, a queue slot or a replica.
    """
    prompt = call.prompt_tokens
    completion = call.max_tokens or 0
    if prompt + completion <= max_model_len:
        return None
    param = call.dialect.prompt_param
    where = "messages" if param == "messages" else "prompt"
    about = "" if call.prompt_tokens_counted else "about "
    return BadRequest(
        f"This model's maximum context length is {max_model_len} tokens. However, you requested "
        f"{about}{prompt + completion} tokens ({prompt} in the {where}, {completion} in the completion). "
        f"Please reduce the length of the {where} or completion.",
        code="context_length_exceeded",
        param=param,
    )
