"""Memory and time over a long run: the process's RSS (and CUDA's allocated memory on a GPU) after every training
step of ES (each noise mode) and GRPO, and each step's seconds, so a leak or work that grows with the history shows
as growth with the step count. A paper run is 500-1,000 iterations; the figures that matter are the growth from step
10 (everything built, caches warm) to the last step, and the median step time of steps 11-30 against the last 20.

Real parts: Lightning's Trainer, esrl's modules and engines, the conciseness task; a tiny random Llama by default
(the embedded SmolLM2 or any model path with --model). Prints one JSON line per run.

    .venv/bin/python benchmarks/memory_over_steps.py                              # ES full, lowrank, lora; GRPO
    .venv/bin/python benchmarks/memory_over_steps.py --runs es:lowrank --steps 1000 --device cuda --model PATH
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import tempfile
import time
from pathlib import Path

import lightning as L
import psutil
import torch

FIXTURES = Path(__file__).resolve().parents[1] / "tests" / "fixtures"


class StepMemory(L.Callback):
    """RSS and CUDA allocated memory (MiB) after each training step, after a garbage collection; its seconds."""

    def __init__(self):
        self.rss: list[float] = []
        self.cuda: list[float] = []
        self.seconds: list[float] = []

    def on_train_batch_start(self, trainer, *args) -> None:
        self.start = time.perf_counter()

    def on_train_batch_end(self, trainer, *args) -> None:
        self.seconds.append(time.perf_counter() - self.start)
        gc.collect()
        self.rss.append(psutil.Process().memory_info().rss / 2**20)
        if torch.cuda.is_available():
            self.cuda.append(torch.cuda.memory_allocated() / 2**20)


def build_module(algo: str, mode: str, model: str):
    from esrl.policy import PolicyConfig
    from esrl.rollout import RolloutConfig

    if algo == "es":
        from esrl.es.config import ESConfig
        from esrl.es.module import ESModule

        return ESModule(PolicyConfig(name_or_path=model), RolloutConfig(max_new_tokens=16, max_batch_size=16),
                        ESConfig(population_size=8, sigma=0.01, alpha=0.01, seed=3, mode=mode))
    from esrl.grpo.config import GRPOConfig
    from esrl.grpo.module import GRPOModule

    return GRPOModule(PolicyConfig(name_or_path=model), RolloutConfig(max_new_tokens=16, temperature=1.0),
                      GRPOConfig(num_generations=4, seed=1))


def run(algo: str, mode: str, model: str, steps: int, device: str, root: Path) -> dict:
    from esrl.callbacks import Evaluation
    from esrl.data import PromptDataModule

    data = PromptDataModule("conciseness", {"train_path": str(FIXTURES / "conciseness_train3.jsonl"),
                                            "eval_path": str(FIXTURES / "conciseness_eval2.jsonl")},
                            prompts_per_step=1)
    memory = StepMemory()
    trainer = L.Trainer(accelerator=device, devices=1, max_steps=steps, enable_progress_bar=False, logger=False,
                        enable_model_summary=False, enable_checkpointing=False, default_root_dir=root,
                        limit_val_batches=0, callbacks=[Evaluation(before=False, after=False), memory])
    trainer.fit(build_module(algo, mode, model), datamodule=data)
    n, first = len(memory.rss), min(10, len(memory.rss))
    at = sorted({first, max(first, n // 4), max(first, n // 2), n})
    out = {"benchmark": "memory_over_steps", "algo": algo, "mode": mode if algo == "es" else None, "steps": n,
           "rss_mb": {k: round(memory.rss[k - 1], 1) for k in at},
           "rss_growth_mb": round(memory.rss[-1] - memory.rss[first - 1], 1),
           "step_s_early": round(statistics.median(memory.seconds[10:30] or memory.seconds), 4),
           "step_s_late": round(statistics.median(memory.seconds[-20:]), 4)}
    if memory.cuda:
        out.update(cuda_mb={k: round(memory.cuda[k - 1], 1) for k in at},
                   cuda_growth_mb=round(memory.cuda[-1] - memory.cuda[first - 1], 1))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", default="es:full,es:lowrank,es:lora,grpo",
                        help="comma-separated algo[:mode] runs, each in this process, one after another")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--model", default=None, help="an esrl model id or path (default: a tiny random Llama)")
    parser.add_argument("--tokenizer", default="smollm2-135m-instruct", help="the tiny Llama's tokenizer (id or folder)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            from esrl.models import tiny_llama

            model = tiny_llama(Path(tmp) / "llama", tokenizer_from=args.tokenizer)
        machine = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                   "torch": torch.__version__, "model": args.model or "tiny random Llama"}
        for spec in args.runs.split(","):
            algo, _, mode = spec.partition(":")
            result = run(algo, mode or "full", model, args.steps, args.device, Path(tmp) / spec.replace(":", "_"))
            print(json.dumps({**result, **machine}), flush=True)


if __name__ == "__main__":
    main()
