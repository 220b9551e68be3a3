"""esrl.grpo.rollout_batch against TRL 1.16's construction of a micro-batch, written out from
GRPOTrainer._generate_and_score_completions with TRL's own `pad`: prompts left-padded by the tokenizer, completions
right-padded, and with mask_truncated_completions the mask of a completion that ends in neither EOS nor pad zeroed.
Real SmolLM2 tokenizer (also set to put a BOS first), chat and raw prompts, TRL's own tokenization."""

from __future__ import annotations

import pytest
import torch

from esrl.grpo.rollout_batch import rollout_tensors
from esrl.models import load_tokenizer
from esrl.rollout import Completion, encode_prompts

pytest.importorskip("trl")


CHAT = [[{"role": "user", "content": "Say hi."}], [{"role": "user", "content": "Name three colours of the rainbow."}]]
RAW = ["Question: 2 + 2 =", "Name three colours of the rainbow:"]


def trl_prompt_ids(tok, prompts) -> list[list[int]]:
    """TRL 1.16's own tokenization of a batch of prompts (GRPOTrainer._tokenize_prompts, text-only)."""
    from types import SimpleNamespace

    from trl import GRPOTrainer

    trainer = SimpleNamespace(processing_class=tok, _is_vlm=False, environment_factories=None, tools=None,
                              chat_template=None, chat_template_kwargs={})
    return GRPOTrainer._tokenize_prompts(trainer, prompts)[0]


@pytest.fixture(params=["smollm2", "bos_first"])
def tok(request):
    """SmolLM2's tokenizer as it is (no special token before a raw text), and set to put its BOS first as Llama's,
    Gemma's and Mistral's do."""
    if request.param == "smollm2":
        return load_tokenizer("smollm2-135m-instruct")
    from transformers import AutoTokenizer

    from esrl.models.loading import resolve_model_path

    bos = AutoTokenizer.from_pretrained(resolve_model_path("smollm2-135m-instruct"), add_bos_token=True,
                                        padding_side="left")
    assert bos("x")["input_ids"][0] == bos.bos_token_id
    return bos


@pytest.mark.parametrize("prompts", [CHAT, RAW], ids=["chat", "raw"])
def test_prompts_are_tokenized_as_trl_tokenizes_them(tok, prompts):
    """A raw prompt lost the BOS TRL's tokenization gives it (esrl tokenized every rendered prompt without special
    tokens); a chat prompt's template writes its own, once."""
    got = encode_prompts(tok, prompts)
    assert got == trl_prompt_ids(tok, prompts)
    if prompts is RAW:
        adds_bos = tok("x")["input_ids"][0] == tok.bos_token_id
        assert [row[0] == tok.bos_token_id for row in got] == [adds_bos] * len(RAW)


@pytest.mark.parametrize("prompts", [CHAT, RAW], ids=["chat", "raw"])
@pytest.mark.parametrize("mask_truncated", [False, True])
def test_a_micro_batch_is_trls_left_padded_prompts_and_right_padded_completions(tok, prompts, mask_truncated):
    from trl.trainer.utils import pad

    eos = tok.eos_token_id
    ids = [[42, 43, eos], [44, 45, 46, 47], [48, eos], [49, 50, 51, 52]]  # G = 2 per prompt; 2nd and 4th truncated
    completions = [Completion(text="", token_ids=i, truncated=i[-1] != eos) for i in ids]
    rewards, advantages = torch.tensor([1.0, 0.0, 0.5, 0.5]), torch.tensor([1.0, -1.0, 0.0, 0.0])
    got = rollout_tensors(tok, encode_prompts(tok, prompts), completions, rewards, advantages, mask_truncated,
                          torch.device("cpu"))

    trl_ids = [torch.tensor(row) for row in trl_prompt_ids(tok, prompts) for _ in range(2)]  # TRL's pad, left
    prompt_ids = pad(trl_ids, padding_value=tok.pad_token_id, padding_side="left")
    prompt_mask = pad([torch.ones_like(row) for row in trl_ids], padding_value=0, padding_side="left")
    completion_ids = pad([torch.tensor(i) for i in ids], padding_value=tok.pad_token_id, padding_side="right")
    completion_mask = pad([torch.ones(len(i), dtype=torch.long) for i in ids], padding_value=0, padding_side="right")
    # TRL builds its attention mask after masking truncated rows (they then attend to their prompt only); esrl's
    # attends to every generated token: those rows count no loss tokens either way, so the loss is the same
    attention_mask = torch.cat([prompt_mask, completion_mask], 1)
    if mask_truncated:  # TRL: completion_mask * (~is_truncated).unsqueeze(1).int(), is_truncated: no EOS or pad last
        is_truncated = torch.tensor([i[-1] not in (eos, tok.pad_token_id) for i in ids])
        completion_mask = completion_mask * (~is_truncated).unsqueeze(1).int()
    assert torch.equal(got.input_ids, torch.cat([prompt_ids, completion_ids], 1))
    assert torch.equal(got.completion_mask, completion_mask)
    assert torch.equal(got.attention_mask, attention_mask)
    assert got.completion_width == 4 and got.lengths.tolist() == [3, 4, 2, 4]
    assert got.truncated.tolist() == [False, True, False, True]
    assert int(got.completion_mask.sum()) == (5 if mask_truncated else 13)
