"""GRPO in a real 2-process fit (DDP on CPU, gloo) with accumulate_grad_batches 2: is the gradient the optimizer
gets TRL's? Prints, per rank, the loss tokens of each micro-batch (own and all ranks'), the step's token count
the module divided by (num_items, known before the first backward since the whole window rolls out first) and
the largest difference of the accumulated gradient (read before any hook of the module runs), relative to the
largest gradient entry,
from TRL's formula recomputed from the step's own rollouts: for dapo/cispo/vespo sum over ranks and
micro-batches of every token's term / (the step's tokens on all ranks); for the others Lightning's mean.

    python benchmarks/grpo_ddp_parity.py [--loss-type dapo] [--seed 7]

One optimizer step on a tiny random Llama (~1.5 min on 2 CPU cores); figures in benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import yaml

FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "fixtures"


def write_config(root: Path) -> Path:
    from esrl.models import tiny_llama

    model = tiny_llama(root / "tiny")
    config = {"seed_everything": 0, "algo": "grpo",
              "model": {"policy": {"name_or_path": str(model)},
                        "rollout": {"max_new_tokens": 6, "stop": ["e", "a", "o"]},
                        "grpo": {"num_generations": 4, "learning_rate": 1e-3}},
              "data": {"task": "conciseness", "prompts_per_step": 1,
                       "task_args": {"train_path": str(FIXTURES / "conciseness_train3.jsonl"),
                                     "eval_path": str(FIXTURES / "conciseness_eval2.jsonl")}},
              "trainer": {"accelerator": "cpu", "devices": 2, "max_steps": 1, "accumulate_grad_batches": 2,
                          "enable_progress_bar": False, "enable_model_summary": False,
                          "enable_checkpointing": False, "logger": False, "default_root_dir": str(root / "run")}}
    path = root / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--loss-type", default="dapo")
    parser.add_argument("--seed", default="7")
    parser.add_argument("--root", default=None, help="work folder (default: a fresh temporary one, shared by ranks)")
    args = parser.parse_args()

    import os

    root = Path(args.root or os.environ.setdefault("ESRL_DDP_PARITY_ROOT", tempfile.mkdtemp()))
    config = root / "config.yaml"
    if os.environ.get("LOCAL_RANK", "0") == "0" and not config.exists():
        write_config(root)

    from esrl.cli import EsrlCLI
    from esrl.data import PromptDataModule
    from esrl.grpo import GRPOLoss
    from esrl.models.logps import per_token_logps
    from esrl.module_factory import build_module

    cli = EsrlCLI(build_module, PromptDataModule, run=False, args=[
        "--config", str(config), "--model.grpo.loss_type", args.loss_type, "--seed_everything", args.seed])
    module = cli.model
    hook = module.on_before_optimizer_step
    result = {}

    def checking(optimizer) -> None:
        rollouts = module._rollouts
        local = torch.stack([r.completion_mask.sum().float() for r in rollouts])
        tokens = local.clone()
        dist.all_reduce(tokens)
        loss_fn = GRPOLoss(loss_type=args.loss_type, max_completion_length=module.rollout_config.max_new_tokens)
        params = [p for p in module.policy.parameters() if p.requires_grad]
        with torch.enable_grad():
            losses = [loss_fn(per_token_logps(module.policy, r.input_ids, r.attention_mask, r.completion_width,
                                              module.rollout_config.temperature),
                              None, r.advantages, r.completion_mask, num_items_in_batch=tokens.sum())[0]
                      for r in rollouts]
            # dapo/cispo/vespo: sum_k terms / N (summed over ranks below); others: Lightning's mean over k, DDP's
            # mean over ranks
            per_rank = sum(losses) if args.loss_type in ("dapo", "cispo", "vespo") else sum(losses) / len(losses) / dist.get_world_size()
            expected = torch.autograd.grad(per_rank, params)
        worst = 0.0
        for p, g in zip(params, expected):
            g = g.clone()
            dist.all_reduce(g)
            worst = max(worst, float((p.grad - g).abs().max() / g.abs().max().clamp(min=1e-12)))
        result.update(rank=dist.get_rank(), local_tokens=local.tolist(), global_tokens=tokens.tolist(),
                      num_items=None if module._num_items is None else float(module._num_items),
                      max_rel_grad_diff=worst)
        hook(optimizer)

    module.on_before_optimizer_step = checking
    cli.trainer.fit(module, cli.datamodule)
    print("RESULT", json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
