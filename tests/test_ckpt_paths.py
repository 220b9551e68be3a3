"""What `--ckpt_path` accepts before any model loads: a torch checkpoint file, a DeepSpeed folder, `last`; and where
`--ckpt_path last`, `esrl study` and slurm/fit.sbatch find a run's checkpoints."""

from __future__ import annotations

import os

import pytest
from conftest import ROOT


def test_ckpt_check_accepts_real_checkpoints_and_refuses_garbage(tmp_path):
    import torch

    from esrl.checkpoints import check_ckpt_path
    from esrl.errors import DataError

    torch.save({"state_dict": {}}, tmp_path / "ok.ckpt")
    (tmp_path / "deepspeed.ckpt" / "checkpoint").mkdir(parents=True)  # DeepSpeed's: a folder, its tag's within
    (tmp_path / "deepspeed.ckpt" / "latest").write_text("checkpoint")
    for fine in (tmp_path / "ok.ckpt", tmp_path / "deepspeed.ckpt", "last", None):
        check_ckpt_path(fine)
    (tmp_path / "runs").mkdir()  # any other folder (a run's, say) is no checkpoint
    with pytest.raises(DataError, match="runs: a folder, but not a DeepSpeed checkpoint"):
        check_ckpt_path(tmp_path / "runs")
    (tmp_path / "garbage.ckpt").write_bytes(bytes(range(256)) * 4)
    with pytest.raises(DataError, match="garbage.ckpt: not a readable checkpoint"):
        check_ckpt_path(tmp_path / "garbage.ckpt")


def test_ckpt_path_last_and_the_sbatch_resume_find_a_deepspeed_checkpoint_folder(tmp_path):
    """Under a DeepSpeed strategy (GRPO's ZeRO-2) interrupted.ckpt is a folder: `--ckpt_path last` and `esrl study`
    kept files only ("no checkpoint to resume") and slurm/fit.sbatch's `ls -t` listed the folder's contents, so a
    requeued job resumed from nothing or from a path inside it. The folder's layout is DeepSpeed's (latest, and its
    tag's folder), made by hand: DeepSpeed runs on a GPU only."""
    import subprocess

    from esrl.checkpoints import resolve_last

    checkpoints = tmp_path / "lightning_logs" / "version_0" / "checkpoints"
    (checkpoints / "interrupted.ckpt" / "checkpoint").mkdir(parents=True)
    (checkpoints / "interrupted.ckpt" / "latest").write_text("checkpoint")
    (checkpoints / "interrupted.ckpt" / "checkpoint" / "mp_rank_00_model_states.pt").write_bytes(b"")
    assert resolve_last({"default_root_dir": str(tmp_path)}) == str(checkpoints / "interrupted.ckpt")
    script = (ROOT / "slurm" / "fit.sbatch").read_text()
    lines = "; ".join(ln for ln in script.splitlines() if ln.startswith("CKPT="))

    def sbatch_pick() -> str:
        out = subprocess.run(["bash", "-c", f'ROOT={tmp_path}; {lines}; echo "$CKPT"'], capture_output=True, text=True)
        return out.stdout.strip()

    assert sbatch_pick() == str(checkpoints / "interrupted.ckpt")
    # last.ckpt/ made before interrupted.ckpt/, saved again after it: DeepSpeed rewrites its `latest` in place, the
    # folder keeps its first time, and both picks went back to the older interrupted.ckpt
    (checkpoints / "last.ckpt" / "checkpoint").mkdir(parents=True)
    (checkpoints / "last.ckpt" / "latest").write_text("checkpoint")
    os.utime(checkpoints / "last.ckpt", (1e9, 1e9))
    os.utime(checkpoints / "interrupted.ckpt", (1.5e9, 1.5e9))
    os.utime(checkpoints / "interrupted.ckpt" / "latest", (1.5e9, 1.5e9))
    os.utime(checkpoints / "last.ckpt" / "latest", (2e9, 2e9))
    assert resolve_last({"default_root_dir": str(tmp_path)}) == sbatch_pick() == str(checkpoints / "last.ckpt")
