"""Issue 15 probe: where the population-batched ES path is nondeterministic on CUDA, what a fix costs, and
feasibility figures for a compiled (static-cache) decode path. One script, one device call.

Random-weight Qwen2.5-1.5B (bf16, nothing downloaded), prompts as random token ids (no tokenizer), the ES
hooks imported from esrl (PYTHONPATH), e.g. a snapshot of a committed tree:

    PYTHONUNBUFFERED=1 PYTHONPATH=.snap/src python benchmarks/gpu/determinism_probe.py --out $OUT --budget 480

CPU smoke test (tiny model, every section, no compile): --tiny --device cpu --budget 300

Sections (each guarded, skipped when the time budget is spent):
  env        versions, SDPA backends, cuBLAS workspace config
  inproc     in-process repeats of the fit-like population generate (2 prompts x 30 members, 128 tokens, rank 1,
             sigma 1e-3) and of the plain generate; per-module bitwise fingerprints of prefill + 8 decode steps,
             first diverging module; the same after shifting the allocator
  micro      one hooked Linear on fixed inputs (prefill / decode shapes), repeated, at several storage offsets;
             SDPA with a padding mask repeated; CUDA-generator factor draws repeated; the rms scale repeated
  warn       torch.use_deterministic_algorithms(True, warn_only=True): the ops that warn during a hooked generate
  full       full mode: perturb / restore bit-exactness, repeatability of the CUDA noise and of the generate
  xproc      fresh processes (two plain, two with CUBLAS_WORKSPACE_CONFIG=:4096:8) compare weights, factors,
             fingerprints and tokens of every hook variant across processes
  timing     240 rows (8 prompts x 30 members) x 64 tokens, EOS ignored: floor and every hook variant
  det        fresh processes with use_deterministic_algorithms(True) (with and without NaN-filling of
             uninitialized memory): timings of floor and current hooks, and their tokens
  static     cache_implementation="static" (transformers compiles the decode step): compile time, floor and
             hooked lowrank at 240 rows x 256 tokens, recompile time for a new chunk of members, tokens vs eager
  static32   fp32 small config: hooked eager vs hooked static greedy tokens
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import subprocess
import sys
import time
import warnings

import torch

QWEN25_15B = dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                  num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768, rope_theta=1e6,
                  rms_norm_eps=1e-6, tie_word_embeddings=True, hidden_act="silu")
TINY = dict(QWEN25_15B, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=1000, max_position_embeddings=4096)
SMALL = dict(QWEN25_15B, hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=2, vocab_size=32000, max_position_embeddings=4096)
PAD, EOS = 0, 1
VARIANTS = ("cur", "noh2d", "bmm", "oop", "fp32dot")

T0 = time.perf_counter()
ARGS = None
_LOG = None


def log(section: str, **kv) -> None:
    rec = {"t": round(time.perf_counter() - T0, 1), "section": section, **kv}
    line = json.dumps(rec, default=str)
    print(line, flush=True)
    if _LOG is not None:
        _LOG.write(line + "\n")
        _LOG.flush()


def left() -> float:
    return ARGS.budget - (time.perf_counter() - T0)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().contiguous().reshape(-1)
    return t.view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def fp(t: torch.Tensor) -> torch.Tensor:
    """A bit-sensitive fingerprint (GPU scalar, no sync): sum of the bit patterns, position-weighted."""
    b = bits(t).to(torch.int64)
    w = (torch.arange(b.numel(), device=b.device, dtype=torch.int64) % 977) + 1
    return (b * w).sum()


def digest(t: torch.Tensor) -> str:
    return hashlib.sha1(bits(t).cpu().numpy().tobytes()).hexdigest()[:16]


# -- model, prompts, population --------------------------------------------------------------------------
def build_model(cfg: dict, device: str, dtype: torch.dtype, seed: int = 0):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen2ForCausalLM(Qwen2Config(**cfg)).to(dtype)
    return model.eval()


def make_prompts(n: int, lo: int, hi: int, vocab: int, device: str, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi + 1, (n,), generator=g)
    width = int(lens.max())
    ids = torch.full((n, width), PAD, dtype=torch.long)
    mask = torch.zeros((n, width), dtype=torch.long)
    for i, k in enumerate(lens.tolist()):
        ids[i, width - k:] = torch.randint(2, vocab, (k,), generator=g)
        mask[i, width - k:] = 1
    return ids.to(device), mask.to(device)


def gen_kwargs(tokens: int, ignore_eos: bool) -> dict:
    kw = dict(max_new_tokens=tokens, do_sample=False, temperature=None, top_p=None, top_k=None, pad_token_id=PAD,
              eos_token_id=EOS)
    if ignore_eos:
        kw["min_new_tokens"] = tokens
    return kw


@torch.inference_mode()
def generate(model, ids, mask, n_members: int, tokens: int, ignore_eos: bool = False):
    """Member-major rows (row k = member k // P, prompt k % P), as HFEngine.generate_population builds them."""
    rows_ids, rows_mask = ids.repeat(n_members, 1), mask.repeat(n_members, 1)
    seqs = model.generate(input_ids=rows_ids, attention_mask=rows_mask, **gen_kwargs(tokens, ignore_eos))
    return seqs[:, ids.shape[1]:]


def lowrank_setup(model, sigma: float, rank: int):
    from esrl.es import NoiseSpec, lowrank_selection, select_params

    spec = NoiseSpec(mode="lowrank", sigma=sigma, rank=rank)
    return lowrank_selection(model, select_params(model), spec), spec


def make_variant_class():
    from esrl.es.lowrank import PopulationPerturbation

    class Variant(PopulationPerturbation):
        """The current hooks ('cur') and alternatives for the member-major (per_member) path, rank 1 or r."""

        variant = "cur"

        def _linear_hook(self, factors):
            v = self.variant
            if v == "cur":
                return super()._linear_hook(factors)
            a, b = factors["A"], factors["B"]
            assert factors.get("bias") is None and self.per_member
            m, r = a.shape[0], a.shape[-1]
            a_t = a.transpose(1, 2).contiguous()  # (M, r, out)
            b_row = b.transpose(1, 2).contiguous()  # (M, r, in)
            a_tf, b_rowf, b_f = a_t.float(), b_row.float(), b.float()

            def hook(module, args, out):
                x = args[0]
                xs, ys = x.reshape(m, -1, x.shape[-1]), out.view(m, -1, out.shape[-1])
                if v == "noh2d":  # the current math without _rows (a host->device copy per call)
                    if r == 1:
                        ys.addcmul_((xs * b_row).sum(-1, keepdim=True), a_t)
                    else:
                        ys.baddbmm_(torch.bmm(xs, b), a_t)
                elif v == "bmm":  # rank 1 through cuBLAS too
                    ys.baddbmm_(torch.bmm(xs, b), a_t)
                elif v == "oop":  # out of place: a fresh output tensor
                    if r == 1:
                        return out + ((xs * b_row).sum(-1, keepdim=True) * a_t).view(out.shape)
                    return out + torch.bmm(torch.bmm(xs, b), a_t).view(out.shape)
                elif v == "fp32dot":  # x.b and the rank-r sum in fp32, one rounding to bf16 at the add
                    if r == 1:
                        ys.add_((xs.float() * b_rowf).sum(-1, keepdim=True) * a_tf)
                    else:
                        ys.add_(torch.bmm(torch.bmm(xs.float(), b_f), a_tf))
                else:
                    raise ValueError(v)
                return out

            return hook

    return Variant


def pop_ctx(model, sel, spec, members, n_prompts: int, variant: str = "cur"):
    cls = make_variant_class()
    row_member = torch.arange(len(members)).repeat_interleave(n_prompts)
    ctx = cls(model, sel, spec, members, row_member)
    ctx.variant = variant
    return ctx


class Tracer:
    """Per-module bitwise fingerprints (Linear inputs and every module's output), registered after the ES hooks."""

    def __init__(self, model):
        self.model, self.names, self.vals, self.handles = model, [], [], []

    def __enter__(self):
        for name, mod in self.model.named_modules():
            if isinstance(mod, torch.nn.Linear):
                self.handles.append(mod.register_forward_pre_hook(self._pre(name)))
            self.handles.append(mod.register_forward_hook(self._post(name)))
        return self

    def _pre(self, name):
        def hook(mod, args):
            self.names.append(name + ":in")
            self.vals.append(fp(args[0]))
        return hook

    def _post(self, name):
        def hook(mod, args, out):
            t = out if torch.is_tensor(out) else (out[0] if isinstance(out, (tuple, list)) and out and torch.is_tensor(out[0])
                                                 else getattr(out, "logits", None))
            if t is not None:
                self.names.append(name or "<model>")
                self.vals.append(fp(t))
        return hook

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()

    def result(self) -> list[int]:
        return torch.stack(self.vals).cpu().tolist() if self.vals else []


def traced(model, ids, mask, n_members, steps=8, ctx=None):
    """Fingerprints of a population generate's prefill + `steps`-1 decode steps (with the hooks of ctx, if any)."""
    from contextlib import nullcontext

    with (ctx if ctx is not None else nullcontext()):
        with Tracer(model) as tr:
            toks = generate(model, ids, mask, n_members, steps, ignore_eos=True)
    return tr.names, tr.result(), toks


def first_diff(names, a, b):
    n = min(len(a), len(b))
    idx = next((i for i in range(n) if a[i] != b[i]), None)
    if idx is None:
        return None if len(a) == len(b) else {"length": [len(a), len(b)]}
    step = sum(1 for x in names[:idx] if x == "<model>")
    return {"index": idx, "module": names[idx], "step": step, "n_diff": sum(1 for i in range(n) if a[i] != b[i]),
            "of": n, "first_diffs": [names[i] for i in range(idx, n) if a[i] != b[i]][:8]}


def tokens_cmp(a: torch.Tensor, b: torch.Tensor) -> dict:
    if a.shape != b.shape:
        return {"equal": False, "shapes": [list(a.shape), list(b.shape)]}
    diff = (a != b)
    rows = diff.any(1)
    first = int(diff.any(0).nonzero()[0]) if bool(rows.any()) else None
    return {"equal": not bool(rows.any()), "rows_differ": int(rows.sum()), "of": a.shape[0], "first_step": first}


# -- sections ----------------------------------------------------------------------------------------------
def sec_env(dev):
    info = {"torch": torch.__version__, "cuda": torch.version.cuda, "device": dev,
            "CUBLAS_WORKSPACE_CONFIG": os.environ.get("CUBLAS_WORKSPACE_CONFIG")}
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except Exception as e:  # noqa: BLE001
        info["transformers"] = repr(e)
    if dev == "cuda":
        info.update(gpu=torch.cuda.get_device_name(), sm=torch.cuda.get_device_properties(0).multi_processor_count,
                    cublas=getattr(torch.backends.cuda, "preferred_blas_library", lambda: None)().__repr__(),
                    flash=torch.backends.cuda.flash_sdp_enabled(), mem_eff=torch.backends.cuda.mem_efficient_sdp_enabled(),
                    cudnn_sdp=torch.backends.cuda.cudnn_sdp_enabled(), math_sdp=torch.backends.cuda.math_sdp_enabled(),
                    tf32_matmul=torch.backends.cuda.matmul.allow_tf32,
                    bf16_reduced=torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction)
    log("env", **info)


def fit_like(dev, model, tokens=None):
    """2 prompts x 30 members (the paper config: max_batch_size 64 -> one chunk of 30), rank 1, sigma 1e-3."""
    ids, mask = make_prompts(2, 30, 45, model.config.vocab_size, dev, seed=1)
    from esrl.es import population

    members = population(0, 0, ARGS.members)
    sel, spec = lowrank_setup(model, 1e-3, 1)
    return ids, mask, members, sel, spec, tokens or ARGS.fit_tokens


def sec_inproc(dev, model):
    ids, mask, members, sel, spec, T = fit_like(dev, model)
    P = ids.shape[0]
    res = {}
    a = generate(model, ids, mask, len(members), T)
    b = generate(model, ids, mask, len(members), T)
    res["plain_tokens"] = tokens_cmp(a, b)
    toks = []
    for k in range(3):
        if k == 2:  # shift the caching allocator's state: different addresses for everything after
            junk = [torch.empty(1 + 4099 * i, device=dev) for i in range(1, 40)]
        with pop_ctx(model, sel, spec, members, P):
            toks.append(generate(model, ids, mask, len(members), T))
    res["lowrank_tokens_run2"] = tokens_cmp(toks[0], toks[1])
    res["lowrank_tokens_run3_shifted"] = tokens_cmp(toks[0], toks[2])
    del junk
    log("inproc", **res)
    # fingerprints: plain and hooked, twice each, then hooked after an allocator shift
    n1, f1, _ = traced(model, ids, mask, len(members))
    n2, f2, _ = traced(model, ids, mask, len(members))
    h1n, h1, _ = traced(model, ids, mask, len(members), ctx=pop_ctx(model, sel, spec, members, P))
    h2n, h2, _ = traced(model, ids, mask, len(members), ctx=pop_ctx(model, sel, spec, members, P))
    junk = [torch.empty(3 + 8191 * i, dtype=torch.bfloat16, device=dev) for i in range(1, 25)]
    h3n, h3, _ = traced(model, ids, mask, len(members), ctx=pop_ctx(model, sel, spec, members, P))
    del junk
    log("inproc", fp_plain=first_diff(n1, f1, f2), fp_hooked=first_diff(h1n, h1, h2),
        fp_hooked_shifted=first_diff(h1n, h1, h3), n_fingerprints=len(h1))
    # rank 4 (the baddbmm path)
    sel4, spec4 = lowrank_setup(model, 1e-3, 4)
    r4 = [traced(model, ids, mask, len(members), ctx=pop_ctx(model, sel4, spec4, members, P)) for _ in range(2)]
    log("inproc", fp_hooked_rank4=first_diff(r4[0][0], r4[0][1], r4[1][1]))
    for v in VARIANTS[1:]:
        rv = [traced(model, ids, mask, len(members), ctx=pop_ctx(model, sel, spec, members, P, v)) for _ in range(2)]
        log("inproc", variant=v, fp=first_diff(rv[0][0], rv[0][1], rv[1][1]))


def sec_micro(dev, model):
    from esrl.es import population

    members = population(0, 0, ARGS.members)
    sel, spec = lowrank_setup(model, 1e-3, 1)
    layer = model.model.layers[0]
    g = torch.Generator(device=dev).manual_seed(5)
    dtype = next(model.parameters()).dtype
    out = {}
    for pname, mod in (("q_proj", layer.self_attn.q_proj), ("down_proj", layer.mlp.down_proj)):
        for shape_name, seq in (("prefill", 40), ("decode", 1)):
            rows = 8 * len(members)
            n_in = mod.in_features
            n_el = rows * seq * n_in
            x0 = torch.randn(n_el, generator=g, device=dev).to(dtype)
            bufs = {off: torch.empty(n_el + 64, dtype=dtype, device=dev) for off in (0, 1, 8, 64)}
            for off, bf in bufs.items():  # the same values at different storage offsets (alignments)
                bf[off:off + n_el].copy_(x0)
            for variant in ("none", "cur", "bmm"):
                results = {}
                from contextlib import nullcontext

                with (nullcontext() if variant == "none" else pop_ctx(model, sel, spec, members, 8, variant)):
                    for off in (0, 1, 8, 64):
                        x = bufs[off][off:off + n_el].view(rows, seq, n_in)
                        vals = torch.stack([fp(mod(x)) for _ in range(ARGS.micro_reps)]).cpu().tolist()
                        results[off] = (len(set(vals)), vals[0])
                out[f"{pname}/{shape_name}/{variant}"] = {
                    "distinct_per_offset": {k: v[0] for k, v in results.items()},
                    "offsets_agree": len({v[1] for v in results.values()}) == 1}
    log("micro", linear=out)
    # SDPA with left padding (the population's mask), repeated
    import torch.nn.functional as F

    rows, heads, seq, hd = 240, 12, 48, 128 if not ARGS.tiny else 16
    q = torch.randn(rows, heads, seq, hd, generator=g, device=dev).to(dtype)
    k = torch.randn(rows, 2, seq, hd, generator=g, device=dev).to(dtype).repeat_interleave(6, 1)[:, :heads]
    v = torch.randn_like(k)
    pad = torch.randint(0, 20, (rows,), generator=torch.Generator().manual_seed(3)).to(dev)
    keep = torch.arange(seq, device=dev)[None, :] >= pad[:, None]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=dev).tril()
    m = (keep[:, None, None, :] & causal[None, None]).expand(rows, 1, seq, seq)
    try:
        backend = {"prefill": int(torch._fused_sdp_choice(q, k, v, attn_mask=m)),
                   "decode": int(torch._fused_sdp_choice(q[:, :, -1:], k, v, attn_mask=m[:, :, -1:]))}
    except Exception as e:  # noqa: BLE001
        backend = repr(e)
    log("micro", sdpa_backend_choice=backend, note="0 math, 1 flash, 2 efficient, 3 cudnn (SDPBackend order)")
    vals = torch.stack([fp(F.scaled_dot_product_attention(q, k, v, attn_mask=m)) for _ in range(ARGS.micro_reps)])
    qd = q[:, :, -1:]
    vals_d = torch.stack([fp(F.scaled_dot_product_attention(qd, k, v, attn_mask=m[:, :, -1:])) for _ in range(ARGS.micro_reps)])
    # factor draws on the device generator, the rms scale
    from esrl.es.lowrank import lowrank_factors, tensor_scale, NoiseSpec

    p = sel.params[0]
    fa = [digest(torch.cat([t.reshape(-1) for t in lowrank_factors(members[0].seed, sel.indices[0], p.shape, 1, p.device,
                                                                   torch.Generator(device=p.device))]))
          for _ in range(5)]
    rms = NoiseSpec(mode="lowrank", sigma=1e-3, sigma_scaling="rms")
    sc = [tensor_scale(q_, rms) for q_ in sel.params[:20] for _ in range(3)]
    log("micro", sdpa_prefill_distinct=len(set(vals.cpu().tolist())), sdpa_decode_distinct=len(set(vals_d.cpu().tolist())),
        factor_draws_distinct=len(set(fa)), rms_scale_repeat_equal=all(sc[3 * i] == sc[3 * i + 1] == sc[3 * i + 2]
                                                                       for i in range(len(sc) // 3)))


def sec_warn(dev, model):
    ids, mask, members, sel, spec, _ = fit_like(dev, model)
    msgs = {}
    prev = torch.are_deterministic_algorithms_enabled()
    try:
        with warnings.catch_warnings(record=True) as rec:
            warnings.simplefilter("always")
            torch.use_deterministic_algorithms(True, warn_only=True)
            with pop_ctx(model, sel, spec, members, ids.shape[0]):
                generate(model, ids, mask, len(members), 4)
            generate(model, ids, mask, len(members), 4)
        for w in rec:
            key = str(w.message)[:200]
            msgs[key] = msgs.get(key, 0) + 1
    finally:
        torch.use_deterministic_algorithms(prev)
    log("warn", warnings=msgs)


def sec_full(dev, model):
    from esrl.es import Perturber, population, select_params, weights_checksum
    from esrl.es.lowrank import NoiseSpec

    ids, mask, members, _, _, T = fit_like(dev, model)
    sel = select_params(model)
    res = {}
    base = weights_checksum(sel.params).item()
    sums, toks = [], []
    for spec in (None, NoiseSpec(mode="full", sigma=1e-3, sigma_scaling="rms")):
        per = Perturber(sel, spec)
        for k in range(2):
            per.perturb(members[3], 1e-3)
            sums.append(weights_checksum(sel.params).item())
            if spec is None:
                toks.append(generate(model, ids, mask, 1, T))
            per.restore()
            res.setdefault("restored_bit_exact", []).append(weights_checksum(sel.params).item() == base)
        per.free()
    res["perturbed_checksum_repeat_equal"] = [sums[0] == sums[1], sums[2] == sums[3]]
    res["perturbed_tokens_repeat"] = tokens_cmp(toks[0], toks[1])
    res["perturbed_checksum"] = sums[0]
    log("full", **res)


def time_gen(model, ids, mask, n, T, ctx_factory=None, repeats=2):
    from contextlib import nullcontext

    times, toks = [], None
    for _ in range(repeats):
        sync()
        t = time.perf_counter()
        with (ctx_factory() if ctx_factory else nullcontext()):
            toks = generate(model, ids, mask, n, T, ignore_eos=True)
        sync()
        times.append(time.perf_counter() - t)
    return times, toks


def sec_timing(dev, model, variants=VARIANTS, store=None):
    from esrl.es import population

    ids, mask = make_prompts(8, 30, 45, model.config.vocab_size, dev, seed=2)
    members = population(0, 0, ARGS.members)
    sel, spec = lowrank_setup(model, 1e-2, 1)
    T = ARGS.timing_tokens
    generate(model, ids, mask, len(members), 2, ignore_eos=True)  # warm-up
    floor, ftoks = time_gen(model, ids, mask, len(members), T)
    res = {"floor_s": [round(x, 3) for x in floor]}
    if store is not None:
        store["floor"] = ftoks
    for v in variants:
        if left() < 30:
            res["skipped_from"] = v
            break
        times, toks = time_gen(model, ids, mask, len(members), T, lambda: pop_ctx(model, sel, spec, members, 8, v))
        res[f"{v}_s"] = [round(x, 3) for x in times]
        res[f"{v}_over_floor"] = round(min(times) / min(floor), 3)
        res[f"{v}_rows_equal_floor"] = int((toks == ftoks).all(1).sum())
        if store is not None:
            store[v] = toks
    log("timing", rows=ids.shape[0] * len(members), tokens=T, **res)
    return res


def dynamo_stats() -> dict:
    try:
        from torch._dynamo.utils import counters

        return {k: dict(v) for k, v in counters.items() if k in ("stats", "recompiles", "graph_break")}
    except Exception as e:  # noqa: BLE001
        return {"error": repr(e)}


def sec_static(dev, model, eager_store):
    from esrl.es import population

    ids, mask = make_prompts(8, 30, 45, model.config.vocab_size, dev, seed=2)
    members = population(0, 0, ARGS.members)
    sel, spec = lowrank_setup(model, 1e-2, 1)
    T = ARGS.static_tokens
    res = {}
    # the eager floor at the same size, for the ratio
    t_eager, eager_floor = time_gen(model, ids, mask, len(members), T, repeats=1)
    res["eager_floor_s"] = round(t_eager[0], 2)
    gc = model.generation_config
    gc.cache_implementation = "static"
    try:
        if dev != "cuda":
            from transformers import CompileConfig

            gc.compile_config = CompileConfig()
            gc.compile_config._compile_all_devices = ARGS.cpu_compile
        t, toks_s = time_gen(model, ids, mask, len(members), T, repeats=1)
        res["static_floor_first_s"] = round(t[0], 2)
        t, toks_s = time_gen(model, ids, mask, len(members), T, repeats=2)
        res["static_floor_s"] = [round(x, 2) for x in t]
        res["static_floor_vs_eager_floor_tokens"] = tokens_cmp(toks_s, eager_floor)
        log("static", **res)
        res["dynamo_after_floor"] = dynamo_stats()
        with pop_ctx(model, sel, spec, members, 8, "cur"):  # one install, as one ES chunk
            t, toks_h = time_gen(model, ids, mask, len(members), T, repeats=1)
            res["static_lowrank_first_s"] = round(t[0], 2)
            t, toks_h = time_gen(model, ids, mask, len(members), T, repeats=2)
        res["dynamo_after_lowrank"] = dynamo_stats()
        res["static_lowrank_s"] = [round(x, 2) for x in t]
        res["static_lowrank_over_static_floor"] = round(min(t) / min(res["static_floor_s"]), 3)
        res["static_lowrank_rows_equal_floor"] = int((toks_h == toks_s).all(1).sum())
        if "cur" in eager_store:
            k = eager_store["cur"].shape[1]
            res["static_vs_eager_lowrank_first_tokens"] = tokens_cmp(toks_h[:, :k], eager_store["cur"])
            res["static_vs_eager_floor_first_tokens"] = tokens_cmp(toks_s[:, :k], eager_store["floor"])
        log("static", **res)
        if left() > 60:  # a new chunk of members (next iteration): new factor tensors under the same graphs?
            members1 = population(0, 1, ARGS.members)
            with pop_ctx(model, sel, spec, members1, 8, "cur"):
                t, _ = time_gen(model, ids, mask, len(members1), T, repeats=1)
                res["static_lowrank_next_iteration_first_s"] = round(t[0], 2)
                t, _ = time_gen(model, ids, mask, len(members1), T, repeats=1)
                res["static_lowrank_next_iteration_second_s"] = round(t[0], 2)
            log("static", static_lowrank_next_iteration_first_s=res["static_lowrank_next_iteration_first_s"],
                static_lowrank_next_iteration_second_s=res["static_lowrank_next_iteration_second_s"],
                dynamo_after_next_iteration=dynamo_stats())
    finally:
        gc.cache_implementation = None
        gc.compile_config = None
    return res


def sec_static32(dev):
    from esrl.es import population

    model = build_model(TINY if ARGS.tiny else SMALL, dev, torch.float32, seed=7)
    ids, mask = make_prompts(2, 30, 45, model.config.vocab_size, dev, seed=3)
    members = population(0, 0, ARGS.members)
    sel, spec = lowrank_setup(model, 1e-2, 1)
    T = 32
    fac = lambda: pop_ctx(model, sel, spec, members, 2, "cur")  # noqa: E731
    _, eager = time_gen(model, ids, mask, len(members), T, fac, repeats=1)
    gc = model.generation_config
    gc.cache_implementation = "static"
    if dev != "cuda":
        from transformers import CompileConfig

        gc.compile_config = CompileConfig()
        gc.compile_config._compile_all_devices = ARGS.cpu_compile
    t, static = time_gen(model, ids, mask, len(members), T, fac, repeats=1)
    log("static32", first_s=round(t[0], 2), eager_vs_static_lowrank=tokens_cmp(eager, static))


# -- cross-process ------------------------------------------------------------------------------------------
def child(dev, model, what: str) -> dict:
    """One fresh process: fingerprints and tokens of the fit-like population generate for each variant."""
    from esrl.es import weights_checksum
    from esrl.es.lowrank import lowrank_factors

    out = {"weights": weights_checksum(list(model.parameters())).item()}
    if what == "timing":
        out["timing"] = sec_timing(dev, model, variants=("cur",))
        return out
    ids, mask, members, sel, spec, T = fit_like(dev, model)
    P = ids.shape[0]
    p = sel.params[5]
    out["factors"] = digest(torch.cat([t.reshape(-1) for t in lowrank_factors(members[0].seed, sel.indices[5], p.shape, 1,
                                                                             p.device)]))
    names, f, _ = traced(model, ids, mask, len(members))
    out["plain"] = {"names": names, "fp": f, "tokens": digest(generate(model, ids, mask, len(members), T))}
    variants = VARIANTS if what == "all" else ("cur",)
    for v in variants:
        names, f, _ = traced(model, ids, mask, len(members), ctx=pop_ctx(model, sel, spec, members, P, v))
        with pop_ctx(model, sel, spec, members, P, v):
            toks = generate(model, ids, mask, len(members), T)
        out[v] = {"names": names, "fp": f, "tokens": digest(toks)}
    return out


def run_children(specs: list[tuple[str, dict, str]], parallel: bool) -> dict:
    procs = {}
    for tag, env, what in specs:
        path = f"/tmp/probe_child_{tag}.json"
        cmd = [sys.executable, __file__, "--child", what, "--child-out", path, "--device", ARGS.device,
               "--members", str(ARGS.members), "--fit-tokens", str(ARGS.fit_tokens),
               "--timing-tokens", str(ARGS.timing_tokens), "--budget", "400"] + (["--tiny"] if ARGS.tiny else [])
        e = {**os.environ, **env}
        logf = open(f"/tmp/probe_child_{tag}.log", "w")
        procs[tag] = (subprocess.Popen(cmd, env=e, stdout=logf, stderr=subprocess.STDOUT, text=True), path)
        if not parallel:
            procs[tag][0].wait()
    results = {}
    for tag, (pr, path) in procs.items():
        pr.wait()
        txt = open(f"/tmp/probe_child_{tag}.log").read()
        if pr.returncode != 0:
            log("xproc", child=tag, failed=txt[-2000:])
            continue
        for line in txt.splitlines():
            if '"section": "timing"' in line:
                print(f"[{tag}] {line}", flush=True)
                if _LOG:
                    _LOG.write(f"[{tag}] {line}\n")
        results[tag] = json.load(open(path))
    return results


def compare_children(a: dict, b: dict, label: str) -> None:
    res = {"weights_equal": a["weights"] == b["weights"], "factors_equal": a.get("factors") == b.get("factors")}
    for k in ("plain",) + VARIANTS:
        if k in a and k in b:
            res[k] = {"tokens_equal": a[k]["tokens"] == b[k]["tokens"],
                      "fp_first_diff": first_diff(a[k]["names"], a[k]["fp"], b[k]["fp"])}
    log("xproc", pair=label, **res)


def main() -> None:
    global ARGS, _LOG
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/probe_out"))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--budget", type=float, default=480)
    ap.add_argument("--members", type=int, default=30)
    ap.add_argument("--fit-tokens", type=int, default=128)
    ap.add_argument("--timing-tokens", type=int, default=64)
    ap.add_argument("--static-tokens", type=int, default=256)
    ap.add_argument("--micro-reps", type=int, default=20)
    ap.add_argument("--sections", default="env,inproc,micro,warn,full,xproc,timing,det,static,static32")
    ap.add_argument("--cpu-compile", action="store_true", help="cpu smoke test: let generate compile on cpu too")
    ap.add_argument("--child", default=None)
    ap.add_argument("--child-out", default=None)
    ARGS = ap.parse_args()
    dev = ARGS.device
    if os.environ.get("PROBE_DETERMINISTIC"):
        torch.use_deterministic_algorithms(True)
        if os.environ["PROBE_DETERMINISTIC"] == "nofill":
            from torch.utils import deterministic as _det

            _det.fill_uninitialized_memory = False
    cfg = TINY if ARGS.tiny else QWEN25_15B
    dtype = torch.float32 if dev == "cpu" else torch.bfloat16
    if ARGS.child:
        model = build_model(cfg, dev, dtype)
        out = child(dev, model, ARGS.child)
        json.dump(out, open(ARGS.child_out, "w"))
        return
    os.makedirs(ARGS.out, exist_ok=True)
    _LOG = open(os.path.join(ARGS.out, "probe.jsonl"), "w")
    sections = ARGS.sections.split(",")
    if "env" in sections:
        sec_env(dev)
    t = time.perf_counter()
    model = build_model(cfg, dev, dtype)
    sync()
    log("setup", build_s=round(time.perf_counter() - t, 1), params=sum(p.numel() for p in model.parameters()),
        attn=model.config._attn_implementation)
    eager_store: dict = {}

    def guard(name, fn, need):
        if name not in sections:
            return
        if left() < need:
            log(name, skipped=f"{left():.0f}s left < {need}s")
            return
        t = time.perf_counter()
        try:
            fn()
        except Exception as e:  # noqa: BLE001
            import traceback

            log(name, error=repr(e), tb=traceback.format_exc()[-3000:])
        log(name, section_s=round(time.perf_counter() - t, 1))

    def xproc():
        if dev == "cuda":
            torch.cuda.empty_cache()
        r = run_children([("a", {}, "all"), ("b", {}, "all"),
                          ("ws1", {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}, "cur"),
                          ("ws2", {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}, "cur")], parallel=True)
        if "a" in r and "b" in r:
            compare_children(r["a"], r["b"], "default a vs b")
        if "ws1" in r and "ws2" in r:
            compare_children(r["ws1"], r["ws2"], "CUBLAS_WORKSPACE_CONFIG=:4096:8 ws1 vs ws2")
        if "a" in r and "ws1" in r:
            compare_children(r["a"], r["ws1"], "default a vs ws1")

    def det():
        ws = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
        r = run_children([("det", {**ws, "PROBE_DETERMINISTIC": "1"}, "timing"),
                          ("det_nofill", {**ws, "PROBE_DETERMINISTIC": "nofill"}, "timing")], parallel=False)
        for tag, v in r.items():
            log("det", child=tag, timing=v.get("timing"))

    guard("inproc", lambda: sec_inproc(dev, model), 40)
    guard("micro", lambda: sec_micro(dev, model), 20)
    guard("warn", lambda: sec_warn(dev, model), 15)
    guard("full", lambda: sec_full(dev, model), 20)
    guard("xproc", xproc, 60)
    guard("timing", lambda: sec_timing(dev, model, store=eager_store), 40)
    guard("det", det, 70)
    guard("static", lambda: sec_static(dev, model, eager_store), 150)
    guard("static32", lambda: sec_static32(dev), 80)
    log("done", total_s=round(time.perf_counter() - T0, 1))


if __name__ == "__main__":
    main()
