"""Whether the member terms belong inside the projection's own GEMM: times, per projection of a 1.5B model at a decode
step, what the lever in benchmarks/gpu/NOTES_issue15.md ("the lever beyond it") would cost before anyone builds it.

Today a perturbed linear runs its GEMM, then esrl's kernel adds the rows' member terms (one launch more). Inside the
GEMM: y = [x | C] @ [W | A_all^T]^T, where C (rows, members x rank) holds each row's c = x.B on its member's block
and zeros elsewhere, and A_all stacks every member's out-side factor: one GEMM with K = in + members x rank, no launch
of its own, but [x | C] must be written first (here by torch ops, a copy and a bmm into C's diagonal blocks: an upper
bound for the one kernel a group of linears reading one x would need). Per projection, GPU microseconds per call of:
the GEMM alone (`floor`), the GEMM then the kernel (`now`; one launch a linear, where esrl gives q, k and v one),
the wider GEMM (`inside`), and writing [x | C] (`prepare`); the wider GEMM's result is checked against fp64. Then over a step's 28 layers: the terms' cost now
(now - floor) against inside's (inside - floor, plus prepare once per group of linears sharing x: q/k/v, o,
gate/up, down).

    PYTHONPATH=src python3 benchmarks/gpu/inside_gemm.py [--ranks 1,8] [--members 30] [--rows 8] [--reps 50]

GPU only (CUDA events around replays of a captured graph, as lowrank_tiles.py times).
"""

from __future__ import annotations

import json

import torch
from lowrank_tiles import LAYERS, SHAPES, TOLERANCE, decode_parser, inputs, print_device, time_us

GROUPS = [("q", "k", "v"), ("o",), ("gate", "up"), ("down",)]  # linears reading one x: one [x | C] writer a group


def wider(x: torch.Tensor, w: torch.Tensor, a_t: torch.Tensor, b_t: torch.Tensor):
    """[x | C] and [W | A_all^T] for member-major rows, and the function that refills [x | C] (the `prepare`)."""
    m, r, n_in = a_t.shape[0], a_t.shape[1], x.shape[-1]
    rows = x.shape[0]
    k = n_in + m * r
    xc = torch.zeros(rows, k, dtype=x.dtype, device=x.device)
    n = rows // m
    blocks = xc.as_strided((m, n, r), (n * k + r, k, 1), storage_offset=n_in)  # row m*n+i, column in + m*r + j
    w_cat = torch.cat([w, a_t.to(w.dtype).reshape(m * r, -1).t()], dim=1).contiguous()

    def prepare() -> None:
        xc[:, :n_in].copy_(x)
        torch.bmm(x.view(m, n, n_in), b_t.to(x.dtype).transpose(1, 2), out=blocks)

    prepare()
    return xc, w_cat, prepare


def main() -> None:
    from esrl.es.lowrank_kernel import lowrank_add_

    args = decode_parser(__doc__).parse_args()
    print_device()
    m, n = args.members, args.rows
    for rank in map(int, args.ranks.split(",")):
        per = {}
        for name, (n_in, n_out) in SHAPES.items():
            _, xs, a_t, b_t = inputs(m, n, n_in, n_out, rank, torch.bfloat16)
            x = xs.reshape(m * n, n_in)
            w = (torch.randn(n_out, n_in, device="cuda") * n_in ** -0.5).bfloat16()
            xc, w_cat, prepare = wider(x, w, a_t, b_t)
            y = x @ w.t()
            want = x.double() @ w.double().t() + torch.bmm(torch.bmm(
                xs.double(), b_t.double().transpose(1, 2)), a_t.double()).reshape(m * n, n_out)
            scale = x.double().abs() @ w.double().abs().t() + torch.bmm(torch.bmm(
                xs.double().abs(), b_t.double().abs().transpose(1, 2)), a_t.double().abs()).reshape(m * n, n_out)
            got = xc @ w_cat.t()
            correct = bool(((got.double() - want).abs() <= (want.abs() + scale) * TOLERANCE).all())

            def now() -> None:
                out = torch.mm(x, w.t(), out=y)
                lowrank_add_(out.view(m, n, n_out), xs, a_t, b_t)

            per[name] = {"floor": time_us(lambda: torch.mm(x, w.t(), out=y), args.reps),
                         "now": time_us(now, args.reps),
                         "inside": time_us(lambda: torch.mm(xc, w_cat.t(), out=got), args.reps),
                         "prepare": time_us(prepare, args.reps), "correct": correct}
            print(json.dumps({"rank": rank, "linear": name, **{k: round(v, 2) if isinstance(v, float) else v
                                                               for k, v in per[name].items()}}), flush=True)
        now_ms = sum(p["now"] - p["floor"] for p in per.values()) * LAYERS / 1000
        gemm_ms = sum(p["inside"] - p["floor"] for p in per.values()) * LAYERS / 1000
        prepare_all_ms = sum(p["prepare"] for p in per.values()) * LAYERS / 1000
        prepare_group_ms = sum(per[g[0]]["prepare"] for g in GROUPS) * LAYERS / 1000
        print(json.dumps({"rank": rank, "terms_now_ms_per_step": round(now_ms, 3),
                          "inside_gemm_extra_ms": round(gemm_ms, 3),
                          "inside_with_torch_prepare_per_linear_ms": round(gemm_ms + prepare_all_ms, 3),
                          "inside_with_one_prepare_per_group_ms": round(gemm_ms + prepare_group_ms, 3),
                          "all_correct": all(p["correct"] for p in per.values())}), flush=True)


if __name__ == "__main__":
    main()
