"""Prompt rendering and stop-string cutting, shared by every engine so all of them see and return the same text."""

from __future__ import annotations

from typing import Sequence

from esrl.errors import ConfigError, DataError
from esrl.tasks.base import Prompt


def render_prompts(tokenizer, prompts: Sequence[Prompt]) -> list[str]:
    """Chat prompts through the tokenizer's chat template; raw prompts as they are. A tokenizer without a template
    (a base model's) cannot render chat prompts: one line saying what to change, not transformers' traceback."""
    if getattr(tokenizer, "chat_template", None) is None and any(isinstance(p, list) for p in prompts):
        raise ConfigError(f"model.policy: the tokenizer of {getattr(tokenizer, 'name_or_path', 'the model')!r} has "
                          "no chat template, and the task's prompts are chat messages: use a chat (instruct) model, "
                          "or raw prompts (jsonl and math tasks: data.task_args.chat false)")
    try:
        return [tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=False) if isinstance(p, list)
                else p for p in prompts]
    except Exception as e:  # jinja2's TemplateError: a template that refuses a role ("System role not supported")
        if type(e).__module__.split(".")[0] != "jinja2":
            raise
        raise ConfigError(f"model.policy: the chat template of {getattr(tokenizer, 'name_or_path', 'the model')!r} "
                          f"refuses the task's prompt: {e} (a system prompt on a model without that role: leave "
                          "data.task_args.system_prompt out)") from None


def encode_prompts(tokenizer, prompts: Sequence[Prompt]) -> list[list[int]]:
    """Each prompt's token ids as TRL's GRPOTrainer tokenizes them: chat messages through the chat template, which
    writes its own special tokens; raw text with the tokenizer's own (Llama's, Gemma's and Mistral's put a BOS
    first; Qwen's and SmolLM2's add none). Every engine, the GRPO loss and the evaluation's KL use these ids: a raw
    prompt once lost its BOS, which a base model was trained to see."""
    texts = render_prompts(tokenizer, prompts)
    return [tokenizer(text, add_special_tokens=not isinstance(prompt, list))["input_ids"]
            for prompt, text in zip(prompts, texts)]


def left_padded(tokenizer, ids: Sequence[Sequence[int]], pad_to_multiple_of: int | None = None) -> dict:
    """Rows of token ids as left-padded `input_ids` and `attention_mask` tensors (the tokenizer's own pad)."""
    return tokenizer.pad({"input_ids": [list(row) for row in ids]}, padding=True, return_tensors="pt",
                         pad_to_multiple_of=pad_to_multiple_of, padding_side="left")


def cut_at_stop(text: str, stop: Sequence[str]) -> tuple[str, bool]:
    """`text` up to and including the earliest stop string, and whether one was found."""
    cut = min((i + len(s) for s in stop if (i := text.find(s)) >= 0), default=-1)
    return (text[:cut], True) if cut >= 0 else (text, False)


def check_context(prompt_tokens: Sequence[int], max_new_tokens: int, context: int | None,
                  prompts: Sequence[Prompt]) -> None:
    """Every prompt leaves room for max_new_tokens within the model's context (HF: its max_position_embeddings;
    vLLM: max_model_len), else one DataError naming the longest: past it HF reads positions the model never
    learned, vLLM stops the completion short, and a runaway prompt (a data line of megabytes) would take the
    attention hours. Not truncated silently: the prompt is the task's."""
    if context is None or not prompt_tokens:
        return
    longest = max(range(len(prompt_tokens)), key=lambda i: prompt_tokens[i])
    if prompt_tokens[longest] + max_new_tokens > context:
        prompt = prompts[longest]
        text = prompt[-1].get("content", "") if isinstance(prompt, list) and prompt else str(prompt)
        raise DataError(f"a prompt of {prompt_tokens[longest]} tokens and model.rollout.max_new_tokens "
                        f"{max_new_tokens} exceed the model's context of {context} tokens; shorten the task's "
                        f"prompts or max_new_tokens: {text[:60]!r}...")
