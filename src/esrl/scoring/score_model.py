"""Reward and cost models, loaded without the safe-rlhf package.

Safe-RLHF's score-model layout (`LlamaForScore` and friends, as `AutoModelForScore.save_pretrained` writes it):
- config.json of the backbone (`model_type` "llama", ...) with `architectures: ["LlamaForScore"]` and the score
  head's settings: `score_dim` (1), `score_bias` (true), `score_type` ("reward" or "cost"), `do_normalize`,
  `normalizer_type`, and optionally `mean`/`var`;
- weights: the decoder under `model.` (e.g. `model.embed_tokens.weight`, `model.layers.0...`), the head as
  `score_head.weight` [score_dim, hidden] and `score_head.bias` [score_dim], optionally `normalizer.mean/var/count`
  buffers; no `lm_head`.
The score of a text is the head's output at its last real token (the last 1 of the attention mask, so padding
on either side gives the same score). Safe-RLHF trains on "BEGINNING OF CONVERSATION: USER: {prompt}
ASSISTANT:{response}" followed by the EOS token, so that is what is scored here, fed as the ES fork's scorer
service feeds it (alignment/scoring/scorer_service.py: the EOS appended to the text as a string, then the whole
tokenized and cut at max_length): a text longer than max_length loses its EOS and is scored at its last kept
token. `keep_eos=True` cuts the text at max_length - 1 tokens and always ends it with the EOS instead.

Any `AutoModelForSequenceClassification` with one label works too: decoders with a `score` head are scored at the
last real token in the same way; other models (encoders) through their own pooling.

The LM judge is esrl.scoring.judge_scorer; a tiny random model in this layout is esrl.models.tiny.tiny_score_model.
"""

from __future__ import annotations

import inspect
import json
import math
from pathlib import Path
from typing import Any, Sequence

import torch

from esrl.errors import ConfigError, ModelNotFoundError
from esrl.models.loading import DTYPES, load_complete, load_tokenizer, resolve_model_path
from esrl.needs import checked_device
from esrl.scoring.base import Scorer
from esrl.scoring.batches import last_token_index, pad_batch, place, position_ids

SAFE_RLHF_TEMPLATE = "BEGINNING OF CONVERSATION: USER: {prompt} ASSISTANT:{response}"
SCORE_MODEL = ("a score model (a Safe-RLHF ...ForScore, or a one-label ...ForSequenceClassification with its "
               "score head)")


def _accepts(module: torch.nn.Module, name: str) -> bool:
    try:
        return name in inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return False


def _read_prefixed(path: str, prefix: str) -> dict[str, torch.Tensor]:
    """Tensors whose names start with `prefix` from a checkpoint (folder or hub id; safetensors or .bin, sharded
    or not), reading only the shards that hold them."""
    from transformers.utils import cached_file

    def fetch(name: str) -> str | None:
        return cached_file(path, name, _raise_exceptions_for_missing_entries=False,
                           _raise_exceptions_for_connection_errors=False)

    for index_name, single in (("model.safetensors.index.json", "model.safetensors"),
                               ("pytorch_model.bin.index.json", "pytorch_model.bin")):
        files: list[str] = []
        index = fetch(index_name)
        if index is not None:
            weight_map = json.loads(Path(index).read_text())["weight_map"]
            files = sorted({f for k, f in weight_map.items() if k.startswith(prefix)})
        elif fetch(single) is not None:
            files = [single]
        else:
            continue
        out: dict[str, torch.Tensor] = {}
        for name in files:
            local = fetch(name)
            if local is None:
                raise ModelNotFoundError(f"score model {path!r}: checkpoint file {name} is missing")
            if name.endswith(".safetensors"):
                from safetensors import safe_open

                with safe_open(local, framework="pt") as f:
                    out.update({k: f.get_tensor(k) for k in f.keys() if k.startswith(prefix)})
            else:
                state = torch.load(local, map_location="cpu", weights_only=True)
                out.update({k: v for k, v in state.items() if k.startswith(prefix)})
        return out
    raise ModelNotFoundError(f"score model {path!r}: no model.safetensors or pytorch_model.bin (sharded or not)")


class ScoreModel:
    """One reward or cost model: texts in, one float per text out (batched, padded, truncated).

    Args:
        path: local folder or hub id of a Safe-RLHF score model (`...ForScore`) or a one-label sequence classifier.
        device: "auto" (CUDA when there is one), "cpu", "cuda", "cuda:1", ...
        dtype: float32, bfloat16 or float16 weights (scores are returned as float32 numbers).
        max_length: tokens per text at most (longer texts are cut at the end, as Safe-RLHF's training did).
        batch_size: texts per forward pass.
        padding_side: "right" or "left"; the score does not depend on it.
        append_eos: end each text with the EOS token (default: yes for the Safe-RLHF layout, as it trains so).
        keep_eos: with append_eos, what a text longer than max_length keeps. False (default): the EOS is
            appended to the text and the whole is cut at max_length tokens, so a long text loses its EOS and
            is scored at its last kept token, exactly as the ES fork's scorer service feeds Safe-RLHF's models.
            True: the text is cut at max_length - 1 tokens and always ends with the EOS (the token Safe-RLHF
            trains the score at; esrl's behaviour before issue 16). Texts that fit score the same either way.
    """

    def __init__(self, path: str, device: str = "auto", dtype: str = "float32", max_length: int = 512,
                 batch_size: int = 8, padding_side: str = "right", append_eos: bool | None = None,
                 keep_eos: bool = False):
        from transformers import AutoConfig

        if dtype not in DTYPES:
            raise ConfigError(f"scorer dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
        if padding_side not in ("right", "left"):
            raise ConfigError(f"scorer padding_side {padding_side!r}: choose right or left")
        if max_length < 2 or batch_size < 1:
            raise ConfigError(f"scorer: max_length must be >= 2 and batch_size >= 1, got {max_length}, {batch_size}")
        self.path = path
        self.device = checked_device(device, "scorer device")
        self.max_length = max_length
        self.batch_size = batch_size
        self.padding_side = padding_side
        self.keep_eos = keep_eos
        resolved = resolve_model_path(path)
        try:
            config = AutoConfig.from_pretrained(resolved)
        except (OSError, ValueError) as e:
            raise ModelNotFoundError(f"score model {path!r}: cannot read its config "
                                     f"({str(e).splitlines()[0]})") from None
        archs = list(getattr(config, "architectures", None) or [])
        self.tokenizer = load_tokenizer(path)
        torch_dtype = DTYPES[dtype]
        self.head: torch.nn.Module | None = None
        self.normalize = None
        if any(a.endswith("ForScore") for a in archs) or hasattr(config, "score_dim"):
            self.kind = "safe-rlhf"
            self._load_safe_rlhf(resolved, config, torch_dtype)
        elif any(a.endswith("ForSequenceClassification") for a in archs):
            self.kind = "sequence-classification"
            self._load_seq_cls(resolved, config, torch_dtype)
        else:
            raise ModelNotFoundError(
                f"score model {path!r}: architectures {archs or 'unknown'} are neither a Safe-RLHF score model "
                "(...ForScore with a score_head) nor a sequence classifier (...ForSequenceClassification)")
        self.append_eos = (self.kind == "safe-rlhf") if append_eos is None else append_eos
        self.backbone.eval()  # on self.device at the first batch (esrl.scoring.batches.place says why)
        if self.head is not None:
            self.head.eval()
        self._placed: torch.device | None = None

    def _load_safe_rlhf(self, resolved: str, config: Any, dtype: torch.dtype) -> None:
        from transformers import AutoModel

        score_dim = int(getattr(config, "score_dim", 1))
        if score_dim != 1:
            raise ConfigError(f"score model {self.path!r}: score_dim is {score_dim}; esrl needs one score per text")
        tensors = _read_prefixed(resolved, "score_head.")
        if "score_head.weight" not in tensors:
            raise ModelNotFoundError(f"score model {self.path!r}: no score_head.weight in its checkpoint")
        weight = tensors["score_head.weight"]
        bias = tensors.get("score_head.bias")
        head = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
        with torch.no_grad():
            head.weight.copy_(weight)
            if bias is not None:
                head.bias.copy_(bias)
        self.head = head.to(dtype)
        # AutoModel maps "llama" to LlamaModel and strips the `model.` prefix of the checkpoint's keys; the
        # score head, read above, is an unexpected key to it.
        self.backbone = load_complete(AutoModel, self.path, SCORE_MODEL, "score model", report_unexpected=False,
                                      dtype=dtype)
        if getattr(config, "do_normalize", False):
            stats = _read_prefixed(resolved, "normalizer.")
            mean = stats.get("normalizer.mean", torch.tensor(getattr(config, "mean", None) or [0.0]))
            var = stats.get("normalizer.var", torch.tensor(getattr(config, "var", None) or [1.0]))
            mean, std = float(mean.reshape(-1)[0]), math.sqrt(float(var.reshape(-1)[0]))
            kind = getattr(config, "score_type", "reward")
            if kind == "reward":  # Safe-RLHF: affine for rewards, scale for costs, identity for critics
                self.normalize = lambda s: (s - mean) / (std + 1e-8)
            elif kind == "cost":
                self.normalize = lambda s: s / (std + 1e-8)

    def _load_seq_cls(self, resolved: str, config: Any, dtype: torch.dtype) -> None:
        from transformers import AutoModelForSequenceClassification

        if getattr(config, "num_labels", 1) != 1:
            raise ConfigError(f"score model {self.path!r}: a sequence classifier with {config.num_labels} labels; "
                              "a reward/cost model has exactly one")
        model = load_complete(AutoModelForSequenceClassification, self.path, SCORE_MODEL, "score model",
                              dtype=dtype)
        if model.config.pad_token_id is None:
            model.config.pad_token_id = self.tokenizer.pad_token_id
        score = getattr(model, "score", None)
        base = getattr(model, getattr(model, "base_model_prefix", ""), None)
        if isinstance(score, torch.nn.Linear) and base is not None and not config.is_encoder_decoder:
            self.backbone, self.head = base, score  # decoder: score at the last real token, as above
        else:
            self.backbone = model  # encoder: its own pooling (first token); right padding
            self.padding_side = "right"

    def _tokenize(self, texts: Sequence[str]) -> list[list[int]]:
        tok = self.tokenizer
        if self.append_eos and not self.keep_eos:  # the fork's service: text + EOS string, then cut
            eos_text = tok.eos_token or "</s>"
            texts = [t if t.endswith(eos_text) else t + eos_text for t in texts]
            rows = tok(list(texts), add_special_tokens=True, truncation=True, max_length=self.max_length)
            return [list(ids) or [tok.pad_token_id] for ids in rows["input_ids"]]
        eos = tok.eos_token_id if self.append_eos else None
        limit = self.max_length - (1 if eos is not None else 0)
        out = []
        for ids in tok(list(texts), add_special_tokens=True, truncation=True, max_length=limit)["input_ids"]:
            ids = list(ids)
            if eos is not None and (not ids or ids[-1] != eos):
                ids.append(eos)
            out.append(ids or [tok.pad_token_id])
        return out

    @torch.inference_mode()
    def score_ids(self, ids: Sequence[Sequence[int]]) -> list[float]:
        input_ids, mask = pad_batch(ids, self.tokenizer.pad_token_id, self.padding_side)
        if self._placed is None:
            self._placed = place([m for m in (self.backbone, self.head) if m is not None], self.device)
        input_ids, mask = input_ids.to(self._placed), mask.to(self._placed)
        if self.head is None:  # encoder classifier
            return self.backbone(input_ids=input_ids, attention_mask=mask).logits[:, 0].float().tolist()
        kwargs = {"input_ids": input_ids, "attention_mask": mask}
        if _accepts(self.backbone, "position_ids"):
            kwargs["position_ids"] = position_ids(mask)
        hidden = self.backbone(**kwargs).last_hidden_state
        last = hidden[torch.arange(hidden.shape[0], device=hidden.device), last_token_index(mask)]
        scores = self.head(last).float()[:, 0]
        if self.normalize is not None:
            scores = self.normalize(scores)
        return scores.tolist()

    def score_texts(self, texts: Sequence[str]) -> list[float]:
        """One score per text, batched by length (the order of the answer is the order of `texts`)."""
        ids = self._tokenize(texts)
        order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
        out = [0.0] * len(ids)
        for start in range(0, len(order), self.batch_size):
            chunk = order[start:start + self.batch_size]
            for i, s in zip(chunk, self.score_ids([ids[i] for i in chunk])):
                out[i] = s
        return out


class ScoreModelScorer(Scorer):
    """Rewards from a reward model and costs from a cost model (costs are 0 without a cost model)."""

    def __init__(self, reward_model: str | ScoreModel, cost_model: str | ScoreModel | None = None,
                 template: str = SAFE_RLHF_TEMPLATE, **model_options: Any):
        super().__init__()
        self.reward = reward_model if isinstance(reward_model, ScoreModel) else ScoreModel(reward_model,
                                                                                          **model_options)
        self.cost = cost_model if isinstance(cost_model, ScoreModel) or cost_model is None else ScoreModel(
            cost_model, **model_options)
        self.name = f"score models ({self.reward.path}, {self.cost.path if self.cost else None})"
        self.template = template

    def texts(self, prompts: Sequence[str], responses: Sequence[str]) -> list[str]:
        return [self.template.format(prompt=p, response=r) for p, r in zip(prompts, responses)]

    def _score(self, prompts: list[str], responses: list[str]) -> tuple[list[float], list[float]]:
        texts = self.texts(prompts, responses)
        rewards = self.reward.score_texts(texts)
        costs = self.cost.score_texts(texts) if self.cost is not None else [0.0] * len(texts)
        return rewards, costs


__all__ = ["SAFE_RLHF_TEMPLATE", "ScoreModel", "ScoreModelScorer"]
