"""A prefill's lm_head when the model is frozen: the prompts' last positions by slice (transformers' int
`logits_to_keep`) or by index (what esrl's static decoder passes).

ES freezes every weight it does not perturb, so lm_head's weight needs no grad. torch.matmul folds a 3-D input into
one GEMM only when its leading dims can be merged by a view, or when something needs grad; the slice
`hidden[:, -1:, :]` of a (rows, prompt, hidden) tensor cannot be merged by its strides, so the frozen head ran as a
batched product over a per-row expansion of its weight. An index gathers a contiguous (rows, 1, hidden) first.
Both give the same logits; this prints the seconds of one prefill forward (median of `--rounds` rotated rounds,
all variants in one process) and whether the logits are equal bit for bit.

    .venv/bin/python benchmarks/prefill_head.py [--rows 60] [--rounds 5]
    python benchmarks/prefill_head.py --model random:qwen2.5-1.5b --device cuda --rows 240 --tokenizer .gpu/tok
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_setup import bench_rows, build_model  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct", help="esrl model id or path, or random:qwen2.5-1.5b")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    ap.add_argument("--rows", type=int, default=60, help="prefill rows (ES: members x prompts; the CPU bench 30 x 2)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokenizer", default="smollm2-135m-instruct", help="tokenizer id or folder")
    args = ap.parse_args()
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")

    from esrl.models import load_tokenizer
    from esrl.rollout.text import encode_prompts, left_padded
    from esrl.tasks import build_task

    model = build_model(args.model, args.device, args.dtype)
    tok = load_tokenizer(args.tokenizer)
    task = build_task("conciseness")
    enc = left_padded(tok, encode_prompts(tok, task.prompts(bench_rows(task, args.rows)))).to(args.device)
    last = torch.tensor([enc["input_ids"].shape[1] - 1], device=args.device)
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    variants = {"frozen_slice": (False, 1), "frozen_index": (False, last), "trainable_slice": (True, 1)}
    logits, times = {}, {name: [] for name in variants}

    @torch.inference_mode()
    def run(name: str) -> float:
        grad, keep = variants[name]
        model.requires_grad_(grad)
        sync()
        start = time.perf_counter()
        logits[name] = model(**enc, use_cache=False, logits_to_keep=keep).logits
        sync()
        return time.perf_counter() - start

    names = list(variants)
    for name in names:
        run(name)  # warm-up
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            times[name].append(run(name))
    medians = {name: statistics.median(t) for name, t in times.items()}
    machine = torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor() or "cpu"
    print(json.dumps({"benchmark": "prefill_head", "device": machine, "model": args.model, "dtype": args.dtype,
                      "rows": args.rows, "prompt_tokens": enc["input_ids"].shape[1], "torch": torch.__version__,
                      **{f"{name}_s": round(s, 4) for name, s in medians.items()},
                      "frozen_slice_over_index": round(medians["frozen_slice"] / medians["frozen_index"], 2),
                      "same_logits": torch.equal(logits["frozen_slice"], logits["frozen_index"])}))


if __name__ == "__main__":
    main()
