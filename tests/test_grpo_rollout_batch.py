"""esrl.grpo.rollout_batch against TRL 1.16's construction of a micro-batch, written out from
GRPOTrainer._generate_and_score_completions with TRL's own `pad`: prompts left-padded by the tokenizer, completions
right-padded, and with mask_truncated_completions the mask of a completion that ends in neither EOS nor pad zeroed.
Real SmolLM2 tokenizer, chat-rendered prompts."""

from __future__ import annotations

import pytest
import torch

from esrl.grpo.rollout_batch import rollout_tensors
from esrl.models import load_tokenizer
from esrl.rollout import Completion, render_prompts

pytest.importorskip("trl")


@pytest.mark.parametrize("mask_truncated", [False, True])
def test_a_micro_batch_is_trls_left_padded_prompts_and_right_padded_completions(mask_truncated):
    from trl.trainer.utils import pad

    tok = load_tokenizer("smollm2-135m-instruct")
    prompts = render_prompts(tok, [[{"role": "user", "content": "Say hi."}],
                                   [{"role": "user", "content": "Name three colours of the rainbow, briefly."}]])
    eos = tok.eos_token_id
    ids = [[42, 43, eos], [44, 45, 46, 47], [48, eos], [49, 50, 51, 52]]  # G = 2 per prompt; 2nd and 4th truncated
    completions = [Completion(text="", token_ids=i, truncated=i[-1] != eos) for i in ids]
    rewards, advantages = torch.tensor([1.0, 0.0, 0.5, 0.5]), torch.tensor([1.0, -1.0, 0.0, 0.0])
    got = rollout_tensors(tok, prompts, completions, rewards, advantages, mask_truncated, torch.device("cpu"))

    enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)  # padding_side left, as TRL's
    prompt_ids, prompt_mask = enc["input_ids"].repeat_interleave(2, 0), enc["attention_mask"].repeat_interleave(2, 0)
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
