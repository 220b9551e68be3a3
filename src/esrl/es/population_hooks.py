"""The shared frame of a population-batched perturbation: forward hooks that exist only inside a `with` block.

`members` are the chunk's members and `row_member` (rows,) says which of them (0..M-1) each batch row uses.
Rows are member-major when generate_population builds them (all rows of member 0, then member 1, ...); then
`per_member` > 0 and a hook can view x as (M, per_member * seq, in) and use each member's factors without a
per-row gather. Hooks are removed however the block exits (a failed install included), so the model is never
left modified.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import torch

from esrl.es.noise import Member

if TYPE_CHECKING:
    from esrl.es.noise import NoiseSpec
    from esrl.es.params import ParamSelection


class PopulationHooks:
    """Subclasses register their hooks in `_install` (appending the handles to `self._handles`)."""

    mode: str = ""

    def __init__(self, model: torch.nn.Module, selection: ParamSelection, spec: NoiseSpec,
                 members: Sequence[Member], row_member: torch.Tensor):
        if spec.mode != self.mode:
            raise ValueError(f"{type(self).__name__} needs mode {self.mode}, got {spec.mode!r}")
        self.model = model
        self.selection = selection
        self.spec = spec
        self.members = list(members)
        self.row_member = row_member.long()
        m, rows = len(self.members), self.row_member.numel()
        member_major = (m > 0 and rows % m == 0
                        and torch.equal(self.row_member.cpu(), torch.arange(m).repeat_interleave(rows // m)))
        self.per_member = rows // m if member_major else 0  # rows per member on the grouped path, else 0
        self._handles: list = []
        self._row_member_on: torch.Tensor | None = None  # row_member on the activations' device

    def __enter__(self):
        try:
            self._install()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def _install(self) -> None:
        raise NotImplementedError

    def _rows(self, x: torch.Tensor) -> torch.Tensor:
        """The row -> member map on x's device, after checking x has one row per entry."""
        if x.shape[0] != self.row_member.numel():
            raise RuntimeError(f"population batch has {x.shape[0]} rows, the row -> member map "
                               f"{self.row_member.numel()}")
        if self._row_member_on is None or self._row_member_on.device != x.device:
            self._row_member_on = self.row_member.to(x.device)  # once per block, not per hooked call
        return self._row_member_on


def member_chunks(members: Sequence[Member], members_per_chunk: int) -> list[list[Member]]:
    """Fixed chunks of consecutive members: a member's batch companions never depend on the world size."""
    k = max(1, members_per_chunk)
    return [list(members[s:s + k]) for s in range(0, len(members), k)]
