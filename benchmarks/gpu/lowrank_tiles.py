"""Block sizes for esrl's member-term kernel (`esrl.es.lowrank_kernel`), timed per projection of a 1.5B model.

The kernel adds ys[i] += A_m (B_m^T x[i]) for every member's rows, once per perturbed linear per decode step: lowrank
at rank 1, lora at rank 8, with factors in the model's dtype (bf16; `--factor-dtypes bfloat16,float32` times lora's
fp32 adapters beside them, as the kernel read them until session 19). This times each candidate `tiles` (overrides)
on Qwen2.5-1.5B's seven projection shapes at decode (30 members x 8 rows) and prefill (x 64 tokens), checks each result
within one bf16 rounding of the fp64 sum (plus fp32's error in long sums), and prints one JSON line per (rank, phase,
config; the first two: launch_plan's default and the torch ops instead of the kernel) with GPU microseconds per
call and the sum over the model's 196 perturbed linears (28 layers x the 7 shapes: one decode step, or one prefill),
then the best config per rank and phase beside the default, the best per projection, the torch ops' time over the
kernel's (`torch_over_kernel`: which one esrl should take at decode and at prefill, `KERNEL_ROWS`) and which esrl
takes. (A block-diagonal dense GEMM for lora's decode terms was timed here too: 1.58x the kernel over a step, H100,
session 28; `git show 8edb4c2:src/esrl/es/lowrank_kernel.py` has its `_gemm_add_`.)

    PYTHONPATH=src python3 benchmarks/gpu/lowrank_tiles.py [--ranks 1,8] [--factor-dtypes bfloat16] [--reps 50]
                                                           [--default-only]

GPU only (CUDA events around replays of a captured graph of the calls, after a warm-up that compiles).
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch

LAYERS = 28
TOLERANCE = 2 ** -8  # one bf16 rounding of the fp32 sum (round to nearest, as a GPU does)
FP32_SLACK = 2 ** -16  # fp32 sums of up to 8960 products, relative to the sum of their magnitudes
SHAPES = {"q": (1536, 1536), "k": (1536, 256), "v": (1536, 256), "o": (1536, 1536), "gate": (1536, 8960),
          "up": (1536, 8960), "down": (8960, 1536)}  # name: (in, out), Qwen2.5-1.5B
CONFIGS = [dict(BLOCK_IN=i, BLOCK_OUT=o, num_warps=w)
           for i, o, w in itertools.product([256, 512, 1024, 2048], [512, 1024, 4096], [4, 8])]
KERNEL = {}  # launch_plan's block sizes (given, the kernel runs at any rows per member)
TORCH = "torch"  # the torch ops (batched GEMMs) instead of the kernel: what a prefill takes above KERNEL_ROWS


def time_us(fn, reps: int) -> float:
    """GPU microseconds per call: `reps` calls captured in one CUDA graph, replayed (as the recorded decode step
    runs them), so Triton's host-side launch cost (~20-40 us a call, more than these kernels' work) stays out."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(3):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return 1000 * start.elapsed_time(end) / (3 * reps)


def inputs(members: int, rows: int, n_in: int, n_out: int, rank: int, factor_dtype):
    g = torch.Generator(device="cuda").manual_seed(n_in * n_out + rank)
    randn = lambda *s: torch.randn(*s, device="cuda", generator=g)
    return (randn(members, rows, n_out).bfloat16(), randn(members, rows, n_in).bfloat16(),
            (randn(members, rank, n_out) * 0.1).to(factor_dtype), (randn(members, rank, n_in) * 0.1).to(factor_dtype))


SHARED = [("q", "k", "v"), ("gate", "up")]  # linears reading one x whose terms esrl adds in one launch


def one_launch_for(names: tuple[str, ...], rank: int, factor_dtype, members: int, rows: int, phase: str,
                   reps: int) -> dict:
    """The member terms of linears reading one x (q, k and v; gate and up): one launch each against one launch."""
    from esrl.es.lowrank_kernel import lowrank_add_, lowrank_add_linears_

    terms = [inputs(members, rows, SHAPES[name][0], SHAPES[name][1], rank, factor_dtype) for name in names]
    xs = terms[0][1]
    each = lambda ys: [lowrank_add_(y, xs, a_t, b_t) for y, (_, _, a_t, b_t) in zip(ys, terms)]
    one = lambda ys: lowrank_add_linears_([(y, a_t, b_t) for y, (_, _, a_t, b_t) in zip(ys, terms)], xs)
    got_each, got1 = [t[0].clone() for t in terms], [t[0].clone() for t in terms]
    each(got_each)
    one(got1)
    ys = [t[0] for t in terms]
    us_each, us1 = time_us(lambda: each(ys), reps), time_us(lambda: one(ys), reps)
    return {"rank": rank, "factors": str(factor_dtype), "phase": phase, "linears": ",".join(names),
            "bit_equal": all(torch.equal(a, b) for a, b in zip(got1, got_each)), "us_one_launch_each": round(us_each, 2),
            "us_one_launch": round(us1, 2), "one_over_each": round(us1 / us_each, 3),
            "ms_saved_per_step": round((us_each - us1) * LAYERS / 1000, 3)}


def decode_parser(doc: str) -> argparse.ArgumentParser:
    """The options this folder's per-projection timings share (ranks, members, rows a member at decode, reps)."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--ranks", default="1,8")
    ap.add_argument("--members", type=int, default=30)
    ap.add_argument("--rows", type=int, default=8, help="rows per member at decode (prompts per member)")
    ap.add_argument("--reps", type=int, default=50)
    return ap


def print_device() -> None:
    print(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__}), flush=True)


def main() -> None:
    from esrl.es.lowrank_kernel import KERNEL_ROWS, _torch_add_, kernel_takes, lowrank_add_

    ap = decode_parser(__doc__)
    ap.add_argument("--prompt", type=int, default=64, help="prefill: tokens per row")
    ap.add_argument("--factor-dtypes", default="bfloat16", help="comma-separated torch dtypes of the factors")
    ap.add_argument("--default-only", action="store_true", help="time launch_plan's block sizes only")
    args = ap.parse_args()
    print_device()
    dtypes = [getattr(torch, name) for name in args.factor_dtypes.split(",")]
    for rank, factor_dtype in itertools.product(map(int, args.ranks.split(",")), dtypes):
        for phase, rows in (("decode", args.rows), ("prefill", args.rows * args.prompt)):
            reps = args.reps if phase == "decode" else max(3, args.reps // 10)
            results = []
            for tiles in [KERNEL, TORCH] + ([] if args.default_only else CONFIGS):
                add = _torch_add_ if tiles == TORCH else (lambda *t: lowrank_add_(*t, tiles))
                total, per_shape, ok = 0.0, {}, True
                for name, (n_in, n_out) in SHAPES.items():
                    ys, xs, a_t, b_t = inputs(args.members, rows, n_in, n_out, rank, factor_dtype)
                    want = ys.double() + torch.bmm(torch.bmm(xs.double(), b_t.double().transpose(1, 2)), a_t.double())
                    scale = ys.double().abs() + torch.bmm(torch.bmm(
                        xs.double().abs(), b_t.double().abs().transpose(1, 2)), a_t.double().abs())
                    got = ys.clone()
                    try:
                        add(got, xs, a_t, b_t)
                    except Exception as e:  # a config the chip cannot run (shared memory, registers)
                        ok = f"{type(e).__name__}: {str(e)[:80]}"
                        break
                    # the torch ops round x.B to bf16 before the add: one more rounding, of the term
                    slack = TOLERANCE if isinstance(tiles, str) else FP32_SLACK
                    ok = ok and bool(((got.double() - want).abs() <= want.abs() * TOLERANCE + scale * slack).all())
                    per_shape[name] = round(time_us(lambda: add(ys, xs, a_t, b_t), reps), 2)
                    total += per_shape[name] * LAYERS
                row = {"rank": rank, "factors": str(factor_dtype), "phase": phase, "tiles": tiles or "kernel",
                       "correct": ok, "us_per_call": per_shape, "ms_all_linears": round(total / 1000, 3)}
                print(json.dumps(row), flush=True)
                if ok is True:
                    results.append(row)
            if not results:
                print(json.dumps({"rank": rank, "factors": str(factor_dtype), "phase": phase, "best": None,
                                  "why": "no config was correct"}))
                continue
            best = min(results, key=lambda r: r["ms_all_linears"])
            ms = lambda tiles: next((r["ms_all_linears"] for r in results if r["tiles"] == (tiles or "kernel")), None)
            kernel, torch_ops = ms(KERNEL), ms(TORCH)
            per_shape = {name: min(((r["us_per_call"][name], r["tiles"]) for r in results), key=lambda b: b[0])
                         for name in SHAPES}
            print(json.dumps({"best": best, "kernel_ms_all_linears": kernel, "torch_ms_all_linears": torch_ops,
                              "kernel_over_best": kernel and round(kernel / best["ms_all_linears"], 3),
                              "best_per_shape": per_shape,
                              "torch_over_kernel": kernel and torch_ops and round(torch_ops / kernel, 3),
                              "esrl_takes": "kernel" if kernel_takes(rank, rows) else "torch"}), flush=True)
            if rows <= KERNEL_ROWS:  # q, k and v (gate and up) in one launch at decode
                for names in SHARED:
                    print(json.dumps(one_launch_for(names, rank, factor_dtype, args.members, rows, phase, reps)),
                          flush=True)


if __name__ == "__main__":
    main()
