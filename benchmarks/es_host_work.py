"""The ES iteration's work around its generate: a chunk's load (members' factors or adapters into the population's
buffers) and the update, for lowrank and lora, with and without `drawn_once` (the update reusing the
load's draws).

On a GPU decoding through recorded CUDA graphs, these phases are host-bound: each op is a launch (~5-20 us of
Python and driver), each seeded draw one more, and each host-to-device copy of Python numbers waits for the whole
queue. So besides the seconds (median of `--rounds` rotated rounds, both variants in one process) it prints
counts that do not depend on the machine's speed, from one pass under a TorchDispatchMode: aten ops (~ kernel
launches on a GPU), seeded normal draws, and tensors made from host numbers (on a GPU: copies that sync).

    .venv/bin/python benchmarks/es_host_work.py [--modes lowrank,lora] [--members 30] [--rounds 5]
    .venv/bin/python benchmarks/es_host_work.py --gpu-draws --dtype bfloat16 --rounds 1   # the GPU path's op counts
    python benchmarks/es_host_work.py --model random:qwen2.5-1.5b --device cuda      # the GPU run (issue 15)

Prints one JSON line per mode and variant, then one with the medians' ratios.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).parent))
from bench_setup import build_model  # noqa: E402  (the same models as the throughput rows)


class OpCounts(TorchDispatchMode):
    """Counts aten ops, seeded normal draws and tensors built from host numbers (lift_fresh, or a copy whose
    source is on the CPU while the destination is not)."""

    def __init__(self):
        super().__init__()
        self.ops = self.draws = self.from_host = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.ops += 1
        name = func.overloadpacket.__name__
        self.draws += name in ("randn", "normal_", "normal")
        if name == "lift_fresh" and out.device.type == "cpu":
            self.from_host += 1
        elif name in ("_to_copy", "copy_") and out.device.type != "cpu":
            self.from_host += any(isinstance(a, torch.Tensor) and a.device.type == "cpu" for a in args)
        return out


def prepare(mode: str, args):
    """(one unit(reuse) -> (load_s, update_s)) for a mode: the population's buffers made once, as in a run."""
    from esrl.es import NoiseSpec, get_mode, lowrank_selection, population, select_params
    from esrl.es.noise import drawn_once
    from esrl.es.update import es_step

    model = build_model(args.model, args.device, args.dtype)
    if mode == "lowrank":
        spec = NoiseSpec(mode="lowrank", sigma=0.01, rank=args.rank)
        sel = lowrank_selection(model, select_params(model), spec)
    else:
        from esrl.es.config import ESConfig
        from esrl.es.setup import build_policy, build_selection

        cfg = ESConfig(mode="lora", sigma=0.01, lora_rank=args.lora_rank, lora_alpha=2 * args.lora_rank)
        model = build_policy(model, cfg, 0)
        sel, spec = build_selection(model, cfg)
    static = get_mode(mode).static_population(model, sel, spec)
    members = population(0, 0, args.members, args.antithetic)
    static.load(members)  # a new size allocates its buffers once per run
    weights = torch.linspace(-1, 1, args.members)
    opt = torch.optim.SGD(sel.params, lr=0.0)  # the whole es_step (grads, checks, step), weights kept as they are
    calls = [0]
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)

    def unit(reuse: bool) -> tuple[float, float]:
        sync()
        with drawn_once() if reuse else nullcontext():
            start = time.perf_counter()
            static.load(members)
            sync()
            loaded = time.perf_counter()
            calls[0] += 1  # fitness differs per iteration (host numbers reach the device anew)
            es_step(opt, sel, members, weights * (1 + calls[0] / 1000), spec)
            sync()
            return loaded - start, time.perf_counter() - loaded

    return unit, len(sel)


def count_gpu_draws_on_cpu() -> None:
    """--gpu-draws: take esrl's GPU draw path on the CPU, with esrl.es.philox's one Triton launch per draw replaced by
    one torch draw of the same layout (Triton's interpreter takes minutes per iteration), and the GPU's multi-tensor
    finite check (esrl.finite) and groups (esrl.es.noise.GROUP_NUMBERS). For the op counts only: the numbers drawn
    and the seconds are not the GPU's."""
    from esrl import finite
    from esrl.es import noise, philox

    def normal_slabs(keys, parts, device, offsets=(0,)):
        rows, groups, (_, n0) = len(keys), len(offsets), parts[0]
        out = torch.empty(rows * groups * sum(n for _, n in parts), dtype=torch.float32, device=device).normal_()
        first = rows * groups * n0
        return [out[:first].view(rows, groups * n0)] + ([out[first:].view(rows, -1)] if len(parts) == 2 else [])

    philox.available = lambda device: True
    finite.batched_on = lambda device: True
    philox.normal_slabs = normal_slabs
    noise.GROUP_NUMBERS["cpu"] = noise.GROUP_NUMBERS["cuda"]  # the GPU's parts of same-shape groups


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct", help="esrl model id or path, or random:qwen2.5-1.5b")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    ap.add_argument("--members", type=int, default=30)
    ap.add_argument("--antithetic", action="store_true", help="members in antithetic pairs (shared draws)")
    ap.add_argument("--rank", type=int, default=1, help="lowrank: noise rank")
    ap.add_argument("--lora-rank", type=int, default=8, help="lora: adapter rank (lora_alpha = 2 x rank)")
    ap.add_argument("--modes", default="lowrank,lora")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--gpu-draws", action="store_true", help="count the GPU draw path's ops on a CPU (see above)")
    args = ap.parse_args()
    if args.gpu_draws:
        count_gpu_draws_on_cpu()
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    machine = torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor() or "cpu"
    summary = {"benchmark": "es_host_work", "device": machine, "model": args.model, "members": args.members,
               "antithetic": args.antithetic, "gpu_draws": args.gpu_draws, "torch": torch.__version__}
    for mode in args.modes.split(","):
        unit, tensors = prepare(mode, args)
        counts = {}
        for reuse in (False, True):
            with OpCounts() as counts[reuse]:
                unit(reuse)
        times = {False: [], True: []}
        for r in range(args.rounds):
            for reuse in ((False, True) if r % 2 == 0 else (True, False)):
                times[reuse].append(unit(reuse))
        for reuse in (False, True):
            load = statistics.median(t[0] for t in times[reuse])
            update = statistics.median(t[1] for t in times[reuse])
            c = counts[reuse]
            print(json.dumps({"mode": mode, "drawn_once": reuse, "tensors": tensors, "load_s": round(load, 4),
                              "update_s": round(update, 4), "ops": c.ops, "draws": c.draws,
                              "from_host": c.from_host, **summary}), flush=True)
            summary[f"{mode}_{'reuse' if reuse else 'plain'}_s"] = round(load + update, 4)
        summary[f"{mode}_reuse_over_plain"] = round(summary[f"{mode}_reuse_s"] / summary[f"{mode}_plain_s"], 3)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
