"""Per-row member weights for a compiled decode: hooks installed once, reading buffers refilled in place.

A compiled (static-cache, CUDA-graph) decode step can only carry a perturbation that is part of its graph from
the first trace and that reads tensors whose address never changes. So instead of installing new hooks for
every chunk (esrl.es.population_hooks), a StaticPopulation installs its forward hooks ONCE and keeps one set of
device buffers per chunk size M (one size per run, or a few when the number of prompts per step changes);
`load(members)` refills them in place with the chunk's factors or weights, and entering `population(row_member)`
switches the hooks on for one population-batched generate. Rows must be member-major (ES pads a short last
chunk on engines with static shapes, so chunks keep one size), so each hook is one grouped op per perturbed
layer and step, with no per-row gather and no host sync; linears that read one input (q, k and v; an MLP's gate
and up) take their terms in one launch after the last of them, where the model allows it (esrl.es.shared_inputs).
A model carries one static population at a time, until its `remove()` (which gives the model back as it was, as
does a failure while building one). Subclasses (one per noise mode) name the hooked modules and fill the buffers.
Plain torch.
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager, nullcontext
from typing import Iterator, Sequence

import torch

from esrl.es.inside_terms import inside_mlps
from esrl.es.lowrank_kernel import MAX_LINEARS, lowrank_add_linears_
from esrl.es.noise import Member, NoiseSpec
from esrl.es.params import ParamSelection
from esrl.es.shared_inputs import gate_up_first, late_runs
from esrl.es.side_terms import SideTerms

_CARRIED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""Hooked module -> the StaticPopulation whose hooks it carries. One at a time: a second population's probe would
run through the first's reordered MLPs, which the first's remove() takes away under it (a term dropped, no error)."""


class StaticPopulation:
    share_launches: bool | None = None
    """Add the terms of linears that read one input (q, k and v) in one call after the last: None = on a GPU only,
    where it saves kernel launches. On a CPU the torch ops are the same either way, and adding q's term after k and
    v ran made SmolLM2's lowrank forward slower (q's output out of cache; RESULTS, session 20); the CPU tests turn it
    on to check the GPU's bookkeeping."""
    terms_inside: bool = False
    """Where gate_up_first holds: a gated MLP's terms inside its projections' own GEMMs (esrl.es.inside_terms) instead
    of the kernel. Off until timed on a GPU; `es_throughput.py --modes lora-inside` prices it."""
    gate_up_first: bool = True
    """Where launches are shared: run a gated MLP's up_proj before act_fn reads gate (the same output bit for bit,
    esrl.es.shared_inputs.gate_up_first) so gate's and up's terms take one launch too, a launch fewer per layer."""
    overlap: bool = False
    """At a decode step, each linear's (run's) terms on a side stream beside its GEMMs, added after them: the same
    outputs bit for bit, the kernel off the critical path, an add on it (esrl.es.side_terms). Off until timed on a GPU;
    `es_throughput.py --modes lora-overlap` prices it."""

    def __init__(self, model: torch.nn.Module, selection: ParamSelection, spec: NoiseSpec):
        self.model, self.selection, self.spec = model, selection, spec
        self.active = False
        self.removed = False
        self.members = 0  # M of the loaded chunk
        self._buffers: dict[str, tuple[torch.Tensor, ...]] = {}  # the loaded chunk size's buffers
        self._sizes: dict[int, dict[str, tuple[torch.Tensor, ...]]] = {}  # M -> its buffers, kept for the run
        self._storage: dict[int, object] = {}  # M -> what a mode keeps behind its buffers (tensors they are views of)
        targets = self._targets()
        for _, module in targets:
            if (other := _CARRIED.get(module)) is not None:
                raise RuntimeError(f"esrl: this model already carries a {type(other).__name__}: call its remove() "
                                   f"before building a {type(self).__name__}")
        self.runs = []  # keys whose terms one launch adds, after the last
        self._restore_mlps = lambda: None
        self._inside = []
        self._side = SideTerms() if self.overlap else None
        self._pending: dict[str, torch.Tensor] = {}  # outputs of a run's first modules, until its last one
        self._handles = []
        self._carried = [module for _, module in targets]
        for module in self._carried:
            _CARRIED[module] = self
        try:  # a failure (Ctrl+C in the probe included) leaves the model as it was
            self._install(model, targets)
        except BaseException:
            self.remove()
            raise

    def _install(self, model: torch.nn.Module, targets: list[tuple[str, torch.nn.Module]]) -> None:
        share = self.share_launches
        if share is None:
            share = next(model.parameters()).is_cuda
        if share:  # probed with the rollouts' attention kernels: cuDNN's would not repeat, and the probe compares
            from esrl.rollout.hf import rollout_attention

            with self._decoding(), rollout_attention(next(model.parameters()).device):
                if self.gate_up_first:
                    self._restore_mlps = gate_up_first(model)
                self.runs = late_runs(model, targets, MAX_LINEARS)
        self._inside = inside_mlps(model, targets, lambda: self.active) if share and self.terms_inside else []
        run_of = {key: run for run in self.runs for key in run}
        self._handles = [module.register_forward_hook(self._hook(key, run_of.get(key))) for key, module in targets]
        if self._side is not None:  # the run's (or linear's) input marked ready before its first GEMM
            self._handles += [module.register_forward_pre_hook(self._mark(run_of.get(key, (key,))))
                              for key, module in targets if run_of.get(key, (key,))[0] == key]

    # -- what a mode provides ----------------------------------------------------------------------------------
    def _targets(self) -> list[tuple[str, torch.nn.Module]]:
        """(buffer key, module to hook) pairs."""
        raise NotImplementedError

    def _fill(self, members: Sequence[Member]) -> dict[str, tuple[torch.Tensor, ...]]:
        """New buffers holding the chunk's tensors, per buffer key, each with the members on dim 0 and row-major
        strides (the layout esrl.es.lowrank_kernel reads; they become the persistent buffers as they are)."""
        raise NotImplementedError

    def _refill(self, buffers: dict[str, tuple[torch.Tensor, ...]], members: Sequence[Member]) -> None:
        """Write the chunk's tensors into this size's existing buffers (`_fill`'s), in place: their addresses are
        what a recorded decode step reads."""
        raise NotImplementedError

    def _decoding(self):
        """A context the model decodes a population in, besides the hooks (lora: PEFT's own adapter path off)."""
        return nullcontext()

    # -- the frame ------------------------------------------------------------------------------------------
    @torch.no_grad()
    def load(self, members: Sequence[Member]) -> None:
        """Refill the buffers of this chunk size in place with its members (a new size allocates its own)."""
        self._check_installed()
        self.members = len(members)
        if self.members not in self._sizes:
            buffers = self._fill(members)
            for tensors in buffers.values():
                for t in tensors:
                    torch._dynamo.mark_static_address(t)  # CUDA graphs read it in place, no copy per replay
            self._sizes[self.members] = buffers
        else:
            self._refill(self._sizes[self.members], members)
        self._buffers = self._sizes[self.members]
        for inside in self._inside:
            inside.load(self._buffers, self.members)

    @contextmanager
    def population(self, row_member: torch.Tensor) -> Iterator[None]:
        """The hooks act while entered; rows must be member-major over the loaded members."""
        self._check_installed()
        m, rows = self.members, row_member.numel()
        if m == 0 or rows % m or not torch.equal(row_member.cpu(), torch.arange(m).repeat_interleave(rows // m)):
            raise ValueError(f"a static population needs member-major rows over its {m} loaded members")
        self.active = True
        try:
            with self._decoding():
                yield
        finally:
            self.active = False
            self._pending.clear()
            if self._side is not None:
                self._side.clear()

    def _hook(self, key: str, run: tuple[str, ...] | None):
        """Adds the rows' member terms to the module's output in place: at once, or, for a run of modules reading one
        input, all of the run's after its last module."""

        def hook(module, args, out):
            if not self.active:
                return None
            if run is not None and key != run[-1]:
                self._pending[key] = out
                return None
            keys = run or (key,)
            outs = [self._pending.pop(k) for k in keys[:-1]] + [out]
            if self._side is not None and self._side.add(keys, args[0], outs, [self._buffers[k] for k in keys],
                                                          self.members):
                return out
            m = self.members
            x = args[0].reshape(m, -1, args[0].shape[-1])
            lowrank_add_linears_([(y.view(m, -1, y.shape[-1]), *self._buffers[k]) for k, y in zip(keys, outs)], x)
            return out

        return hook

    def _mark(self, keys: tuple[str, ...]):
        """A pre-hook marking the input of `keys` ready, for their terms beside the GEMMs (overlap)."""

        def hook(module, args):
            if self.active:
                self._side.mark(keys, args[0], self.members, self._buffers[keys[0]][0].shape[1])

        return hook

    def remove(self) -> None:
        """The hooks off, the MLPs' own forward back and the buffers let go; the model may take another population.
        Once is enough (a second call does nothing); the population cannot be loaded or entered afterwards."""
        for h in self._handles:
            h.remove()
        self._handles = []
        self._restore_mlps()
        self._restore_mlps = lambda: None
        for module in self._carried:  # a second population was refused, so each entry is this one
            _CARRIED.pop(module, None)
        if self._side is not None:
            self._side.release()
        self._carried, self._inside, self._sizes, self._storage, self._buffers = [], [], {}, {}, {}
        self._side = None
        self.members = 0
        self.removed = True

    def _check_installed(self) -> None:
        if self.removed:  # its hooks are gone: a generate would be the base model's, silently
            raise RuntimeError(f"esrl: this {type(self).__name__} was removed; build a new one")
