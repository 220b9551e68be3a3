"""Which perturbed linears read one input and can take their member terms in one launch, after the last of them.

In a recorded decode step the member-term kernel (esrl.es.lowrank_kernel) costs a few microseconds a launch however
small its work, and a 1.5B model launches it 196 times a step. q_proj, k_proj and v_proj read the same x, so one
launch after v_proj can add all three terms, in place, to outputs the model has not read yet: two launches fewer per
layer. That holds only where nothing reads q or k before v_proj runs: true of Llama and Qwen2 (rotary comes after the
three), false of Qwen3 (q_norm reads q before k_proj runs) and of a gated MLP's gate as transformers writes it
(act_fn reads gate before up_proj runs; `gate_up_first` reorders those two calls). So it is checked on the model, not
assumed per architecture: a probe forward records which hooked modules are called one after another on the same
input tensor, then each kind of run (q/k/v, gate/up, ...) is kept only if adding random terms late, in place, gives
logits bit-equal to adding them at once. Plain torch; no Lightning.
"""

from __future__ import annotations

import functools
import logging
import re
from contextlib import ExitStack
from typing import Callable, Sequence

import torch

log = logging.getLogger(__name__)
PROBE_TOKENS = 4
GATED_MLP = ("gate_proj", "up_proj", "down_proj", "act_fn")
"""The attributes of transformers' gated MLPs (Llama, Qwen2/3, Mistral, Gemma): down(act(gate(x)) * up(x))."""


def late_runs(model: torch.nn.Module, targets: Sequence[tuple[str, torch.nn.Module]], most: int) -> list[tuple]:
    """Runs of `targets` keys (each run: at most `most` modules called one after another on the same input) whose
    terms may all be added after the run's last module: the runs of every kind that passed the probe."""
    try:
        runs = _shared_input_runs(model, targets, most)
        if not runs:
            return []
        kinds: dict[tuple, list[tuple]] = {}
        for run in runs:
            kinds.setdefault(tuple(re.sub(r"\.\d+\.", ".#.", key) for key in run), []).append(run)
        deltas: dict[str, torch.Tensor] = {}
        keys = [key for run in runs for key in run]
        want = _probe(model, targets, keys, deltas, late=[])
        kept: list[tuple] = []
        for kind, of_kind in kinds.items():
            if torch.equal(_probe(model, targets, keys, deltas, late=kept + of_kind), want):
                kept += of_kind
            else:
                log.debug("member terms of %s are added one linear at a time (the model reads an output early)", kind)
        return kept
    except Exception as e:  # an architecture the probe cannot run: one launch per linear, as before
        log.warning("member terms are added one linear at a time: the shared-input probe failed (%s: %s)",
                    type(e).__name__, e)
        return []


def gate_up_first_forward(self, x: torch.Tensor) -> torch.Tensor:
    """A gated MLP's forward with up_proj run before act_fn reads gate's output: the same ops on the same tensors
    (so the same output, bit for bit), but gate_proj and up_proj are now called one after another, so their member
    terms can take one launch after up_proj."""
    gate, up = self.gate_proj(x), self.up_proj(x)
    return self.down_proj(self.act_fn(gate) * up)


@torch.inference_mode()
def gate_up_first(model: torch.nn.Module) -> Callable[[], None]:
    """Give each gated MLP of `model` the forward above, as an instance attribute, when the model's logits stay
    bit-equal on a probe (an MLP whose own forward is not down(act(gate(x)) * up(x)) changes them: nothing is
    changed then). Returns the function that gives the MLPs back their class's forward."""
    mlps = [m for m in model.modules() if all(hasattr(m, a) for a in GATED_MLP) and "forward" not in vars(m)]

    def restore() -> None:
        for m in mlps:
            vars(m).pop("forward", None)

    if not mlps:
        return restore
    try:
        want = model(input_ids=_probe_ids(model)).logits
        for m in mlps:
            m.forward = functools.partial(gate_up_first_forward, m)  # a partial pickles and deep-copies
        if not torch.equal(model(input_ids=_probe_ids(model)).logits, want):
            restore()
            log.debug("the MLPs keep their own forward: gate_proj first changed the logits")
    except Exception as e:  # as late_runs: an architecture the probe cannot run keeps its own forward
        restore()
        log.warning("the MLPs keep their own forward: the probe failed (%s: %s)", type(e).__name__, e)
    except BaseException:  # Ctrl+C in the probe: the model as it was
        restore()
        raise
    return restore


def _probe_ids(model: torch.nn.Module) -> torch.Tensor:
    device = next(model.parameters()).device
    return torch.arange(1, PROBE_TOKENS + 1, device=device)[None]


@torch.inference_mode()
def _shared_input_runs(model, targets, most: int) -> list[tuple]:
    calls: list[tuple[str, torch.Tensor]] = []
    with ExitStack() as stack:
        for key, module in targets:
            handle = module.register_forward_hook(lambda m, args, out, key=key: calls.append((key, args[0])))
            stack.callback(handle.remove)
        model(input_ids=_probe_ids(model))
    runs: list[list[tuple[str, torch.Tensor]]] = []
    for key, x in calls:
        run = runs[-1] if runs else []
        if run and x is run[-1][1] and len(run) < most and key not in {k for k, _ in run}:
            run.append((key, x))
        else:
            runs.append([(key, x)])
    return [tuple(k for k, _ in run) for run in runs if len(run) > 1]


@torch.inference_mode()
def _probe(model, targets, keys: list[str], deltas: dict[str, torch.Tensor], late: list[tuple]) -> torch.Tensor:
    """Logits with a random term added in place to each of `keys`' outputs: at once, or for the `late` runs after
    the run's last module (as esrl.es.static_population adds them)."""
    last = {run[-1]: run for run in late}
    deferred = {key for run in late for key in run}
    pending: dict[str, torch.Tensor] = {}

    def hook(module, args, out, key):
        if key not in deltas:
            g = torch.Generator(device=out.device).manual_seed(len(deltas))
            deltas[key] = torch.randn(out.shape, generator=g, device=out.device).to(out.dtype)
        if key not in deferred:
            out.add_(deltas[key])
            return None
        pending[key] = out
        if key in last:
            for k in last[key]:
                pending.pop(k).add_(deltas[k])
        return None

    with ExitStack() as stack:
        for key, module in targets:
            if key in keys:
                handle = module.register_forward_hook(lambda m, args, out, key=key: hook(m, args, out, key))
                stack.callback(handle.remove)
        return model(input_ids=_probe_ids(model)).logits.float()
