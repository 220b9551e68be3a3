"""ES iteration throughput and memory: full vs lowrank and lora (population-batched) vs the plain-generate floor.

Setup: the embedded SmolLM2-135M-Instruct (fp32), N=30 members, the 2 conciseness training prompts, 100 new
tokens, greedy, EOS ignored (min_new_tokens = max_new_tokens), so every mode generates N x P x 100 tokens.

Each mode runs in its own fresh process (so the peak-RSS figures do not mix):
- floor:   one plain batched generate of the same N x P = 60 sequences with the base weights.
- lowrank: one whole ES iteration (rank 1): factors, ONE batched generate of 60 rows with per-row low-rank
           terms, rewards, the fp32 low-rank update and the SGD step.
- lora:    one whole ES iteration over a PEFT LoRA adapter (rank 8 on the 7 projections of every layer): the
           adapter's perturbed factors stacked per member, ONE batched generate of 60 rows with per-row adapter
           factors, rewards, the fp32 full-noise update in adapter space and the SGD step.
- full:    the paper's mode, member by member (perturb 135M weights, generate 2 rows, restore). Too slow to run
           all 30 members on a laptop CPU: `--full-members K` members are timed and the per-member mean is
           extrapolated to N (said so in the output); the update (30 full-size noise regenerations) is run for real.

A mode name ending in a variant builds that mode's static population with one StaticPopulation switch changed, to
price it side by side: `-apart` (lowrank-apart, lora-apart) an MLP's gate and up terms in launches of their own
(gate_up_first off), `-inside` the MLPs' terms inside their GEMMs (terms_inside on; esrl.es.inside_terms),
`-overlap` a decode step's terms on a side stream beside the GEMMs (overlap on; esrl.es.side_terms).

Side by side (`--rounds R`): all --modes in ONE process instead, each on its own model copy, one unit of each per
round in a rotated order, R rounds; prints each mode's times, and its time over the first mode's (median of the
per-round ratios, and best over best). On a shared machine whose speed drifts by 10-50% between minutes (this
project's 2-core VM), only these ratios are comparable to a 1.10x target; the per-process runs give memory.

    .venv/bin/python benchmarks/es_throughput.py --modes floor,lowrank,lora --rounds 3

Memory: `peak_rss_mb` is the process's RSS high-water mark (resource.getrusage, includes the model);
`peak_delta_mb` is the highest RSS sampled every 2 ms by a thread during the timed phase minus the RSS
just before it (psutil).

    .venv/bin/python benchmarks/es_throughput.py [--members 30] [--new-tokens 100] [--repeats 2] [--modes ...]

GPU run (issue #4): Qwen2.5-1.5B's architecture with random weights (built from its config, nothing downloaded),
bf16, N=30, 8 prompts, 256 tokens, EOS ignored; memory is then the CUDA allocator's peak instead of RSS:

    python benchmarks/es_throughput.py --model random:qwen2.5-1.5b --device cuda --prompts 8 --new-tokens 256

Prints one line per mode, then one JSON line with the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from unittest import mock

import torch
from bench_setup import PeakRSS, bench_rows, build_model, cpu_model, peak_memory_mb, timed_generate


VARIANTS = {"-apart": ("gate_up_first", False), "-inside": ("terms_inside", True), "-overlap": ("overlap", True)}
"""Mode-name suffixes: the StaticPopulation switch each sets while the mode's population is built."""


def prepare(mode: str, args) -> tuple[object, callable]:
    """(engine, unit) for one mode on its own model copy: `unit()` runs one timed unit and returns (seconds,
    tokens, extra fields). floor/single: a plain batched generate of N x P (single: P) rows; lowrank/lora: one whole
    population-batched iteration as ESModule runs it on the HF engine (its InPlaceES backend: per-chunk hooks
    eager, the mode's StaticPopulation compiled): ONE generate, rewards, the update; full: `--full-members`
    members one by one (perturb, generate, restore), the per-member mean extrapolated to N, plus the real update."""
    from esrl.es import NoiseSpec, Perturber, es_step, get_mode, lowrank_selection, population, select_params, \
        shape_fitness
    from esrl.es.engines import InPlaceES
    from esrl.es.noise import drawn_once
    from esrl.es.static_population import StaticPopulation
    from esrl.models import load_tokenizer
    from esrl.rollout import HFEngine
    from esrl.tasks import build_task

    variant = next(((suffix, switch) for suffix, switch in VARIANTS.items() if mode.endswith(suffix)), None)
    mode = mode.removesuffix(variant[0]) if variant else mode
    model = build_model(args.model, args.device, args.dtype)
    tok = load_tokenizer(args.tokenizer)
    task = build_task("conciseness")
    rows = bench_rows(task, args.prompts)
    prompts = task.prompts(rows)
    n, p, t = args.members, len(prompts), args.new_tokens
    engine = HFEngine(model, tok, max_batch_size=n * p, compile=args.compile)
    gen = dict(max_new_tokens=t, min_new_tokens=t)
    members = population(0, 0, n)
    if not engine.compiled:
        engine.generate(prompts, max_new_tokens=2, greedy=True)  # warm-up (first-call allocations)

    def rewards_of(completions_per_member):
        return [sum(task.rewards(rows, [c.text for c in cs])) / p for cs in completions_per_member]

    def plain(rows_prompts):
        return lambda: (*timed_generate(engine, rows_prompts, gen), {})

    def iteration(sel, spec, noise_mode, extra: dict):
        opt = torch.optim.SGD(sel.params, lr=1e-3)
        backend = InPlaceES(engine, model, sel, spec, noise_mode)
        if variant:  # the static population built now, with the variant's switch (a later unit reloads its members)
            with mock.patch.object(StaticPopulation, *variant[1]):
                backend.row_weights(members)
            static = backend.static  # a switch that does not apply here (no CUDA, eager lowrank) would time the base
            applied = static is not None and {"-overlap": lambda: static._side is not None,
                                              "-inside": lambda: bool(static._inside),
                                              "-apart": lambda: bool(static.runs)}[variant[0]]()
            if not applied:
                raise RuntimeError(f"{mode}{variant[0]}: the variant does not apply on this device and compile "
                                   f"setting; it would time plain {mode}")

        def unit():
            start = time.perf_counter()
            with drawn_once():  # as ESModule: the update reuses the load's draws
                out = engine.generate_population(prompts, n, backend.row_weights(members), **gen)
                t_gen = time.perf_counter()
                es_step(opt, sel, members, shape_fitness(torch.tensor(rewards_of(out))), spec)
            end = time.perf_counter()
            return end - start, sum(len(c.token_ids) for cs in out for c in cs), {
                "generate_s": round(t_gen - start, 2), "update_s": round(end - t_gen, 2), **extra}
        return unit

    if mode == "floor":
        return engine, plain(prompts * n)
    if mode == "single":  # one member's rows alone: what a member of full mode costs at best
        return engine, plain(prompts)
    if mode == "lowrank":
        spec = NoiseSpec(mode="lowrank", sigma=0.01, rank=args.rank)
        sel = lowrank_selection(model, select_params(model), spec)
        for q in model.parameters():
            q.requires_grad_(False)
        for q in sel.params:
            q.requires_grad_(True)
        return engine, iteration(sel, spec, get_mode("lowrank"), {"rank": args.rank, "perturbed_matrices": len(sel)})
    if mode == "lora":
        from esrl.es.config import ESConfig
        from esrl.es.setup import build_policy, build_selection

        cfg = ESConfig(mode="lora", sigma=0.01, lora_rank=args.lora_rank, lora_alpha=2 * args.lora_rank)
        peft_model = build_policy(model, cfg, 0)  # injected into `model` in place: the engine generates with it
        sel, spec = build_selection(peft_model, cfg)
        return engine, iteration(sel, spec, get_mode("lora"), {"lora_rank": args.lora_rank, "adapter_tensors": len(sel),
                                                               "adapter_params": sel.numel()})
    if mode == "full":
        sel = select_params(model)
        perturber = Perturber(sel)
        k = min(args.full_members, n)
        if engine.compiled:  # the compile is not a member's cost
            engine.generate(prompts, greedy=True, **gen)
        with perturber.perturbed(members[0], 0.01):  # nor the noise kernel's one compile (Triton, on a GPU)
            pass

        def unit():
            fitness = []
            start = time.perf_counter()
            for m in members[:k]:
                with perturber.perturbed(m, 0.01):
                    cs = engine.generate(prompts, greedy=True, **gen)
                fitness.append(rewards_of([cs])[0])
            per_member = (time.perf_counter() - start) / k
            perturber.free()
            for q in model.parameters():
                q.requires_grad_(True)
            fitness += fitness[:1] * (n - k)  # stand-in rewards for the members not run (timing only)
            fitness[-1] += 1.0
            t_up = time.perf_counter()
            es_step(torch.optim.SGD(sel.params, lr=1e-3), sel, members, shape_fitness(torch.tensor(fitness)))
            update = time.perf_counter() - t_up
            return per_member * n + update, n * p * t, {
                "per_member_s": round(per_member, 2), "update_s": round(update, 2), "members_timed": k,
                "extrapolated": f"{k} of {n} members timed, per-member mean x {n} + the real update"}
        return engine, unit
    raise ValueError(mode)


def worker(mode: str, args) -> dict:
    """One mode alone in this process (its peak memory is its own): best of `--repeats` units."""
    engine, unit = prepare(mode, args)
    times, splits, tokens = [], [], 0
    with PeakRSS() as mem:
        for _ in range(args.repeats if mode != "full" else 1):
            seconds, tokens, split = unit()
            times.append(seconds)
            splits.append(split)
    best = min(times)
    result = {"mode": mode, "compile": args.compile, **splits[times.index(best)]}  # the best unit's own split
    compiles = engine.compile_times()
    if compiles:
        result["compile_first_call_s"] = [round(sec, 1) for _, sec in compiles]
    result.update(seconds=round(best, 2), all_seconds=[round(x, 2) for x in times], tokens=tokens,
                  tokens_per_s=round(tokens / best, 1),
                  peak_rss_mb=round(peak_memory_mb(args.device), 1),
                  peak_delta_mb=round(mem.delta_mb, 1))
    return result


def side_by_side(modes: list[str], args) -> dict:
    """All modes in ONE process, each on its own model copy, their units interleaved for `--rounds` rounds (the
    order rotated each round): a slow spell of a shared machine hits every mode alike. Per mode the best unit;
    per round each mode's time over the first mode's, and the median of those ratios. A mode other than the first
    that fails (a variant new on this device) is reported and dropped, and the summary so far is printed after
    each round, so a failure or a time limit leaves the others' ratios (a GPU call's minutes are few)."""
    import traceback

    prepared: dict[str, tuple] = {}

    def attempt(mode: str, call) -> None:
        if mode == modes[0]:  # the baseline: without it there is no ratio
            return call()
        try:
            call()
        except Exception as e:  # noqa: BLE001 - reported, the mode dropped, the others go on
            traceback.print_exc()
            print("PARTIAL " + json.dumps({"mode": mode, "failed": f"{type(e).__name__}: {e}"[:400]}), flush=True)
            prepared.pop(mode, None)

    for m in modes:
        attempt(m, lambda: prepared.__setitem__(m, prepare(m, args)))
    for m, (engine, unit) in list(prepared.items()):
        if engine.compiled:  # compiles and recordings happen here, not in round 1
            attempt(m, unit)
    times: dict[str, list[float]] = {m: [] for m in prepared}
    order = list(times)
    for r in range(args.rounds):
        for m in order[r % len(order):] + order[:r % len(order)]:
            if m in prepared:
                attempt(m, lambda: times[m].append(prepared[m][1]()[0]))
        if r < args.rounds - 1:
            print("PARTIAL " + json.dumps({**_ratios(times, args), "partial": True}), flush=True)
    return _ratios(times, args)


def _ratios(times: dict[str, list[float]], args) -> dict:
    """The side-by-side summary of the rounds so far: each mode's times, and its median and best ratio to the first
    mode's (over the rounds it ran in)."""
    import statistics

    base, *others = list(times)
    return {"benchmark": "es_throughput_side_by_side", "compile": args.compile, "rounds": len(times[base]),
            **{f"{m}_s": [round(x, 2) for x in t] for m, t in times.items()},
            **{f"{m}_over_{base}_median": round(statistics.median(a / b for a, b in zip(times[m], times[base])), 3)
               for m in others if times[m]},
            **{f"{m}_over_{base}_best": round(min(times[m]) / min(times[base]), 3) for m in others if times[m]}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--members", type=int, default=30)
    ap.add_argument("--new-tokens", type=int, default=100)
    ap.add_argument("--rank", type=int, default=1)
    ap.add_argument("--prompts", type=int, default=2, help="prompts per member (the 2 conciseness training "
                    "prompts, then its eval prompts)")
    ap.add_argument("--model", default="smollm2-135m-instruct",
                    help="an esrl model id or path, or random:qwen2.5-1.5b (that architecture, random weights)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--compile", default="auto",
                    help="the HF engine's rollout.compile: off, auto, on or fused, or several (off,auto): each mode "
                         "runs under each, interleaved, with a ratio line; the first call compiles, the "
                         "best of --repeats is reported")
    ap.add_argument("--tokenizer", default="smollm2-135m-instruct", help="tokenizer id or folder")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    ap.add_argument("--lora-rank", type=int, default=8, help="lora: adapter rank (lora_alpha = 2 x rank)")
    ap.add_argument("--repeats", type=int, default=2, help="timed repeats of floor, lowrank and lora (best is kept)")
    ap.add_argument("--full-members", type=int, default=3, help="full mode: members actually timed")
    ap.add_argument("--modes", default="floor,lowrank,lora,full")
    ap.add_argument("--engines", default="hf", help="hf, vllm or hf,vllm (the rows of es_throughput_vllm.py)")
    import es_throughput_vllm  # the vLLM rows: same setup, their own options (--vllm-modes, --kv-cache-mb, ...)

    es_throughput_vllm.add_arguments(ap, shared=False)
    ap.add_argument("--rounds", type=int, default=0,
                    help="> 0: instead of one process per mode, all --modes in ONE process (each on its own model "
                         "copy), their units interleaved for this many rounds: the ratios to use on a shared, noisy "
                         "machine (no memory figures)")
    ap.add_argument("--attention", choices=["repeatable", "any"], default="repeatable",
                    help="any: let PyTorch pick any SDPA kernel in rollouts, cuDNN's included (not bitwise "
                         "repeatable on a GPU): the cost of esrl's determinism is the time over this")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    if args.worker:
        if args.attention == "any":
            from torch.nn.attention import SDPBackend

            from esrl.rollout import hf
            hf.ROLLOUT_ATTENTION[:] = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION,
                                       SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
        result = (side_by_side(args.modes.split(","), args) if args.worker == "side-by-side"
                  else worker(args.worker, args))
        print("RESULT " + json.dumps(result), flush=True)
        return
    machine = {"nproc": os.cpu_count(), "cpu": cpu_model(), "torch": torch.__version__,
               "torch_threads": torch.get_num_threads(), "python": platform.python_version(),
               "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
               "model": args.model, "dtype": args.dtype, "attention": args.attention}
    print(json.dumps({"machine": machine}))
    passthrough = [f"--members={args.members}", f"--new-tokens={args.new_tokens}", f"--rank={args.rank}",
                   f"--lora-rank={args.lora_rank}", f"--repeats={args.repeats}", f"--full-members={args.full_members}",
                   f"--prompts={args.prompts}", f"--model={args.model}", f"--device={args.device}",
                   f"--dtype={args.dtype}", f"--tokenizer={args.tokenizer}", f"--attention={args.attention}"]
    compiles = args.compile.split(",")
    if not set(compiles) <= {"off", "auto", "on", "fused"}:
        ap.error(f"--compile: off, auto, on or fused (comma-separated), got {args.compile!r}")
    if args.rounds > 0:
        for c in compiles:
            print(json.dumps(run_worker("side-by-side", c, [*passthrough, f"--modes={args.modes}",
                                                               f"--rounds={args.rounds}"])), flush=True)
        return
    by_compile: dict[str, dict] = {c: {} for c in compiles}
    for mode in args.modes.split(",") if "hf" in args.engines.split(",") else []:
        for c in compiles:  # interleaved, so a noisy spell of the machine hits the compile values alike
            by_compile[c][mode] = run_worker(mode, c, passthrough)
            print(json.dumps(by_compile[c][mode]), flush=True)
    for c in compiles:
        print(json.dumps(summarize(by_compile[c], args, c, machine)))
    if len(compiles) > 1:  # each mode's time under every compile value over its time under the first
        first = by_compile[compiles[0]]
        print(json.dumps({"benchmark": "es_throughput_compile", "baseline": compiles[0],
                          **{f"{m}_{c}_over_{compiles[0]}": round(by_compile[c][m]["seconds"] / r["seconds"], 3)
                             for c in compiles[1:] for m, r in first.items() if m in by_compile[c]}}))
    results = by_compile[compiles[0]]
    if "vllm" in args.engines.split(","):
        vllm = es_throughput_vllm.run(args)
        both = es_throughput_vllm.summary(vllm, args)
        both.update({f"vllm_over_hf_{m}_time": round(vllm[m]["seconds"] / results[m]["seconds"], 3)
                     for m in vllm if m in results})
        print(json.dumps(both))


def run_worker(mode: str, compile: str, passthrough: list[str]) -> dict:
    """One worker process (a mode, or side-by-side) and its RESULT line; its PARTIAL lines are printed as they come
    (a side-by-side's summary after each round, a dropped mode), so a time limit on this process still leaves them."""
    import tempfile

    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen([sys.executable, __file__, "--worker", mode, f"--compile={compile}", *passthrough],
                                stdout=subprocess.PIPE, stderr=err, text=True,
                                env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
        line = None
        for out in proc.stdout:
            if out.startswith("PARTIAL "):
                print(out[len("PARTIAL "):].strip(), flush=True)
            elif out.startswith("RESULT "):
                line = out
        proc.wait()
        err.seek(0)
        stderr = err.read()
    if proc.returncode != 0 or line is None:
        sys.exit(f"{mode} (compile {compile}) failed (exit {proc.returncode}):\n{stderr[-3000:]}")
    return json.loads(line[len("RESULT "):])


def summarize(results: dict, args, compile: str, machine: dict) -> dict:
    """The ratio line of one compile value's modes."""
    summary = {"benchmark": "es_throughput", "members": args.members, "prompts": args.prompts,
               "new_tokens": args.new_tokens, "compile": compile, **machine}
    if "floor" in results and "lowrank" in results:
        summary["lowrank_over_floor_time"] = round(results["lowrank"]["seconds"] / results["floor"]["seconds"], 3)
        summary["lowrank_over_floor_peak_rss"] = round(
            results["lowrank"]["peak_rss_mb"] / results["floor"]["peak_rss_mb"], 3)
    if "floor" in results and "lora" in results:
        summary["lora_over_floor_time"] = round(results["lora"]["seconds"] / results["floor"]["seconds"], 3)
        summary["lora_over_floor_peak_rss"] = round(results["lora"]["peak_rss_mb"] / results["floor"]["peak_rss_mb"], 3)
    if "lowrank" in results and "lora" in results:
        summary["lora_over_lowrank_time"] = round(results["lora"]["seconds"] / results["lowrank"]["seconds"], 3)
    if "full" in results and "single" in results:
        summary["full_member_over_single_generate"] = round(
            results["full"]["per_member_s"] / results["single"]["seconds"], 3)
    if "full" in results and "lowrank" in results:
        summary["full_over_lowrank_speedup"] = round(results["full"]["seconds"] / results["lowrank"]["seconds"], 2)
        summary["full_extrapolated"] = True
    summary.update({f"{m}_s": r["seconds"] for m, r in results.items()})
    summary.update({f"{m}_peak_rss_mb": r["peak_rss_mb"] for m, r in results.items()})
    return summary


if __name__ == "__main__":
    main()
