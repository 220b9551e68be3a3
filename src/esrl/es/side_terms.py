"""A decode step's member terms on a side stream beside the base GEMMs (StaticPopulation.overlap).

The member-term kernel (esrl.es.lowrank_kernel) is latency-bound at a decode step: launched after each GEMM, its 4-11 us
a call sit on the step's critical path (lora at rank 8: 1.3 ms of a 6.6 ms step; RESULTS, session 28). A decode GEMM of
a 1.5B model (240 rows) has few output tiles, so many SMs should be idle while it streams its weights (an estimate from
the tile count, not measured). So a forward pre-hook marks when a linear's (or a run of linears') input x is ready, an
event on the step's stream; after the run's last GEMM is launched, the terms are launched on a side stream that waits
for that event only, each written alone into an fp32 buffer, and the step's stream waits for them and adds them (one
launch a run, esrl.es.lowrank_kernel.add_terms_): the kernel's own sums, added and rounded once, so the outputs equal
the in-place kernel's bit for bit, with the GEMMs launched first (a GPU in practice dispatches blocks in launch order,
so the term kernel takes the SMs the GEMMs leave). The price: that add on the critical path. One buffer per kind of
linear (q_proj, ...), place in its run, row count and inference mode serves every layer: a layer's terms wait for its x,
made after the layer before's were added. Decode steps only (one token a row, rows a member the kernel takes), not under
torch.compile; a CUDA graph records the fork and the join as edges. On a CPU (tests) the same bookkeeping, no stream.
Plain torch.
"""

from __future__ import annotations

import re

import torch

from esrl.es.lowrank_kernel import add_terms_, kernel_takes, lowrank_add_linears_

_LAYER = re.compile(r"\.\d+\.")


class SideTerms:
    def __init__(self):
        self._stream: torch.cuda.Stream | None = None
        self._events: dict[tuple[str, ...], torch.cuda.Event] = {}  # a run's "x is ready", recorded per call
        self._ready: set[tuple[str, ...]] = set()  # runs whose x was marked, until their terms are added
        self._terms: dict[tuple, torch.Tensor] = {}  # (kind, place, rows, width, inference mode) -> fp32 buffer

    def mark(self, keys: tuple[str, ...], x: torch.Tensor, members: int, rank: int) -> None:
        """Before the run's first GEMM: note that its x is ready, if x is a decode step's (an event on a GPU)."""
        rows = x.shape[0]
        if (x.dim() != 3 or x.shape[1] != 1 or rows % members or torch.compiler.is_compiling()
                or not kernel_takes(rank, rows // members)):
            return
        if x.is_cuda:
            if keys not in self._events:
                self._events[keys] = torch.cuda.Event()
            self._events[keys].record(torch.cuda.current_stream(x.device))
        self._ready.add(keys)

    def add(self, keys: tuple[str, ...], x: torch.Tensor, outs: list[torch.Tensor],
            factors: list[tuple[torch.Tensor, torch.Tensor]], members: int) -> bool:
        """After the run's last GEMM: its terms (factors: (a_t, b_t) per key) beside the GEMMs, then added to `outs` in
        place; False if x was not marked (the caller adds them in place)."""
        if keys not in self._ready:
            return False
        self._ready.discard(keys)
        rows = x.shape[0]
        xs = x.reshape(members, rows // members, x.shape[-1])
        terms = [self._term(key, i, rows, a_t.shape[-1], x.device).view(members, -1, a_t.shape[-1])
                 for i, (key, (a_t, _)) in enumerate(zip(keys, factors))]
        work = [(t, a_t, b_t) for t, (a_t, b_t) in zip(terms, factors)]
        if x.is_cuda:
            step = torch.cuda.current_stream(x.device)
            if self._stream is None:  # high priority: its own pool, never the (pooled, normal) capture stream
                self._stream = torch.cuda.Stream(x.device, priority=-1)
            self._stream.wait_event(self._events[keys])
            with torch.cuda.stream(self._stream):
                lowrank_add_linears_(work, xs, add=False)
            step.wait_stream(self._stream)  # xs, made on the step's stream, lives until after this join
        else:
            lowrank_add_linears_(work, xs, add=False)
        add_terms_(outs, terms)
        return True

    def clear(self) -> None:
        """Forget marks (a forward that stopped between a mark and its add)."""
        self._ready.clear()

    def release(self) -> None:
        """Let the buffers go, once the GPU is done with them (used off the stream they were made on)."""
        if self._stream is not None:
            self._stream.synchronize()
            torch.cuda.current_stream(self._stream.device).synchronize()
        self._terms.clear()
        self.clear()

    def _term(self, key: str, place: int, rows: int, width: int, device: torch.device) -> torch.Tensor:
        """The buffer of a kind of linear at a place in its run (two of one kind in a run must not share one)."""
        slot = (_LAYER.sub(".#.", key), place, rows, width, torch.is_inference_mode_enabled())
        if slot not in self._terms:  # made at a recorded step's warm-up, outside the capture
            self._terms[slot] = torch.empty(rows, width, device=device, dtype=torch.float32)
        return self._terms[slot]
