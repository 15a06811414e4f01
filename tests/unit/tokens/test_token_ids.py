"""A prompt's token ids (what the exact prefix index hashes): the same tokens the count counts,
in order, and kept on the call only when asked for."""

from __future__ import annotations

import asyncio
from pathlib import Path

from dialects.openai import CHAT, COMPLETIONS
from tests.unit.tokens.test_counting import _call, tiny_model
from tokens.counter import PromptCounter
from tokens.model_tokenizer import ModelTokenizer

# tiny_model's vocabulary: <unk> 0, <|im_start|> 1, <|im_end|> 2, <s> 3; every word is <unk>.
BODY = {"messages": [{"role": "system", "content": "Be brief ."}, {"role": "user", "content": "Hello world"}]}


def test_chat_ids_are_the_rendered_prompts_tokens_in_order(tmp_path: Path) -> None:
    model = ModelTokenizer.load(tiny_model(tmp_path / "m"))
    ids = model.token_ids(CHAT, BODY)
    # <|im_start|> system Be brief . <|im_end|> <|im_start|> user Hello world <|im_end|> <|im_start|> assistant
    assert ids == [1, 0, 0, 0, 0, 2, 1, 0, 0, 0, 2, 1, 0]
    assert len(ids) == model.count(CHAT, BODY)


def test_completion_ids_keep_given_ids_and_encode_text(tmp_path: Path) -> None:
    model = ModelTokenizer.load(tiny_model(tmp_path / "m"))
    assert model.token_ids(COMPLETIONS, {"prompt": [[7, 8], "a b"]}) == [7, 8, 0, 0]


def test_the_counter_keeps_ids_only_when_asked(tmp_path: Path) -> None:
    model = ModelTokenizer.load(tiny_model(tmp_path / "m"))
    long_body = {"messages": [{"role": "user", "content": "word " * 3000}]}
    for body in (BODY, long_body):  # inline, and on a worker thread
        counter = PromptCounter({"m": model}, inline_max_tokens=512)
        plain, kept = _call(CHAT, body), _call(CHAT, body)
        asyncio.run(counter.count("m", plain))
        asyncio.run(counter.count("m", kept, ids=True))
        counter.close()
        assert plain.prompt_token_ids is None
        assert kept.prompt_token_ids is not None and len(kept.prompt_token_ids) == kept.prompt_tokens
        assert kept.prompt_tokens == plain.prompt_tokens and kept.prompt_tokens_counted
