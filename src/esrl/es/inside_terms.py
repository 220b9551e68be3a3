"""A gated MLP's member terms inside its own GEMMs: y = [x | C] @ [W | A_all]^T, one GEMM a projection (opt-in).

The member-term kernel (esrl.es.lowrank_kernel) re-reads a member's out-side factor for each of its rows: at lora's
rank 8 an H100 spends ~11 us a call on gate_proj and up_proj and ~8.6 us on down_proj, two thirds of lora's decode
terms (RESULTS, session 28). Here each projection's weight gets the members' out-side factors as extra input columns
(A_all: out x M r, every member's), and its input the rows' in-side products C (rows x M r: row i's c = B_m x_i in
its member's r columns, zeros elsewhere), so one GEMM of K = in + M r adds every row's own term while reading each
factor once; C costs one batched GEMM a projection, written into the diagonal blocks of a buffer whose zeros stay.
Gate and up share one input buffer laid out [C_gate | x | C_up], so each reads a contiguous slice; down's input,
act(gate) * up, is written straight into its buffer. Against the kernel path: c rounded to the model's dtype before
the product (as the prefill's torch ops do), and each output rounded once (the kernel path rounds x W^T first).

A decode step only (one token a row), and not under torch.compile (`rollout.compile: fused`; its strided `out=`
writes would break the graph per layer): a prefill's terms stay the hooks' batched GEMMs, a fused step the kernel.
The weights are copied into the wider ones at each chunk's load (lowrank's move every update), so the MLPs' weights
are held twice while a population lives (a 1.5B model: 2.3 GB in bf16). Off by default until timed on a GPU
(`StaticPopulation.terms_inside`; benchmarks/gpu/NOTES_issue15.md). Plain torch.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch

from esrl.es.shared_inputs import gate_up_first_forward


class InsideMLP:
    """One gated MLP's wider weights (per chunk size) and input buffers (per shape) for a StaticPopulation."""

    def __init__(self, mlp: torch.nn.Module, keys: tuple[str, str, str], linears: tuple[torch.nn.Module, ...],
                 active: Callable[[], bool]):
        self.mlp, self.keys, self.linears, self.active = mlp, keys, linears, active
        self._weights: tuple[torch.Tensor, ...] = ()  # gate's, up's and down's, for one chunk size (`_size`)
        self._size = 0
        self._inputs: dict[tuple, tuple[torch.Tensor, ...]] = {}  # (rows, inference mode) -> buffers
        self._factors: tuple[torch.Tensor, ...] = ()  # the loaded chunk's in-side factors (M, r, in) per projection
        self.members = 0

    @torch.no_grad()
    def load(self, buffers: dict[str, tuple[torch.Tensor, torch.Tensor]], members: int) -> None:
        """The chunk's weights: the projections' own and the members' out-side factors, written in place. One chunk
        size holds wider weights (the first loaded: with static shapes every chunk's); a chunk of another size (an
        eager engine's short last chunk), or with factors of another dtype than the weights, leaves its terms to the
        hooks, rather than hold the MLPs' weights a third time."""
        gate, up, down = (l.weight for l in self.linears)
        (a_g, b_g), (a_u, b_u), (a_d, b_d) = (buffers[k] for k in self.keys)
        self.members, mr = 0, members * a_g.shape[1]
        if {a_g.dtype, b_g.dtype, a_d.dtype, b_d.dtype, a_u.dtype, b_u.dtype} != {gate.dtype}:
            return
        if not self._weights:
            self._weights, self._size = (gate.new_empty(gate.shape[0], mr + gate.shape[1]),
                                         up.new_empty(up.shape[0], up.shape[1] + mr),
                                         down.new_empty(down.shape[0], down.shape[1] + mr)), members
            for w in self._weights:
                torch._dynamo.mark_static_address(w)
        if members != self._size:
            return
        w_g, w_u, w_d = self._weights
        w_g[:, mr:].copy_(gate)
        w_u[:, :up.shape[1]].copy_(up)
        w_d[:, :down.shape[1]].copy_(down)
        for w, a, start in ((w_g, a_g, 0), (w_u, a_u, up.shape[1]), (w_d, a_d, down.shape[1])):
            w[:, start:start + mr].view(-1, *a.shape[:2]).copy_(a.permute(2, 0, 1))  # (out, M, r) <- (M, r, out)
        self._factors, self.members = (b_g, b_u, b_d), members

    def _buffers(self, rows: int) -> tuple[torch.Tensor, ...]:
        """[C_gate | x | C_up] and [act(gate) * up | C_down] for a decode step's `rows` rows, zeros off the diagonal
        blocks, and the views (M, n, r) of their blocks: kept per number of rows (one a run, as a rule), at fixed
        addresses for a recorded step, and per inference mode (an inference tensor takes no in-place write outside
        it)."""
        key = (rows, torch.is_inference_mode_enabled())
        if key not in self._inputs:
            m, (b_g, _, b_d) = self.members, self._factors
            r, n_in, inter = b_g.shape[1], b_g.shape[2], b_d.shape[2]
            n, mr = rows // m, m * r
            xc = b_g.new_zeros(rows, 2 * mr + n_in)
            xd = b_d.new_zeros(rows, inter + mr)
            blocks = lambda t, start: t.as_strided((m, n, r), (n * t.shape[1] + r, t.shape[1], 1), start)
            self._inputs[key] = (xc, xd, blocks(xc, 0), blocks(xc, mr + n_in), blocks(xd, inter))
        return self._inputs[key]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The MLP with its members' terms inside the GEMMs at an active population's decode step (one token a row,
        eager or recorded), else gate_up_first's forward, whose projections' hooks add the terms if active: a
        prefill's (the batched GEMMs, as timed), a chunk `load` left to them, and a torch.compile'd step (the
        strided `out=` writes here would break its graph per layer)."""
        if (not self.active() or not self.members or x.dim() != 3 or x.shape[1] != 1
                or torch.compiler.is_compiling()):
            return gate_up_first_forward(self.mlp, x)
        n_in, m, (b_g, b_u, b_d) = x.shape[-1], self.members, self._factors
        rows = x.shape[0]
        w_g, w_u, w_d = self._weights
        mr = m * b_g.shape[1]
        xc, xd, c_g, c_u, c_d = self._buffers(rows)
        flat = x.reshape(rows, n_in)
        xc[:, mr:mr + n_in].copy_(flat)
        torch.bmm(flat.view(m, -1, n_in), b_g.transpose(1, 2), out=c_g)
        torch.bmm(flat.view(m, -1, n_in), b_u.transpose(1, 2), out=c_u)
        gate, up = torch.mm(xc[:, :mr + n_in], w_g.t()), torch.mm(xc[:, mr:], w_u.t())
        inter = xd.shape[1] - mr
        torch.mul(self.mlp.act_fn(gate), up, out=xd[:, :inter])
        torch.bmm(xd[:, :inter].view(m, -1, inter), b_d.transpose(1, 2), out=c_d)
        return torch.mm(xd, w_d.t()).view(*x.shape[:-1], w_d.shape[0])


def inside_mlps(model: torch.nn.Module, targets: list[tuple[str, torch.nn.Module]], active: Callable[[], bool]
                ) -> list[InsideMLP]:
    """An InsideMLP for each MLP that runs gate_up_first's forward (esrl.es.shared_inputs: its formula checked) and
    whose three projections are all targets, bias-free, in one dtype; installed as the MLP's forward (the MLP's
    `forward` attribute goes when gate_up_first's restore runs)."""
    key_of = {id(module): key for key, module in targets}
    found = []
    for mlp in model.modules():
        forward = vars(mlp).get("forward")
        if not (isinstance(forward, functools.partial) and forward.func is gate_up_first_forward):
            continue
        linears = tuple(getattr(mlp, name) for name in ("gate_proj", "up_proj", "down_proj"))
        linears = tuple(getattr(l, "base_layer", l) for l in linears)  # a PEFT LoRA layer: its base Linear
        if any(id(l) not in key_of or type(l) is not torch.nn.Linear or l.bias is not None for l in linears):
            continue  # a plain bias-free Linear each (not a quantized one), all perturbed
        if len({l.weight.dtype for l in linears}) != 1:
            continue
        inside = InsideMLP(mlp, tuple(key_of[id(l)] for l in linears), linears, active)
        mlp.forward = inside.forward
        found.append(inside)
    return found
