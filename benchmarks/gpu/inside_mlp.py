"""esrl's two ways to add a population's member terms in a gated MLP, timed per layer of a 1.5B model at a decode step.

`kernel`: what a StaticPopulation does by default, gate's and up's GEMMs, one member-term kernel launch for both
(esrl.es.shared_inputs.gate_up_first), act * up, down's GEMM and its kernel launch. `inside`: esrl.es.inside_terms's
InsideMLP.forward itself (the opt-in `terms_inside`), the terms as extra columns of the three GEMMs. `floor`: the MLP
with no terms. GPU microseconds per call (a captured graph of `--reps` calls, replayed, as lowrank_tiles.py times),
the terms' cost over a step's 28 layers for each way, and how far inside's output lies from the kernel's (bf16),
against the terms' own size. Unlike inside_gemm.py (each projection's wider GEMM alone, contiguous), this runs the
module's own layout ([C_gate | x | C_up] read as two strided slices) and its copies.

    PYTHONPATH=src python3 benchmarks/gpu/inside_mlp.py [--ranks 1,8] [--members 30] [--rows 8] [--reps 50]

GPU only.
"""

from __future__ import annotations

import json

import torch
from lowrank_tiles import LAYERS, decode_parser, print_device, time_us


def main() -> None:
    from transformers import Qwen2Config
    from transformers.models.qwen2.modeling_qwen2 import Qwen2MLP

    from esrl.es.inside_terms import InsideMLP
    from esrl.es.lowrank_kernel import lowrank_add_, lowrank_add_linears_
    from esrl.es.shared_inputs import gate_up_first_forward

    args = decode_parser(__doc__).parse_args()
    print_device()
    torch.manual_seed(0)
    mlp = Qwen2MLP(Qwen2Config(hidden_size=1536, intermediate_size=8960, hidden_act="silu")).cuda().bfloat16()
    m, n = args.members, args.rows
    x = torch.randn(m * n, 1, 1536, device="cuda").bfloat16()
    for rank in map(int, args.ranks.split(",")):
        factors = {name: ((torch.randn(m, rank, lin.out_features, device="cuda") * 0.02).bfloat16(),
                          (torch.randn(m, rank, lin.in_features, device="cuda") * 0.02).bfloat16())
                   for name, lin in (("gate", mlp.gate_proj), ("up", mlp.up_proj), ("down", mlp.down_proj))}
        inside = InsideMLP(mlp, ("gate", "up", "down"), (mlp.gate_proj, mlp.up_proj, mlp.down_proj), lambda: True)
        inside.load(factors, m)

        def kernel() -> torch.Tensor:
            gate, up = mlp.gate_proj(x), mlp.up_proj(x)
            lowrank_add_linears_([(y.view(m, n, -1), *factors[k]) for k, y in (("gate", gate), ("up", up))],
                                 x.view(m, n, -1))
            hidden = mlp.act_fn(gate) * up
            down = mlp.down_proj(hidden)
            lowrank_add_(down.view(m, n, -1), hidden.view(m, n, -1), *factors["down"])
            return down

        with torch.inference_mode():
            base, by_kernel = gate_up_first_forward(mlp, x).float(), kernel().float()
            by_inside = inside.forward(x).float()
            us = {"floor": time_us(lambda: gate_up_first_forward(mlp, x), args.reps),
                  "kernel": time_us(kernel, args.reps), "inside": time_us(lambda: inside.forward(x), args.reps)}
        terms = {way: (us[way] - us["floor"]) * LAYERS / 1000 for way in ("kernel", "inside")}
        print(json.dumps({"rank": rank, "members": m, "rows_per_member": n,
                          **{f"{k}_us": round(v, 2) for k, v in us.items()},
                          **{f"terms_{way}_ms_per_step": round(ms, 3) for way, ms in terms.items()},
                          "inside_over_kernel_terms": terms["kernel"] and round(terms["inside"] / terms["kernel"], 3),
                          "inside_minus_kernel_over_effect": round(float((by_inside - by_kernel).norm()
                                                                         / (by_kernel - base).norm()), 4)}),
              flush=True)


if __name__ == "__main__":
    main()
