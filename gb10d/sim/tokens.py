"""The stand-in's tokenizer and its one answer: the words every generation produces, and a count of a prompt's tokens.

Apart from the routes so that the pooling routes, the generate routes and
the tests that check a streamed answer word for word share one source.
"""

from __future__ import annotations

from typing import Any

WORDS = ("The", "stand-in", "engine", "answers", "every", "prompt", "with", "this", "same", "short", "calm", "sentence", ".")
CHAT_ANSWER_TOKENS = len(WORDS)
TEMPLATE_TOKENS = 10


def token_text(index: int) -> str:
    """The deterministic text of generated token number `index`."""
    return " " + WORDS[index % len(WORDS)]


def count_prompt_tokens(prompt: Any) -> int:
    """A stable stand-in for tokenization: one token per word, plus BOS."""
    if isinstance(prompt, list):
        return sum(count_prompt_tokens(p) if isinstance(p, str) else 1 for p in prompt) or 1
    return len(str(prompt or "").split()) + 1
