"""Where a decode step's time goes on a GPU: the HF engine's static decoder per token, recorded (CUDA graph) vs eager,
and the GPU kernels of one recorded step by total time (torch.profiler), for the plain model and with an ES
population's hooks (lowrank rank 1, lora rank 8) in the step; `lowrank-overlap`, `lora-overlap`: their terms beside the
GEMMs on a side stream (StaticPopulation.overlap), where `busy_over_wall` above 1 shows kernels ran side by side.

    PYTHONPATH=src python3 benchmarks/gpu/decode_profile.py [--rows 240 --prompt 64 --new-tokens 256 --modes ...]

Random-weight Qwen2.5-1.5B (bf16), greedy, EOS never chosen (min_new_tokens). Prints JSON lines and kernel tables.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from contextlib import nullcontext

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def timed(dec, ids, mask, kw, label, repeats=2) -> float:
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        dec.generate(ids, mask, **kw)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    per = 1000 * min(times) / dec.key.new_tokens
    print(json.dumps({"what": label, "seconds": [round(t, 3) for t in times], "ms_per_token": round(per, 2),
                      "record_s": dec.record_seconds}), flush=True)
    return min(times)


def kernel_table(dec, ids, mask, label: str, top: int = 10) -> float:
    from torch.profiler import ProfilerActivity, profile

    from esrl.rollout.hf import rollout_attention

    with torch.inference_mode(), rollout_attention(ids.device):
        dec._prefill(ids, mask)  # replays must stay inside the cache
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(8):
                dec.graph.replay()
            torch.cuda.synchronize()
    rows = sorted(((e.key, e.device_time_total / 8, e.count // 8) for e in prof.key_averages()), key=lambda r: -r[1])
    total = sum(r[1] for r in rows) / 1000
    print(f"[{label}] GPU time per recorded step: {total:.2f} ms over {sum(r[2] for r in rows)} kernels")
    for name, us, count in rows[:top]:
        print(f"{us / 1000:8.3f} ms  x{count:<4d} {name[:100]}")
    return total


def main() -> None:
    from bench_setup import build_model

    from esrl.es import get_mode, lowrank_selection, population, select_params
    from esrl.es.noise import NoiseSpec
    from esrl.es.static_population import StaticPopulation
    from esrl.rollout.hf import rollout_attention
    from esrl.rollout.static_decode import DecodeKey, StaticDecoder, module_context

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=240)
    ap.add_argument("--members", type=int, default=30)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--model", default="random:qwen2.5-1.5b")
    ap.add_argument("--modes", default="floor,lowrank,lora")
    args = ap.parse_args()
    model = build_model(args.model, "cuda", "bfloat16").eval()
    torch.manual_seed(1)
    ids = torch.randint(100, 20000, (args.rows, args.prompt), device="cuda")
    mask = torch.ones_like(ids)
    mask[: args.rows // 2, : args.prompt // 3] = 0  # left padding on half the rows
    kw = dict(min_new_tokens=args.new_tokens)
    members = population(0, 0, args.members)
    row_member = torch.arange(args.members).repeat_interleave(args.rows // args.members)
    summary, lora = {}, None
    for mode in args.modes.split(","):
        static, context = None, nullcontext()
        StaticPopulation.overlap = mode.endswith("-overlap")  # the terms beside the GEMMs (esrl.es.side_terms)
        if mode.startswith("lowrank"):
            spec = NoiseSpec(mode="lowrank", sigma=0.01, rank=1)
            static = get_mode("lowrank").static_population(model, lowrank_selection(model, select_params(model), spec),
                                                           spec)
        elif mode.startswith("lora"):
            from esrl.es.config import ESConfig
            from esrl.es.setup import build_policy, build_selection

            if lora is None:  # the adapter is injected into `model` in place: once, for every lora mode
                cfg = ESConfig(mode="lora", sigma=0.01, lora_rank=8, lora_alpha=16)
                peft_model = build_policy(model, cfg, 0)
                lora = (peft_model, *build_selection(peft_model, cfg))
            static = get_mode("lora").static_population(*lora)
        if static is not None:
            static.load(members)
            context = static.population(row_member)
        key = DecodeKey(args.rows, args.prompt, args.new_tokens, False, False, len(members) if static is not None else 0,
                        module_context(model))
        dec = StaticDecoder(model, key, eos_token_ids=[0], pad_token_id=0, attention=rollout_attention)
        with context:
            if mode == "floor":
                dec.graphs = False
                summary["floor_eager_steps_s"] = timed(dec, ids, mask, kw, "floor_eager_steps")
                dec.graphs = True
            summary[mode + "_s"] = timed(dec, ids, mask, kw, mode + "_recorded")
            first = dec.tokens.clone()
            dec.generate(ids, mask, **kw)
            summary[mode + "_repeats"] = bool(torch.equal(dec.tokens, first))
            summary[mode + "_gpu_ms_per_step"] = kernel_table(dec, ids, mask, mode)
            # kernels' time over the wall's per token (prefill included): above 1, kernels ran side by side
            summary[mode + "_busy_over_wall"] = summary[mode + "_gpu_ms_per_step"] / (
                1000 * summary[mode + "_s"] / args.new_tokens)
        if mode == "floor":
            with torch.inference_mode(), rollout_attention(model.device):
                torch.cuda.synchronize()
                start = time.perf_counter()
                dec._prefill(ids, mask)
                torch.cuda.synchronize()
                summary["prefill_s"] = time.perf_counter() - start
        if static is not None:
            static.remove()
        del dec
        torch.cuda.empty_cache()
    if "floor_s" in summary:
        for mode in ("lowrank", "lora", "lowrank-overlap", "lora-overlap"):
            if mode + "_s" in summary:
                summary[mode + "_over_floor"] = round(summary[mode + "_s"] / summary["floor_s"], 3)
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in summary.items()}), flush=True)


if __name__ == "__main__":
    main()
