"""Text helpers shared by the verifiers."""

from __future__ import annotations

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def final_answer_text(response: str) -> str | None:
    """The part of a response that may hold the answer: the text after the last ``</think>``.

    None when a ``<think>`` block was opened and never closed: the response is unfinished and
    gave no answer (a thinking model cut off at max_tokens), which every verifier scores 0.
    """
    if THINK_CLOSE in response:
        return response.rsplit(THINK_CLOSE, 1)[1]
    if THINK_OPEN in response:
        return None
    return response
