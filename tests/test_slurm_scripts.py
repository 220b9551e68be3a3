"""slurm/fit.sbatch's run folder, read without SLURM (a fake srun that prints its command): the requeued job resumes
from ROOT, so two configs of one name (configs/ and configs/demo/), or ES and --algo grpo of one config, must not
share it."""

from __future__ import annotations

import os
import subprocess

from conftest import ROOT


def _root_dir(tmp_path, *args: str, root: str | None = None) -> subprocess.CompletedProcess:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "srun").write_text('#!/bin/sh\necho "$@"\n')
    (bin_dir / "srun").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "ROOT"}
    env.update(PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_JOB_ID="1", SLURM_NNODES="1", SLURM_NTASKS_PER_NODE="1",
               **({"ROOT": root} if root else {}))
    return subprocess.run(["bash", str(ROOT / "slurm" / "fit.sbatch"), *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=60)


def test_the_run_folder_tells_configs_and_algorithms_apart_and_is_set_by_root(tmp_path):
    def root_of(*args: str, root: str | None = None) -> str:
        out = _root_dir(tmp_path, *args, root=root)
        assert out.returncode == 0, out.stderr
        words = out.stdout.split()
        return words[words.index("--trainer.default_root_dir") + 1]

    gpu, demo = str(ROOT / "configs/es_conciseness.yaml"), str(ROOT / "configs/demo/es_conciseness.yaml")
    assert root_of(gpu) == "runs/es_conciseness"  # the config's own default_root_dir, as `esrl fit` writes
    assert root_of(demo) == "runs/demo_es_conciseness"  # was runs/es_conciseness too
    assert root_of(gpu, "--algo", "grpo") == root_of(gpu, "--algo=grpo") == "runs/es_conciseness_grpo"
    assert root_of(gpu, root="runs/mine") == "runs/mine"
    bare = tmp_path / "bare.yaml"  # no default_root_dir of its own
    bare.write_text("model: {}\n")
    assert root_of(str(bare)) == "runs/bare"
    refused = _root_dir(tmp_path, gpu, "--trainer.default_root_dir", "elsewhere")
    assert refused.returncode == 2 and refused.stderr.strip() == (
        "fit.sbatch: set ROOT=DIR instead of --trainer.default_root_dir (the requeued job resumes from ROOT)")
