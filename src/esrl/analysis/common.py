"""What every analysis shares: models, the task's eval prompts and reward, layer groups, outputs, progress.

Plain torch + matplotlib (Agg), no Lightning: an analysis loads HF folders, rolls out greedily with the same
engine and task rewards as training and evaluation, and writes one JSON and one PNG.
"""

from __future__ import annotations

import json
import math
import re
from types import SimpleNamespace
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from statistics import fmean
from typing import Any, Iterator, Sequence

import torch

from esrl.atomic_files import write_text, write_with
from esrl.errors import EsrlError
from esrl.es.params import ParamSelection
from esrl.rollout.base import Completion
from esrl.rollout.hf import HFEngine
from esrl.tasks import Task
from esrl.tasks.reward_logs import RewardLogs


class AnalysisError(EsrlError, ValueError):
    """Bad input to `esrl analyze` (model folder, analysis name, grid); the message names the culprit."""


# -- models ------------------------------------------------------------------------------------------------
@dataclass
class ModelRef:
    """A model given on the command line: its label in tables and plots, and where it lives."""

    label: str
    path: str


def load_model(ref: ModelRef, dtype: str, device: str):
    from esrl.models.loading import load_causal_lm

    return load_causal_lm(ref.path, dtype).to(device)


def check_same_architecture(a: torch.nn.Module, b: torch.nn.Module, label_a: str, label_b: str) -> None:
    shapes_a = {n: tuple(p.shape) for n, p in a.named_parameters()}
    shapes_b = {n: tuple(p.shape) for n, p in b.named_parameters()}
    if shapes_a != shapes_b:
        diff = sorted(set(shapes_a.items()) ^ set(shapes_b.items()))[:1]
        raise AnalysisError(f"models {label_a!r} and {label_b!r} have different parameters (first difference: "
                            f"{diff[0][0] if diff else '?'}); weight-space analyses need one architecture")


def check_same_configs(refs: list[ModelRef]) -> None:
    """check_same_architecture on models built from their config.json on the meta device (no weights read): a
    mismatch is one line before any analysis runs, not after hours of robustness on a 7B model. A config that will
    not build is left to the load to report."""
    from transformers import AutoConfig, AutoModelForCausalLM

    built = []
    for ref in refs:
        try:
            with torch.device("meta"):
                built.append((ref, AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(ref.path))))
        except Exception:  # noqa: BLE001 - the model's own load names the problem
            return
    for ref, model in built[1:]:
        check_same_architecture(built[0][1], model, built[0][0].label, ref.label)


# -- layer groups ------------------------------------------------------------------------------------------
_LAYER = re.compile(r"\.(?:layers|h|blocks|layer)\.(\d+)\.")
ANALYSIS_STATE = SimpleNamespace(global_step=0, max_steps=0, epoch=0)
"""trainer_state for reward functions scored outside training (TRL's keyword; no step to report)."""
_ATTN = re.compile(r"attn|attention|q_proj|k_proj|v_proj|o_proj")
_MLP = re.compile(r"mlp|feed_forward|ffn|fc\d|gate_proj|up_proj|down_proj")
GROUPS = ("embeddings", "attention", "mlp", "unembedding")


def tied_embeddings(model: torch.nn.Module) -> bool:
    """True when the output (unembedding) matrix is the input embedding matrix."""
    inp, out = model.get_input_embeddings(), model.get_output_embeddings()
    return inp is not None and out is not None and out.weight is inp.weight


def group_names(model: torch.nn.Module) -> dict[str, str]:
    """Parameter name -> group: embeddings, attention, mlp, unembedding, norm or other.

    With tied embeddings the one shared matrix is listed once (named_parameters deduplicates) under the
    group `embeddings` (see `tied_embeddings`): perturbing it perturbs the unembedding too.
    """
    inp = model.get_input_embeddings()
    out = model.get_output_embeddings()
    ids_in = {id(p) for p in inp.parameters()} if inp is not None else set()
    ids_out = {id(p) for p in out.parameters()} if out is not None else set()
    groups = {}
    for name, p in model.named_parameters():
        if id(p) in ids_in or re.search(r"(^|\.)(wpe|embed_positions|position_embeddings)\.", name):
            groups[name] = "embeddings"
        elif id(p) in ids_out:
            groups[name] = "unembedding"
        elif "norm" in (owner := name.rsplit(".", 2)[-2] if "." in name else name) or owner.startswith("ln_"):
            groups[name] = "norm"  # by its own module's name: Llama's post_attention_layernorm is no attention
        elif _LAYER.search(name) and _ATTN.search(name):
            groups[name] = "attention"
        elif _LAYER.search(name) and _MLP.search(name):
            groups[name] = "mlp"
        else:
            groups[name] = "other"
    return groups


def group_label(group: str, tied: bool) -> str:
    if tied and group in ("embeddings", "unembedding"):
        return "embeddings=unembedding (tied)"
    return group


def selection(model: torch.nn.Module, names: set[str] | None = None) -> ParamSelection:
    """Parameters (all, or those named) with their index in named_parameters, as esrl.es.Perturber expects."""
    sel = ParamSelection([], [], [])
    for j, (name, p) in enumerate(model.named_parameters()):
        if names is None or name in names:
            sel.indices.append(j)
            sel.names.append(name)
            sel.params.append(p)
    return sel


def layer_unit(name: str, group: str) -> str:
    """The per-layer unit a tensor belongs to: `L3.attention`, `L3.mlp`, `L3.norm`, `embeddings`, ..."""
    m = _LAYER.search(name)
    if m and group in ("attention", "mlp", "norm", "other"):
        return f"L{int(m.group(1))}.{group}"
    return group


def unit_order(units: Sequence[str]) -> list[str]:
    """Embeddings first, then layers in depth order (attention, mlp, norm), then final norm and unembedding."""
    rank = {"embeddings": (-1, 0), "norm": (10 ** 6, 0), "other": (10 ** 6, 1), "unembedding": (10 ** 6, 2)}
    sub = {"attention": 0, "mlp": 1, "norm": 2, "other": 3}

    def key(u: str):
        m = re.match(r"L(\d+)\.(\w+)$", u)
        if m:
            return int(m.group(1)), sub.get(m.group(2), 9)
        return rank.get(u, (-1, 0) if u.startswith("embeddings") else (10 ** 6, 3))

    return sorted(dict.fromkeys(units), key=key)


# -- evaluation -------------------------------------------------------------------------------------------
class RewardEvaluator:
    """Greedy or sampled completions on a fixed set of eval prompts, scored by the task's reward."""

    def __init__(self, task: Task, tokenizer, rows: Sequence[dict[str, Any]], max_new_tokens: int,
                 batch_size: int = 64, correct_metric: str | None = None):
        self.task = task
        self.tokenizer = tokenizer
        self.rows = list(rows)
        self.prompts = task.prompts(self.rows)
        self.max_new_tokens = max_new_tokens
        self.batch_size = batch_size
        self.stop = list(task.stop)
        self.correct_metric = correct_metric

    def generate(self, model, greedy: bool = True, n: int = 1, temperature: float = 1.0,
                 seed: int | None = None) -> list[Completion]:
        engine = HFEngine(model, self.tokenizer, max_batch_size=self.batch_size)
        return engine.generate(self.prompts, max_new_tokens=self.max_new_tokens, greedy=greedy,
                               temperature=temperature, stop=self.stop, num_return_sequences=n, seed=seed)

    def score(self, completions: Sequence[Completion], n: int = 1) -> dict[str, list[float]]:
        """Per-sample reward and task metrics; completions are row-major with n per row."""
        rows = [r for r in self.rows for _ in range(n)]
        texts, ids = [c.text for c in completions], [c.token_ids for c in completions]
        logs = RewardLogs()
        context = {"trainer_state": ANALYSIS_STATE, **logs.context()}
        values = {"reward": self.task.rewards(rows, texts, ids, **context)}
        values.update(self.task.metrics(rows, texts, ids, **context))
        logs.add_to(values)
        return values

    def correct(self, values: dict[str, list[float]]) -> tuple[list[bool], str]:
        """Which samples count as correct for pass@k, and by which criterion (as the Evaluation callback)."""
        key = self.correct_metric or next((k for k in ("accuracy", "exact") if k in values), None)
        if key is not None:
            if key not in values:
                raise AnalysisError(f"--correct-metric {key!r}: the task has no such metric "
                                    f"(it has: {', '.join(values)})")
            return [v >= 1.0 for v in values[key]], f"{key} >= 1"
        return [r > 0 for r in values["reward"]], "reward > 0"

    def reward(self, model) -> float:
        """Mean greedy reward over the prompts."""
        return fmean(self.score(self.generate(model))["reward"])

    @torch.no_grad()
    def nll(self, model, completions: Sequence[Completion]) -> float:
        """Mean per-token negative log-likelihood of given completions (one per prompt) under `model`."""
        from esrl.rollout.text import encode_prompts

        total, count = 0.0, 0
        device = next(model.parameters()).device
        for row, c in zip(encode_prompts(self.tokenizer, self.prompts), completions):
            if not c.token_ids:
                continue
            prompt_ids = torch.tensor(row, dtype=torch.long)
            ids = torch.cat([prompt_ids, torch.tensor(c.token_ids, dtype=torch.long)]).unsqueeze(0).to(device)
            logits = model(ids).logits[0, len(prompt_ids) - 1:-1].float()
            logp = torch.log_softmax(logits, dim=-1).gather(1, ids[0, len(prompt_ids):, None]).squeeze(1)
            total -= float(logp.sum())
            count += logp.numel()
        return total / max(count, 1)


def eval_rows(task: Task, num_prompts: int | None) -> list[dict[str, Any]]:
    rows = task.eval_rows or task.train_rows
    if num_prompts is not None:
        if num_prompts < 1:
            raise AnalysisError(f"--num-prompts must be >= 1, got {num_prompts}")
        rows = rows[:num_prompts]
    if not rows:
        raise AnalysisError(f"task {task.name!r} has no eval rows")
    return rows


# -- numbers ------------------------------------------------------------------------------------------------
def finite(x: float) -> float | None:
    """JSON has no NaN: non-finite numbers become null."""
    return float(x) if x is not None and math.isfinite(x) else None


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    m = fmean(values)
    return m, (math.sqrt(fmean((v - m) ** 2 for v in values)) if len(values) > 1 else 0.0)


# -- outputs ------------------------------------------------------------------------------------------------
def write_json(path: Path, data: dict[str, Any]) -> Path:
    """Whole or not at all: a study reads a summary to decide what is done."""

    path.parent.mkdir(parents=True, exist_ok=True)
    return write_text(path, json.dumps(data, indent=2, allow_nan=False) + "\n")


def pyplot():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    write_with(path, lambda tmp: fig.savefig(tmp, dpi=120, format=path.suffix.lstrip(".") or "png"))
    pyplot().close(fig)
    return path


@dataclass
class Context:
    """Inputs shared by all analyses of one `esrl analyze` call."""

    base: ModelRef | None
    models: list[ModelRef]
    evaluator: RewardEvaluator
    out: Path
    dtype: str = "float32"
    device: str = "cpu"
    seed: int = 0
    progress: Any = None
    settings: dict[str, Any] = field(default_factory=dict)
    _cache: dict[str, torch.nn.Module] = field(default_factory=dict)

    def model(self, ref: ModelRef) -> torch.nn.Module:
        """Load once per path (the analyses restore every in-place change they make)."""
        if ref.path not in self._cache:
            self._cache[ref.path] = load_model(ref, self.dtype, self.device)
        return self._cache[ref.path]

    @contextmanager
    def task(self, description: str, total: int) -> Iterator:
        """A progress bar row; yields advance()."""
        if self.progress is None:
            yield lambda n=1: None
            return
        tid = self.progress.add_task(description, total=total)
        try:
            yield lambda n=1: self.progress.advance(tid, n)
        finally:
            self.progress.update(tid, completed=total)
