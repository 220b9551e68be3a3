"""A decode step's member terms on a side stream while the base GEMMs run (StaticPopulation.overlap).

The member-term kernel (esrl.es.lowrank_kernel) is latency-bound at a decode step: launched after each GEMM, its 4-11 us
a call sit on the step's critical path (lora at rank 8: 1.3 ms of a 6.6 ms step; RESULTS, session 28). A decode GEMM of
a 1.5B model (240 rows) has few output tiles, so many SMs should be idle while it streams its weights (an estimate from
the tile count, not measured). Here a forward pre-hook launches the terms of a linear, or of a run of linears reading
one input, on a side stream as soon as x exists, each written alone into an fp32 buffer; the hook after the run's last
GEMM makes the step's stream wait for them and adds them: the kernel's own sums, added and rounded once, so the outputs
equal the in-place kernel's bit for bit. The price: an add on the critical path per launch of the kernel it replaces
(one for q, k and v, one for gate and up: esrl.es.lowrank_kernel.add_terms_). One buffer per kind of linear (q_proj,
...), row count and inference mode serves every layer: a layer's launch waits for the step's stream, which has added the
layer before's. Decode steps only (one token a row, rows a member the kernel takes), not under torch.compile; a CUDA
graph records the fork and the join. On a CPU (tests) the terms are computed where they would be launched, the same
bookkeeping. Plain torch.
"""

from __future__ import annotations

import re

import torch

from esrl.es.lowrank_kernel import add_terms_, kernel_takes, lowrank_add_linears_

_LAYER = re.compile(r"\.\d+\.")


class EarlyTerms:
    def __init__(self):
        self._stream: torch.cuda.Stream | None = None
        self._terms: dict[tuple, torch.Tensor] = {}  # (kind, place, rows, width, inference mode) -> fp32 buffer
        self._launched: dict[tuple[str, ...], tuple[list[torch.Tensor], torch.Tensor]] = {}  # keys -> (terms, xs)

    def launch(self, keys: tuple[str, ...], x: torch.Tensor, factors: list[tuple[torch.Tensor, torch.Tensor]],
               members: int) -> None:
        """Start the terms of `keys` (their (a_t, b_t) buffers in `factors`) for input x, if x is a decode step's."""
        rows = x.shape[0]
        if (x.dim() != 3 or x.shape[1] != 1 or rows % members or torch.compiler.is_compiling()
                or not kernel_takes(factors[0][0].shape[1], rows // members)):
            return
        xs = x.reshape(members, rows // members, x.shape[-1])  # on the step's stream, before the side one waits
        terms = [self._term(key, i, rows, a_t.shape[-1], x.device).view(members, -1, a_t.shape[-1])
                 for i, (key, (a_t, _)) in enumerate(zip(keys, factors))]
        work = [(t, a_t, b_t) for t, (a_t, b_t) in zip(terms, factors)]
        if x.is_cuda:
            if self._stream is None:
                self._stream = torch.cuda.Stream(x.device)
            self._stream.wait_stream(torch.cuda.current_stream(x.device))
            with torch.cuda.stream(self._stream):
                lowrank_add_linears_(work, xs, add=False)
        else:
            lowrank_add_linears_(work, xs, add=False)
        self._launched[keys] = terms, xs  # xs kept until the join: its memory is not reused while the side reads it

    def add(self, keys: tuple[str, ...], outs: list[torch.Tensor]) -> bool:
        """Add the launched terms of `keys` to their linears' outputs in place; False if none were launched."""
        launched = self._launched.pop(keys, None)
        if launched is None:
            return False
        terms, _ = launched
        if outs[0].is_cuda:
            torch.cuda.current_stream(outs[0].device).wait_stream(self._stream)
        add_terms_(outs, terms)
        return True

    def clear(self) -> None:
        """Forget launched terms (a forward that stopped between a launch and its add)."""
        self._launched.clear()

    def _term(self, key: str, place: int, rows: int, width: int, device: torch.device) -> torch.Tensor:
        """The buffer of a kind of linear at a place in its run (two of one kind in a run must not share one)."""
        slot = (_LAYER.sub(".#.", key), place, rows, width, torch.is_inference_mode_enabled())
        if slot not in self._terms:  # made at a recorded step's warm-up, outside the capture
            self._terms[slot] = torch.empty(rows, width, device=device, dtype=torch.float32)
        return self._terms[slot]
