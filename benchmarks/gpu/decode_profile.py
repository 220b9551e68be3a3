"""Where a decode step's time goes on a GPU: the HF engine's static decoder, per token, recorded (CUDA graph) vs
eager, and the GPU kernels of one recorded step by total time (torch.profiler).

    PYTHONPATH=src python3 benchmarks/gpu/decode_profile.py --rows 240 --prompt 64 --new-tokens 256

Random-weight Qwen2.5-1.5B (bf16), greedy, EOS never chosen (min_new_tokens). Prints JSON lines, then a table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def main() -> None:
    from es_throughput import build_model

    from esrl.rollout.hf import rollout_attention
    from esrl.rollout.static_decode import DecodeKey, StaticDecoder, module_context

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=240)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--model", default="random:qwen2.5-1.5b")
    args = ap.parse_args()
    model = build_model(args.model, "cuda", "bfloat16").eval()
    torch.manual_seed(1)
    ids = torch.randint(100, 20000, (args.rows, args.prompt), device="cuda")
    mask = torch.ones_like(ids)
    mask[: args.rows // 2, : args.prompt // 3] = 0  # left padding on half the rows
    key = DecodeKey(args.rows, args.prompt, args.new_tokens, False, False, module_context(model))
    dec = StaticDecoder(model, key, eos_token_ids=[0], pad_token_id=0, attention=rollout_attention)
    kw = dict(min_new_tokens=args.new_tokens)
    for label, graphs in (("eager_steps", False), ("recorded_steps", True)):
        dec.graphs = graphs
        times = []
        for _ in range(3):
            torch.cuda.synchronize()
            start = time.perf_counter()
            out = dec.generate(ids, mask, **kw)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        print(json.dumps({"what": label, "seconds": [round(t, 3) for t in times],
                          "ms_per_token": round(1000 * min(times) / args.new_tokens, 2),
                          "record_s": dec.record_seconds}), flush=True)
    first = out.clone()
    assert torch.equal(dec.generate(ids, mask, **kw), first), "recorded decode did not repeat"
    with torch.inference_mode(), rollout_attention(model.device):  # prefill alone
        torch.cuda.synchronize()
        start = time.perf_counter()
        dec._prefill(ids, mask)
        torch.cuda.synchronize()
        print(json.dumps({"what": "prefill", "seconds": round(time.perf_counter() - start, 4)}), flush=True)
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(8):
                dec.graph.replay()
            torch.cuda.synchronize()
    rows = sorted(((e.key, e.device_time_total / 8, e.count // 8) for e in prof.key_averages()), key=lambda r: -r[1])
    total = sum(r[1] for r in rows)
    print(f"GPU time per recorded step: {total / 1000:.2f} ms over {sum(r[2] for r in rows)} kernels")
    for name, us, count in rows[:18]:
        print(f"{us / 1000:8.3f} ms  x{count:<4d} {name[:110]}")


if __name__ == "__main__":
    main()
