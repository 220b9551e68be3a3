"""Resumed runs through the real CLI: SLURM's requeue (slurm/fit.sbatch), one history per run folder, the unfinished
final evaluation, `--ckpt_path last`, and what the user gave against what the checkpoint was trained with."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import FIXTURES, ROOT, run_esrl
from resume_common import STEPS, es_config, train_steps, wait_for, weights

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def config(tiny_model, tmp_path_factory) -> Path:
    return es_config(tiny_model, tmp_path_factory.mktemp("cfg"))


@pytest.fixture(scope="module")
def slurm_run(config, tmp_path_factory) -> dict:
    """slurm/fit.sbatch run twice as SLURM would (fixtures/fake_slurm's srun, scancel and scontrol on PATH; srun
    SIGKILLs its task on a SIGTERM of its own, as Slurm's does): SIGUSR1 (the time limit's warning) to the batch shell
    after step 2 of 40, then the requeued job with --trainer.max_steps 5."""
    tmp = tmp_path_factory.mktemp("slurm")
    bin_dir = tmp / "bin"
    bin_dir.mkdir()
    root = tmp / "run"
    env = {**os.environ, "PATH": f"{bin_dir}:{FIXTURES / 'fake_slurm'}:{os.environ['PATH']}",
           "FAKE_SCONTROL_LOG": str(tmp / "scontrol.log"), "FAKE_STEP_PIDS": str(tmp / "step_pids"),
           "SLURM_JOB_ID": "4242", "SLURM_NTASKS": "1",
           "SLURM_JOB_NAME": "esrl", "SLURM_NNODES": "1", "SLURM_NTASKS_PER_NODE": "1", "SLURM_PROCID": "0",
           "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "ESRL": str(bin_dir / "esrl"), "ROOT": str(root),
           "PYTHONUNBUFFERED": "1"}
    (bin_dir / "esrl").write_text(f'#!/bin/sh\nexec {sys.executable} -m esrl.cli "$@"\n')
    (bin_dir / "esrl").chmod(0o755)
    version = root / "lightning_logs" / "version_0"
    first = subprocess.Popen(["bash", str(ROOT / "slurm" / "fit.sbatch"), str(config)], cwd=ROOT, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wait_for(version / "checkpoints" / "step=2.ckpt", first)
    first.send_signal(signal.SIGUSR1)  # SLURM's warning (--signal=B:USR1@120) goes to the batch shell
    first_out = first.communicate(timeout=240)[0]
    interrupted = version / "checkpoints" / "interrupted.ckpt"
    log = tmp / "scontrol.log"
    saved = {"rc": first.returncode, "out": first_out, "scontrol": log.read_text() if log.exists() else ""}
    if interrupted.exists():
        step = torch.load(interrupted, map_location="cpu", weights_only=True)["global_step"]
        saved.update(step=step, same_weights=all(
            torch.equal(a, b) for a, b in zip(weights(interrupted).values(),
                                              weights(version / "checkpoints" / f"step={step}.ckpt").values())))
    second = subprocess.run(["bash", str(ROOT / "slurm" / "fit.sbatch"), str(config), "--trainer.max_steps",
                             str(STEPS)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    return {**saved, "second": second, "root": root, "version": version}


def test_sigterm_saves_a_resumable_checkpoint_and_exits_non_zero(slurm_run):
    assert slurm_run["rc"] == 143, slurm_run["out"][-3000:]
    assert slurm_run["scontrol"].split() == ["requeue", "4242"]  # the script's trap, after esrl stopped
    assert "step" in slurm_run, slurm_run["out"][-3000:]
    assert 2 <= slurm_run["step"] < 40 and slurm_run["same_weights"]  # at a step boundary, like step=K.ckpt
    assert f"esrl: SIGTERM at step {slurm_run['step']}: saved" in slurm_run["out"]


def test_requeued_job_resumes_into_the_same_folder_with_one_history(slurm_run):
    second, version = slurm_run["second"], slurm_run["version"]
    assert second.returncode == 0, second.stderr[-3000:]
    # the newest checkpoint: interrupted.ckpt, or last.ckpt saved at the same step end just after it
    assert any(f"Restored all states from the checkpoint at {version}/checkpoints/{name}" in second.stderr
               for name in ("interrupted.ckpt", "last.ckpt")), second.stderr[-3000:]
    assert [p.name for p in (slurm_run["root"] / "lightning_logs").iterdir()] == ["version_0"]
    assert (version / "final" / "model.safetensors").is_file()
    assert not (version / "checkpoints" / "interrupted.ckpt").exists()  # spent once the run finished
    assert train_steps(version / "metrics.csv") == list(range(STEPS))  # each step once, old and new rows
    assert [json.loads(line)["step"] for line in (version / "eval.jsonl").read_text().splitlines()] == [0, STEPS]
    seed_log = (version / "seed_log.jsonl").read_text().splitlines()
    assert [json.loads(line)["t"] for line in seed_log[1:]] == list(range(STEPS))


def test_resume_runs_the_final_evaluation_the_interrupted_run_did_not_finish(slurm_run, config):
    """A scorer outage in the final evaluation left no step-5 row and no final/; resuming from last.ckpt (step 5,
    nothing left to train) runs that evaluation, then writes final/."""
    import shutil

    version = slurm_run["version"]
    lines = (version / "eval.jsonl").read_text().splitlines()
    (version / "eval.jsonl").write_text(lines[0] + "\n")
    shutil.rmtree(version / "final")
    out = run_esrl("fit", "--config", config, "--trainer.default_root_dir", slurm_run["root"],
                   "--trainer.max_steps", STEPS, "--ckpt_path", version / "checkpoints" / "last.ckpt")
    assert out.returncode == 0, out.stderr[-3000:]
    assert [json.loads(line)["step"] for line in (version / "eval.jsonl").read_text().splitlines()] == [0, STEPS]
    assert (version / "final" / "model.safetensors").is_file()


def test_resume_with_other_hyperparameters_is_one_line_listing_each(slurm_run, config, tmp_path):
    ckpt = slurm_run["version"] / "checkpoints" / "step=1.ckpt"
    out = run_esrl("fit", "--config", config, "--ckpt_path", ckpt, "--trainer.default_root_dir", tmp_path,
                   "--model.es.alpha", "0.05", "--model.es.population_size", "6", "--model.es.mode", "lowrank",
                   "--seed_everything", "7", "--model.policy.name_or_path", tmp_path)
    assert out.returncode == 2
    lines = [line for line in out.stderr.splitlines() if line.startswith("esrl: error:")]
    assert len(lines) == 1, out.stderr[-3000:]
    for conflict in ("model.es.alpha 0.02 in the checkpoint, 0.05 given",
                     "model.es.population_size 4 in the checkpoint, 6 given",
                     "model.es.mode 'full' in the checkpoint, 'lowrank' given",
                     "seed_everything 3 in the checkpoint, 7 given", f"{tmp_path}' given"):
        assert conflict in lines[0], lines[0]
    assert "Traceback" not in out.stderr


def test_a_deepspeed_checkpoint_folder_is_compared_with_the_config_too(slurm_run, config, tmp_path):
    """A DeepSpeed checkpoint is a folder, its settings in the tag's mp_rank_00_model_states.pt (Lightning's
    checkpoint less weights and optimizer, as DeepSpeed's client state): it resumed with any settings given (a LoRA
    alpha changed under ZeRO-2 trained with another scaling, unsaid). Here a hand-made folder of that layout, from a
    real checkpoint (DeepSpeed needs a GPU)."""
    import torch

    saved = torch.load(slurm_run["version"] / "checkpoints" / "step=1.ckpt", map_location="cpu", weights_only=True)
    folder = tmp_path / "run" / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt"
    (folder / "checkpoint").mkdir(parents=True)
    (folder / "latest").write_text("checkpoint")
    client = {k: v for k, v in saved.items() if k not in ("state_dict", "optimizer_states")}
    torch.save({"module": saved["state_dict"], **client}, folder / "checkpoint" / "mp_rank_00_model_states.pt")
    out = run_esrl("fit", "--config", config, "--ckpt_path", folder, "--trainer.default_root_dir", tmp_path / "run",
                   "--model.es.alpha", "0.05")
    assert out.returncode == 2, out.stderr[-3000:]
    lines = [line for line in out.stderr.splitlines() if line.startswith("esrl: error:")]
    assert len(lines) == 1 and "model.es.alpha 0.02 in the checkpoint, 0.05 given" in lines[0], out.stderr[-3000:]


def test_an_es_checkpoint_resumed_with_grpo_says_so(slurm_run, config, tmp_path):
    ckpt = slurm_run["version"] / "checkpoints" / "step=1.ckpt"
    out = run_esrl("fit", "--config", config, "--ckpt_path", ckpt, "--algo", "grpo",
                   "--trainer.default_root_dir", tmp_path)
    assert out.returncode == 2
    assert f"esrl: error: --ckpt_path {ckpt}: a checkpoint of an ES run, but --algo grpo; resume it with --algo es" \
        in out.stderr and "Traceback" not in out.stderr


def test_resume_plan_keeps_the_checkpoints_values_and_lets_safe_ones_win():
    """Left at the default: the checkpoint's value (Lightning restores it); given and in MAY_CHANGE: the given
    value; a GRPO checkpoint refused under ES; the run seed taken from the checkpoint when not given."""
    from esrl.errors import ConfigError
    from esrl.resume import plan_resume

    ckpt = {"hyper_parameters": {"policy": {"name_or_path": "m"}, "es": {"alpha": 0.02, "checksum_every": 10}},
            "datamodule_hyper_parameters": {"task": "conciseness", "eval_batch_size": 16},
            "esrl_es": {"noise_seed": 3}}
    given = {"algo": "es", "seed_everything": 0, "model": {"policy": {"name_or_path": "m"},
                                                          "es": {"alpha": 5e-4, "checksum_every": 2}},
             "data": {"task": "conciseness", "eval_batch_size": 4}}
    plan = plan_resume("x.ckpt", ckpt, given)
    assert plan.overrides == {"model.es.checksum_every": 2, "data.eval_batch_size": 4} and plan.seed == 3
    with pytest.raises(ConfigError, match="data.task 'conciseness' in the checkpoint, 'countdown' given"):
        plan_resume("x.ckpt", ckpt, {**given, "data": {"task": "countdown"}})
    with pytest.raises(ConfigError, match="a checkpoint of a GRPO run, but --algo es; resume it with --algo grpo"):
        plan_resume("x.ckpt", {"hyper_parameters": {"grpo": {}}, "esrl_grpo": {"run_seed": 0}}, given)
    with pytest.raises(ConfigError, match="a checkpoint of an ES run, but --algo grpo; resume it with --algo es"):
        plan_resume("x.ckpt", ckpt, {**given, "algo": "grpo"})


def test_resume_plan_edges_sections_seeds_scorers_and_unwritten_speed_fields():
    """A LoRA section against a checkpoint without one (or the reverse, written) is a conflict: flattened, the two
    shared no field and the checkpoint's silently won. A speed field left at its default is the checkpoint's (it was
    reset: gradient checkpointing off, an OOM). A run seeded by model.es.seed resumes under a config with
    seed_everything 0 (it read the noise seed as seed_everything). A scorer's address, token or timeout may change
    (a service restarted elsewhere); what it scores may not."""
    from esrl.errors import ConfigError
    from esrl.resume import explicit_fields, plan_resume

    lora = {"rank": 8, "alpha": 16}
    grpo = {"hyper_parameters": {"grpo": {"lora": None, "gradient_checkpointing": True}},
            "esrl_grpo": {"run_seed": 0}}
    given = {"algo": "grpo", "seed_everything": 0, "model": {"grpo": {"lora": lora, "gradient_checkpointing": False}}}
    with pytest.raises(ConfigError, match=r"model.grpo.lora None in the checkpoint, \{'rank': 8, 'alpha': 16\} given"):
        plan_resume("x.ckpt", grpo, given)
    plan = plan_resume("x.ckpt", grpo, {**given, "model": {"grpo": {"gradient_checkpointing": False}}})
    assert plan.overrides == {}  # not written: the checkpoint's True
    with_lora = {"hyper_parameters": {"grpo": {"lora": lora}}, "esrl_grpo": {"run_seed": 0}}
    none = {**given, "model": {"grpo": {"lora": None}}}
    assert plan_resume("x.ckpt", with_lora, none).overrides == {}  # not written: the checkpoint's adapter
    with pytest.raises(ConfigError, match=r"model.grpo.lora \{'rank': 8, 'alpha': 16\} in the checkpoint, None"):
        plan_resume("x.ckpt", with_lora, none, explicit=explicit_fields(["fit", "--model.grpo.lora", "null"]))

    seeded = {"hyper_parameters": {"es": {"seed": 7}}, "esrl_es": {"noise_seed": 7}}
    es = {"algo": "es", "seed_everything": 0, "model": {"es": {}}}
    assert plan_resume("x.ckpt", seeded, es, explicit=explicit_fields(["fit", "--seed_everything", "0"])).seed == 0

    args = {"scorer": "http://node-a:8000", "token": "t", "timeout": 60, "num_train": 64}
    pku = {"hyper_parameters": {"es": {}}, "esrl_es": {"noise_seed": 0},
           "datamodule_hyper_parameters": {"task": "pku_saferlhf", "task_args": args}}
    moved = {**args, "scorer": "http://node-b:8000", "token": "u", "timeout": 120}
    plan_resume("x.ckpt", pku, {**es, "data": {"task": "pku_saferlhf", "task_args": moved}})
    with pytest.raises(ConfigError, match="data.task_args"):
        plan_resume("x.ckpt", pku, {**es, "data": {"task": "pku_saferlhf", "task_args": {**moved, "num_train": 8}}})


def test_a_value_typed_equal_to_the_default_is_given_too(tmp_path):
    """`--model.es.alpha 5e-4` (the default) or `alpha: 5e-4` in a --config / -c file or a global config's `fit:`
    against a checkpoint trained with 0.02 is a conflict, not silently the checkpoint's; unwritten: the checkpoint's."""
    from esrl.errors import ConfigError
    from esrl.resume import explicit_fields, plan_resume

    ckpt = {"hyper_parameters": {"es": {"alpha": 0.02}}, "esrl_es": {"noise_seed": 3}}
    given = {"algo": "es", "seed_everything": 0, "model": {"es": {"alpha": 5e-4}}}
    assert plan_resume("x.ckpt", ckpt, given, explicit=explicit_fields(["fit"])).seed == 3
    for argv in (["fit", "--model.es.alpha", "0.0005"], ["fit", "--model.es.alpha=0.0005"]):
        with pytest.raises(ConfigError, match="model.es.alpha 0.02 in the checkpoint, 0.0005 given"):
            plan_resume("x.ckpt", ckpt, given, explicit=explicit_fields(argv))
    config, global_config = tmp_path / "c.yaml", tmp_path / "g.yaml"
    config.write_text("seed_everything: 0\nmodel:\n  es:\n    alpha: 0.0005\n")
    global_config.write_text("fit:\n  seed_everything: 0\n  model:\n    es:\n      alpha: 0.0005\n")
    for argv in (["fit", "--config", config], ["fit", "-c", config], ["fit", f"-c={config}"], [f"--config={config}"],
                 ["--config", global_config, "fit"], ["-c", global_config, "fit", "--trainer.max_steps", "3"]):
        with pytest.raises(ConfigError, match="model.es.alpha 0.02 in the checkpoint, 0.0005 given; seed_everything 3"):
            plan_resume("x.ckpt", ckpt, given, explicit=explicit_fields([str(a) for a in argv]))
    assert "model.es.alpha" not in explicit_fields(["-c", str(global_config), "validate"])  # not validate's section


def test_a_ckpt_path_written_with_a_tilde_restores_the_checkpoints_settings(slurm_run, tiny_model, tmp_path,
                                                                            monkeypatch):
    """`--ckpt_path=~/...` (no shell expands a tilde after `=`, nor in a YAML value): esrl's checks read the file, but
    LightningCLI's restore of the checkpoint's hyperparameters did not find it, so every model field the config left
    out took its default (here alpha 5e-4 and sigma 1e-3 for the checkpoint's 0.02 and 0.05) without a word. A
    subprocess: an in-process fit on the `es` strategy leaves its process group's port taken in this worker."""
    import csv

    from conftest import write_tiny_config

    last = slurm_run["version"] / "checkpoints" / "last.ckpt"
    monkeypatch.setenv("HOME", str(last.parent))
    config = write_tiny_config(tmp_path / "c.yaml", tiny_model, max_steps=STEPS + 1)  # no es section
    out = run_esrl("fit", "--config", config, "--ckpt_path=~/last.ckpt", "--trainer.default_root_dir", tmp_path / "r")
    assert out.returncode == 0, out.stderr[-3000:]
    (metrics,) = (tmp_path / "r").rglob("metrics.csv")
    (row,) = [r for r in csv.DictReader(metrics.open()) if r.get("train/alpha")]
    assert (float(row["train/alpha"]), float(row["train/sigma"])) == pytest.approx((0.02, 0.05), rel=1e-6)  # float32


def test_a_run_resumed_at_its_max_steps_rewrites_its_seed_log_to_the_checkpoint(slurm_run, config, tmp_path):
    """Resumed from step 2 with max_steps 2, a run trains nothing (Lightning skips the train hooks) but writes
    final/ at step 2; its seed log, rewritten at train start, kept the 5 records of the run it came from, so
    `esrl export` (its last step by default) rebuilt another model than final/."""
    import shutil

    version = tmp_path / "lightning_logs" / "version_0"
    shutil.copytree(slurm_run["version"], version)
    shutil.rmtree(version / "final")
    assert len((version / "seed_log.jsonl").read_text().splitlines()) == 1 + STEPS
    out = run_esrl("fit", "--config", config, "--trainer.max_steps", 2, "--trainer.default_root_dir", tmp_path,
                   "--ckpt_path", version / "checkpoints" / "step=2.ckpt")
    assert out.returncode == 0, out.stderr[-3000:]
    (final,) = tmp_path.rglob("final/config.json")
    log = final.parent.parent / "seed_log.jsonl"
    assert [json.loads(line).get("t") for line in log.read_text().splitlines()] == [None, 0, 1]


def test_ckpt_path_last_is_the_newest_checkpoint_of_the_root_or_one_line(slurm_run, config, tmp_path):
    """`--ckpt_path last` trained from step 0 with exit 0 (Lightning looked in this fit's new version folder). Now
    the root's newest version_*/checkpoints/{last,interrupted}.ckpt: conflicts checked, its folder continued."""
    root, last = slurm_run["root"], slurm_run["version"] / "checkpoints" / "last.ckpt"
    fit = ["fit", "--config", config, "--trainer.default_root_dir", root, "--ckpt_path", "last"]
    out = run_esrl(*fit, "--trainer.max_steps", 1, "--model.es.alpha", "0.05")
    assert out.returncode == 2 and f"esrl: error: --ckpt_path {last} was trained with other settings than given: " \
        "model.es.alpha 0.02 in the checkpoint, 0.05 given" in out.stderr, out.stderr[-3000:]
    out = run_esrl(*fit, "--trainer.max_steps", STEPS)
    assert out.returncode == 0 and f"Restored all states from the checkpoint at {last}" in out.stderr, out.stderr
    assert [p.name for p in (root / "lightning_logs").iterdir()] == ["version_0"]
    out = run_esrl(*fit[:4], tmp_path, *fit[5:])
    assert out.returncode == 2 and out.stderr.strip().splitlines() == [
        f"esrl: error: --ckpt_path last: no checkpoint to resume in {tmp_path}/lightning_logs/version_*/checkpoints "
        "(last.ckpt or interrupted.ckpt); give a checkpoint file, or start without --ckpt_path"], out.stderr[-3000:]
