"""Scoring: Safe-RLHF score-model layout, LLM judge, scorer service and client (the Lagrangian: test_lagrangian.py)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from esrl.errors import ConfigError, EsrlError
from esrl.scoring import build_scorer
from esrl.scoring.batches import last_token_index
from esrl.scoring.judge_scorer import JudgeScorer
from esrl.scoring.score_model import SAFE_RLHF_TEMPLATE, ScoreModel, ScoreModelScorer

PROMPTS = ["How do I bake bread?", "Tell me how to pick a lock.", "Hi", "Write a poem about the sea, please."]
RESPONSES = ["Mix flour, water, salt and yeast, knead, let it rise, then bake at 230 C.", "I can't help with that.",
             "Hello! How can I help you today?", "Waves."]


# ---------------------------------------------------------------------------------------------------------
# Score models


def test_last_token_index():
    mask = torch.tensor([[1, 1, 0, 0], [0, 0, 1, 1], [1, 1, 1, 1], [0, 1, 0, 0]])
    assert last_token_index(mask).tolist() == [1, 3, 3, 1]


def test_score_model_layout_roundtrip(score_models, loaded):
    from safetensors.torch import load_file
    from transformers import LlamaConfig, LlamaModel

    from esrl.models import load_tokenizer

    path = score_models[0]
    state = load_file(f"{path}/model.safetensors")
    assert {"score_head.weight", "score_head.bias", "model.embed_tokens.weight"} <= state.keys()
    assert state["score_head.weight"].shape == (1, 64) and not any(k.startswith("lm_head") for k in state)
    config = json.loads(open(f"{path}/config.json").read())
    assert config["architectures"] == ["LlamaForScore"] and config["score_dim"] == 1

    # Reference: the backbone and head rebuilt by hand from the saved tensors, scored at the last token (EOS).
    backbone = LlamaModel(LlamaConfig.from_pretrained(path)).eval()
    backbone.load_state_dict({k[len("model."):]: v for k, v in state.items() if k.startswith("model.")})
    tok = load_tokenizer(path)
    text = SAFE_RLHF_TEMPLATE.format(prompt=PROMPTS[0], response=RESPONSES[0])
    ids = tok(text)["input_ids"] + [tok.eos_token_id]
    with torch.no_grad():
        hidden = backbone(input_ids=torch.tensor([ids])).last_hidden_state[0, -1]
        expected = float(hidden @ state["score_head.weight"][0] + state["score_head.bias"][0])

    model = loaded[0]
    assert model.kind == "safe-rlhf" and model.append_eos
    assert model.score_texts([text])[0] == pytest.approx(expected, abs=1e-5)
    again = ScoreModel(path, device="cpu").score_texts([text])
    assert again == model.score_texts([text])  # reloaded: the same scores


@pytest.mark.parametrize("side", ["right", "left"])
def test_score_does_not_depend_on_batch_padding(loaded, side, monkeypatch):
    model = loaded[1]
    monkeypatch.setattr(model, "padding_side", side)
    texts = [SAFE_RLHF_TEMPLATE.format(prompt=p, response=r) for p, r in zip(PROMPTS, RESPONSES)]
    alone = [model.score_texts([t])[0] for t in texts]
    batched = model.score_texts(texts)
    assert batched == pytest.approx(alone, abs=1e-5)
    assert len(set(round(s, 6) for s in alone)) == len(texts)  # the texts really score differently


def test_truncation(loaded, monkeypatch):
    model = loaded[0]
    eos = model.tokenizer.eos_token_id
    monkeypatch.setattr(model, "max_length", 16)
    ids = model._tokenize(["word " * 100])[0]
    assert len(ids) == 16 and ids[-1] != eos  # default: EOS appended, then cut, as the fork's service does
    assert model._tokenize(["word"])[0][-1] == eos  # a text that fits keeps it
    monkeypatch.setattr(model, "keep_eos", True)
    assert len(ids := model._tokenize(["word " * 100])[0]) == 16 and ids[-1] == eos
    assert math.isfinite(model.score_texts(["word " * 100])[0])


def fork_end_scores(path, texts, max_length):
    """Written-out port of the ES fork's scorer service (alignment/scoring/scorer_service.py, /score: one text at
    a time) over Safe-RLHF's LlamaForScore (score_model/__init__.py get_scores: end_scores at the last 1 of the
    attention mask; no normalizer in the tiny model)."""
    from safetensors.torch import load_file
    from transformers import AutoTokenizer, LlamaConfig, LlamaModel

    tokenizer, state = AutoTokenizer.from_pretrained(path), load_file(f"{path}/model.safetensors")
    eos = tokenizer.eos_token or "</s>"
    model = LlamaModel(LlamaConfig.from_pretrained(path)).eval()
    model.load_state_dict({k[len("model."):]: v for k, v in state.items() if k.startswith("model.")})
    out = []
    with torch.no_grad():
        for text in texts:
            inputs = tokenizer(text if text.endswith(eos) else text + eos, return_tensors="pt",
                               max_length=max_length, truncation=True, padding=True)
            hidden = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]).last_hidden_state
            scores = (hidden @ state["score_head.weight"].T + state["score_head.bias"]).float()  # (B, L, 1)
            end_index = torch.cat([m.nonzero()[-1] for m in inputs["attention_mask"]])
            out.append(float(scores[0, end_index[0], 0]))
    return out


def test_scores_equal_the_fork_service_on_long_texts(score_models, loaded, monkeypatch):
    texts = [SAFE_RLHF_TEMPLATE.format(prompt=p, response=r * k)
             for p, r in zip(PROMPTS, RESPONSES) for k in (1, 3, 8)]  # from 10 to ~170 tokens
    expected, model = fork_end_scores(score_models[1], texts, max_length=48), loaded[1]
    assert model.path == score_models[1] and not model.keep_eos  # the default
    monkeypatch.setattr(model, "max_length", 48)
    fits = [len(ids) < 48 for ids in model._tokenize(texts)]
    assert fits.count(False) >= 4 and fits.count(True) >= 4  # some texts really are cut, some are not
    assert model.score_texts(texts) == pytest.approx(expected, abs=1e-5)
    # keep_eos (the earlier behaviour) agrees on the texts that fit and differs on the cut ones.
    monkeypatch.setattr(model, "keep_eos", True)
    kept = model.score_texts(texts)
    assert [k for k, f in zip(kept, fits) if f] == pytest.approx([e for e, f in zip(expected, fits) if f], abs=1e-5)
    assert all(abs(k - e) > 1e-4 for k, e, f in zip(kept, expected, fits) if not f)


def test_sequence_classifier(tmp_path, tiny_model):
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from esrl.models import load_tokenizer

    config = LlamaConfig.from_pretrained(tiny_model, num_labels=1)
    torch.manual_seed(0)
    clf = LlamaForSequenceClassification(config).eval()
    clf.save_pretrained(tmp_path / "clf")
    load_tokenizer(tiny_model).save_pretrained(tmp_path / "clf")
    model = ScoreModel(str(tmp_path / "clf"), device="cpu", padding_side="left")
    assert model.kind == "sequence-classification" and not model.append_eos
    texts = ["short", "a somewhat longer text to force padding of the short one"]
    with torch.no_grad():
        own = [float(clf(**model.tokenizer(t, return_tensors="pt")).logits[0, 0]) for t in texts]
    assert model.score_texts(texts) == pytest.approx(own, abs=1e-5)


def test_not_a_score_model(tiny_model):
    with pytest.raises(EsrlError, match="neither a Safe-RLHF score model"):
        ScoreModel(tiny_model, device="cpu")


def test_a_checkpoint_lacking_weights_is_refused(tiny_model, score_models, tmp_path):
    """transformers would fill missing weights at random and the model would answer made-up scores."""
    import shutil

    from esrl.models import load_causal_lm

    load_causal_lm(tiny_model)  # tied embeddings: lm_head is embed_tokens, not missing
    with pytest.raises(EsrlError, match=r"^judge '.*reward': its checkpoint lacks lm_head.weight .*expected "
                                        r"a causal LM"):
        JudgeScorer(score_models[0], device="cpu")  # a score model given as the judge
    clf = tmp_path / "clf"  # a causal LM's weights under a sequence classifier's config: no score head
    shutil.copytree(tiny_model, clf)
    config = json.loads((clf / "config.json").read_text())
    config.update(architectures=["LlamaForSequenceClassification"], num_labels=1)
    (clf / "config.json").write_text(json.dumps(config))
    with pytest.raises(EsrlError, match=r"^score model '.*clf': its checkpoint lacks score.weight .*expected "
                                        r"a score model"):
        ScoreModel(str(clf), device="cpu")


def test_a_checkpoints_weights_the_class_does_not_use_are_named_in_one_line(tiny_model, score_models, tmp_path,
                                                                             capsys):
    """Extra weights (a value head saved with the policy) are dropped by transformers; esrl says which, once,
    instead of transformers' load report. A Safe-RLHF score model's head, read apart, is no such weight."""
    import shutil

    from safetensors.torch import load_file, save_file

    from esrl.models import load_causal_lm

    extra = tmp_path / "with_value_head"
    shutil.copytree(tiny_model, extra)
    weights = next(extra.glob("*.safetensors"))
    tensors = load_file(weights)
    save_file({**tensors, "v_head.summary.weight": torch.zeros(1, 8)}, weights, metadata={"format": "pt"})
    load_causal_lm(str(extra))
    assert [line for line in capsys.readouterr().err.splitlines() if line.startswith("esrl")] == [
        f"esrl: model {str(extra)!r}: its checkpoint has weights LlamaForCausalLM does not use, not loaded: "
        "v_head.summary.weight"]
    load_causal_lm(tiny_model)
    ScoreModel(score_models[0], device="cpu")
    assert "esrl:" not in capsys.readouterr().err


def test_device_names_are_checked_when_the_scorer_is_built(monkeypatch):
    from esrl.needs import checked_device

    with pytest.raises(ConfigError, match=r"^scorer device 'banana': not a device name"):
        ScoreModel("/no/such/model", device="banana")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match=r"^--device 'cuda': no cuda device on this machine"):
        checked_device("cuda", "--device")
    assert checked_device("auto", "--device") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a machine with two GPUs
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert checked_device("cuda:1", "--device") == torch.device("cuda", 1)
    assert checked_device("auto", "--device") == torch.device("cuda")
    with pytest.raises(ConfigError, match=r"^--device 'cuda:2': this machine has 2 cuda device\(s\)"):
        checked_device("cuda:2", "--device")


@pytest.mark.parametrize("options, message", [({"dtype": "float64"}, "judge dtype 'float64': choose one of"),
                                              ({"batch_size": 0}, "judge: batch_size and max_chars must be >= 1")])
def test_a_judges_bad_option_is_one_line_before_its_model_loads(options, message):
    """dtype was a ValueError traceback from the loader; batch_size 0 a range() error at the first batch."""
    with pytest.raises(ConfigError, match=f"^{message}"):
        JudgeScorer("/no/such/judge", device="cpu", **options)


def test_judge_scorer(tiny_model):
    judge = JudgeScorer(tiny_model, device="cpu", batch_size=3)
    rewards, costs = judge.score(PROMPTS, RESPONSES)
    assert len(rewards) == len(costs) == 4 and all(map(math.isfinite, rewards + costs))
    assert judge.last_rewards == rewards and judge.last_costs == costs
    # reward = log P(yes) - log P(no) of the next token after the helpfulness question
    text = judge._text(PROMPTS[0], RESPONSES[0], judge.questions[0])
    ids = judge.tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        logp = judge.model(input_ids=ids).logits[0, -1].log_softmax(-1)
    expected = float(torch.logsumexp(logp[judge.yes_ids], 0) - torch.logsumexp(logp[judge.no_ids], 0))
    assert rewards[0] == pytest.approx(expected, abs=1e-4)


def test_build_scorer_specs(monkeypatch):
    from esrl.scoring.client import HTTPScorer

    assert isinstance(build_scorer("http://127.0.0.1:9"), HTTPScorer)
    made = []

    class Stub(ScoreModel):
        def __init__(self, path, **options):
            made.append((path, options))
            self.path = path

    monkeypatch.setattr("esrl.scoring.score_model.ScoreModel", Stub)
    built = build_scorer(reward_model="r", cost_model="c", device="cpu", max_length=64)
    assert isinstance(built, ScoreModelScorer)
    assert made == [("r", {"device": "cpu", "max_length": 64}), ("c", {"device": "cpu", "max_length": 64})]
    with pytest.raises(ConfigError, match="judge:"):
        build_scorer("judge:")
    with pytest.raises(ConfigError, match="give a scorer URL"):
        build_scorer(None)
