"""Issue 15 probe, part 2 (after determinism_probe.py found plain generate nondeterministic too, SDPA on cuDNN):

  sdpa     which SDPA backend runs decode / prefill (and under use_deterministic_algorithms), and whether each
           backend repeats bitwise at KV lengths around the step where tokens diverged (~kv 130)
  gen      fit-like generate (2 prompts x 30 members, 128 tokens) repeated under the default backend (cuDNN),
           cuDNN forced, and mem-efficient forced; plain and with the lowrank hooks
  timing   240 rows x 64 tokens (EOS ignored): floor and lowrank hooks, default vs mem-efficient, cold and warm;
           eager floor at 240 x 256 with mem-efficient (the eager floor the compiled one should be compared with)
  hooks    compiled static-cache decode on a small fp32 model: do forward hooks installed AFTER the first compile
           (or new hooks for the next chunk of members) take effect? (torch._dynamo.config.skip_nnmodule_hook_guards)

    PYTHONUNBUFFERED=1 PYTHONPATH=.snap/src python benchmarks/gpu/determinism_probe2.py --out $OUT --budget 170
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import determinism_probe as dp  # noqa: E402
from determinism_probe import (QWEN25_15B, SMALL, TINY, build_model, fp, generate, lowrank_setup, make_prompts,  # noqa: E402
                               pop_ctx, sync, time_gen, tokens_cmp)
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

log = dp.log


def sec_sdpa(dev, dtype):
    import torch.nn.functional as F

    g = torch.Generator(device=dev).manual_seed(11)
    rows, heads, hd = 60, 12, 128 if not dp.ARGS.tiny else 16
    out = {}
    for L in (64, 120, 128, 129, 136, 160, 256, 512):
        q = torch.randn(rows, heads, 1, hd, generator=g, device=dev).to(dtype)
        k = torch.randn(rows, heads, L, hd, generator=g, device=dev).to(dtype)
        v = torch.randn(rows, heads, L, hd, generator=g, device=dev).to(dtype)
        pad = torch.randint(0, 15, (rows,), generator=torch.Generator().manual_seed(L)).to(dev)
        m = (torch.arange(L, device=dev)[None, :] >= pad[:, None])[:, None, None, :]
        res = {}
        try:
            res["default_choice"] = int(torch._fused_sdp_choice(q, k, v, attn_mask=m))
            torch.use_deterministic_algorithms(True, warn_only=True)
            res["choice_under_deterministic"] = int(torch._fused_sdp_choice(q, k, v, attn_mask=m))
        except Exception as e:  # noqa: BLE001
            res["choice_error"] = repr(e)[:200]
        finally:
            torch.use_deterministic_algorithms(False)
        for name, be in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("efficient", SDPBackend.EFFICIENT_ATTENTION),
                         ("math", SDPBackend.MATH)):
            try:
                with sdpa_kernel([be]):
                    vals = torch.stack([fp(F.scaled_dot_product_attention(q, k, v, attn_mask=m))
                                        for _ in range(dp.ARGS.micro_reps)]).cpu().tolist()
                res[name] = len(set(vals))
            except Exception as e:  # noqa: BLE001
                res[name] = repr(e)[:120]
        out[L] = res
    log("sdpa", decode_distinct_results_over_reps=out, note="backend ids: 0 math, 1 flash, 2 efficient, 3 cudnn")


def sec_gen(dev, model):
    ids, mask, members, sel, spec, T = dp.fit_like(dev, model)
    P = ids.shape[0]

    def gen_one(name, bes):
        res = {}
        with sdpa_kernel(bes):
            a = generate(model, ids, mask, len(members), T)
            b = generate(model, ids, mask, len(members), T)
            res[f"plain_{name}"] = tokens_cmp(a, b)
            h = []
            for _ in range(2):
                with pop_ctx(model, sel, spec, members, P):
                    h.append(generate(model, ids, mask, len(members), T))
            res[f"lowrank_{name}"] = tokens_cmp(h[0], h[1])
        log("gen", **res)

    for name, bes in (("efficient", [SDPBackend.EFFICIENT_ATTENTION]), ("cudnn_forced", [SDPBackend.CUDNN_ATTENTION])):
        try:
            gen_one(name, bes)
        except Exception as e:  # noqa: BLE001
            log("gen", backend=name, error=repr(e)[:300])


def sec_timing(dev, model):
    from esrl.es import population

    ids, mask = make_prompts(8, 30, 45, model.config.vocab_size, dev, seed=2)
    members = population(0, 0, dp.ARGS.members)
    sel, spec = lowrank_setup(model, 1e-2, 1)
    T = dp.ARGS.timing_tokens
    n = len(members)
    fac = lambda: pop_ctx(model, sel, spec, members, 8)  # noqa: E731
    res = {}
    from contextlib import nullcontext

    for name, bes in (("efficient", [SDPBackend.EFFICIENT_ATTENTION]), ("default", None)):
        with (sdpa_kernel(bes) if bes else nullcontext()):
            cold, _ = time_gen(model, ids, mask, n, T, repeats=1)
            warm, _ = time_gen(model, ids, mask, n, T, repeats=2)
            hooked, _ = time_gen(model, ids, mask, n, T, fac, repeats=2)
        res[name] = {"floor_cold_s": round(cold[0], 3), "floor_s": [round(x, 3) for x in warm],
                     "lowrank_s": [round(x, 3) for x in hooked],
                     "lowrank_over_floor": round(min(hooked) / min(warm), 3)}
    res["efficient_floor_over_default_floor"] = round(min(res["efficient"]["floor_s"]) / min(res["default"]["floor_s"]), 3)
    res["efficient_lowrank_over_default_lowrank"] = round(
        min(res["efficient"]["lowrank_s"]) / min(res["default"]["lowrank_s"]), 3)
    log("timing", rows=ids.shape[0] * n, tokens=T, **res)
    if dp.left() > 60:
        with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
            t, _ = time_gen(model, ids, mask, n, 256, repeats=1)
            t2, _ = time_gen(model, ids, mask, n, 256, repeats=1)
        log("timing", eager_floor_256_efficient_s=[round(t[0], 2), round(t2[0], 2)])


def sec_hooks(dev):
    """Small fp32 model: eager vs compiled (static cache) with hooks installed after / before the compile."""
    from esrl.es import population

    cfg = dict(SMALL, num_hidden_layers=2) if not dp.ARGS.tiny else TINY
    model = build_model(cfg, dev, torch.float32, seed=7)
    ids, mask = make_prompts(2, 30, 45, model.config.vocab_size, dev, seed=3)
    m0, m1 = population(0, 0, 30), population(0, 1, 30)
    sel, spec = lowrank_setup(model, 0.05, 1)  # large enough that every member's tokens differ from the floor's
    T = 32

    def run(members=None):
        if members is None:
            return generate(model, ids, mask, 30, T, ignore_eos=True)
        with pop_ctx(model, sel, spec, members, 2):
            return generate(model, ids, mask, 30, T, ignore_eos=True)

    e0, eh0, eh1 = run(), run(m0), run(m1)
    res = {"eager_hooked_vs_eager_floor": tokens_cmp(eh0, e0), "eager_m0_vs_eager_m1": tokens_cmp(eh0, eh1)}
    gc = model.generation_config

    def static_on():
        gc.cache_implementation = "static"
        if dev != "cuda":
            from transformers import CompileConfig

            gc.compile_config = CompileConfig()
            gc.compile_config._compile_all_devices = dp.ARGS.cpu_compile

    def reset():
        torch._dynamo.reset()
        if hasattr(model, "_compiled_call"):
            del model._compiled_call

    static_on()
    t = time.perf_counter()
    sf = run()
    res["A_compile_first_s"] = round(time.perf_counter() - t, 1)
    sh0, sh1 = run(m0), run(m1)
    res["A_floor_compiled_first"] = {"static_floor_vs_eager_floor": tokens_cmp(sf, e0),
                                     "static_hooked_m0_vs_eager_hooked_m0": tokens_cmp(sh0, eh0),
                                     "static_hooked_m0_vs_static_floor_from_token2": tokens_cmp(sh0[:, 1:], sf[:, 1:]),
                                     "static_hooked_m1_vs_eager_hooked_m1": tokens_cmp(sh1, eh1)}
    log("hooks", **res)
    reset()
    t = time.perf_counter()
    sh0b = run(m0)
    res["B_compile_first_s"] = round(time.perf_counter() - t, 1)
    sh1b = run(m1)
    res["B_hooked_compiled_first"] = {"static_hooked_m0_vs_eager_hooked_m0": tokens_cmp(sh0b, eh0),
                                      "static_hooked_m1_vs_eager_hooked_m1": tokens_cmp(sh1b, eh1),
                                      "static_hooked_m1_vs_eager_hooked_m0_from_token2": tokens_cmp(sh1b[:, 1:], eh0[:, 1:])}
    log("hooks", B=res["B_hooked_compiled_first"], B_compile_first_s=res["B_compile_first_s"])
    if dp.left() > 40:
        reset()
        torch._dynamo.config.skip_nnmodule_hook_guards = False
        try:
            t = time.perf_counter()
            sf2 = run()
            t1 = time.perf_counter()
            sh0c = run(m0)
            t2 = time.perf_counter()
            sh1c = run(m1)
            t3 = time.perf_counter()
            log("hooks", C_guards_on={"floor_s": round(t1 - t, 1), "hooked_m0_s": round(t2 - t1, 1),
                                      "hooked_m1_s": round(t3 - t2, 1),
                                      "static_floor_vs_eager": tokens_cmp(sf2, e0),
                                      "m0_vs_eager": tokens_cmp(sh0c, eh0), "m1_vs_eager": tokens_cmp(sh1c, eh1)},
                dynamo=dp.dynamo_stats())
        finally:
            torch._dynamo.config.skip_nnmodule_hook_guards = True
    gc.cache_implementation = None
    gc.compile_config = None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/probe2_out"))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--budget", type=float, default=170)
    ap.add_argument("--members", type=int, default=30)
    ap.add_argument("--fit-tokens", type=int, default=128)
    ap.add_argument("--timing-tokens", type=int, default=64)
    ap.add_argument("--micro-reps", type=int, default=20)
    ap.add_argument("--cpu-compile", action="store_true")
    ap.add_argument("--sections", default="sdpa,gen,timing,hooks")
    args = ap.parse_args()
    dp.ARGS = args
    os.makedirs(args.out, exist_ok=True)
    dp._LOG = open(os.path.join(args.out, "probe2.jsonl"), "w")
    dev = args.device
    dtype = torch.float32 if dev == "cpu" else torch.bfloat16
    sections = args.sections.split(",")

    def guard(name, fn, need):
        if name not in sections:
            return
        if dp.left() < need:
            log(name, skipped=f"{dp.left():.0f}s left < {need}s")
            return
        t = time.perf_counter()
        try:
            fn()
        except Exception as e:  # noqa: BLE001
            import traceback

            log(name, error=repr(e), tb=traceback.format_exc()[-3000:])
        log(name, section_s=round(time.perf_counter() - t, 1))

    guard("sdpa", lambda: sec_sdpa(dev, dtype), 5)
    model = None
    if any(s in sections for s in ("gen", "timing")):
        model = build_model(TINY if args.tiny else QWEN25_15B, dev, dtype)
        sync()
    guard("gen", lambda: sec_gen(dev, model), 30)
    guard("timing", lambda: sec_timing(dev, model), 30)
    del model
    if dev == "cuda":
        torch.cuda.empty_cache()
    guard("hooks", lambda: sec_hooks(dev), 30)
    log("done", total_s=round(time.perf_counter() - dp.T0, 1))


if __name__ == "__main__":
    main()
