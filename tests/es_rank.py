"""A small ES fit on one device or as one of several ranks whose processes the caller starts: the GPU tests' fits.

tests/test_gpu.py fits in-process (`fit_weights`) and, for world-size invariance on a machine with one GPU, starts this
file twice with LOCAL_RANK 0 and 1 (Lightning then launches nothing, the processes exist): both ranks on the same
GPU, each in its own CUDA context. NCCL refuses two ranks on one GPU, so they talk through Gloo bound to CUDA only
("cuda:gloo"), which, like NCCL, has no CPU backend: a collective handed a CPU tensor fails there as under NCCL.

    python tests/es_rank.py MODEL MODE DEVICE WORLD BACKEND OUT   # rank 0 saves the final weights to OUT (torch.save)
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import torch

FIXTURES = Path(__file__).parent / "fixtures"


def fit_weights(model: str, root: Path, mode: str, compile: str = "auto", device: str = "cuda",
                strategy=None, checkpoints=None, ckpt_path=None) -> dict[str, torch.Tensor]:
    """Two ES iterations (N=4, 2 prompts, 140 tokens: the KV length passes ~130, where cuDNN's attention stopped
    repeating on an H100); the policy's final weights, on the CPU. `checkpoints`: a ModelCheckpoint; `ckpt_path`: the
    checkpoint to resume."""
    import lightning as L

    from esrl.callbacks import Evaluation
    from esrl.data import PromptDataModule
    from esrl.es.config import ESConfig
    from esrl.es.module import ESModule
    from esrl.policy import PolicyConfig
    from esrl.rollout import RolloutConfig

    module = ESModule(PolicyConfig(name_or_path=model, dtype="bfloat16"),
                      RolloutConfig(max_new_tokens=140, max_batch_size=6, compile=compile),  # auto: on for CUDA
                      ESConfig(population_size=4, sigma=0.01, alpha=0.01, seed=3, mode=mode, lora_rank=4,
                               checksum_every=1))
    data = PromptDataModule("conciseness", {"train_path": str(FIXTURES / "conciseness_train3.jsonl"),
                                            "eval_path": str(FIXTURES / "conciseness_eval2.jsonl")},
                            prompts_per_step=2)
    trainer = L.Trainer(accelerator=device, devices=1, max_steps=2, enable_progress_bar=False, logger=False,
                        enable_model_summary=False, enable_checkpointing=checkpoints is not None,
                        default_root_dir=root, limit_val_batches=0,
                        callbacks=[Evaluation(before=False, after=False), *([checkpoints] if checkpoints else [])],
                        **({"strategy": strategy} if strategy is not None else {}))
    trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
    if device == "cuda":
        assert module.engine.compile_times() or compile == "off"  # the compiled decode path ran
    return {n: p.detach().cpu().clone() for n, p in module.policy.named_parameters()}


def fit_two_ranks(model: str, root: Path, mode: str, device: str, backend: str) -> dict[str, torch.Tensor]:
    """This file's fit as two processes on one device (rank 0 and 1, started here); rank 0's final weights."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root.mkdir(parents=True, exist_ok=True)
    out, logs = root / "weights.pt", [root / f"rank{r}.log" for r in range(2)]  # files: a full pipe stalls a rank
    ranks = [subprocess.Popen([sys.executable, __file__, model, mode, device, "2", backend, str(out)],
                              stdout=log.open("w"), stderr=subprocess.STDOUT,
                              env={**os.environ, "LOCAL_RANK": str(r), "NODE_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                                   "MASTER_PORT": str(port)}) for r, log in enumerate(logs)]
    try:
        codes = [rank.wait(timeout=240) for rank in ranks]
    finally:  # a rank stuck in a collective dies here, not after the caller
        for rank in ranks:
            rank.kill()
    assert codes == [0, 0], [log.read_text()[-3000:] for log in logs]
    return torch.load(out)


def main(model: str, mode: str, device: str, world: str, backend: str, out: str) -> None:
    from esrl.es.strategy import ESStrategy

    strategy = ESStrategy(parallel_devices=[torch.device(device, 0) if device == "cuda" else torch.device("cpu")]
                          * int(world), process_group_backend=backend)
    weights = fit_weights(model, Path(out).parent / f"rank{os.environ.get('LOCAL_RANK', '0')}", mode,
                          device=device, strategy=strategy)
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        torch.save(weights, out)


if __name__ == "__main__":
    main(*sys.argv[1:])
