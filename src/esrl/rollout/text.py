"""Prompt rendering and stop-string cutting, shared by every engine so all of them see and return the same text."""

from __future__ import annotations

from typing import Sequence

from esrl.tasks.base import Prompt


def render_prompts(tokenizer, prompts: Sequence[Prompt]) -> list[str]:
    """Chat prompts through the tokenizer's chat template; raw prompts as they are."""
    return [tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=False) if isinstance(p, list)
            else p for p in prompts]


def cut_at_stop(text: str, stop: Sequence[str]) -> tuple[str, bool]:
    """`text` up to and including the earliest stop string, and whether one was found."""
    cut = min((i + len(s) for s in stop if (i := text.find(s)) >= 0), default=-1)
    return (text[:cut], True) if cut >= 0 else (text, False)
