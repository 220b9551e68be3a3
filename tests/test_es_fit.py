"""ES through the real CLI, Lightning Trainer and processes: determinism, world size, resume, outputs."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from conftest import assert_same_tensors, fit_final, load_safetensors, run_esrl, write_tiny_config

pytestmark = pytest.mark.slow

STEPS = 4


@pytest.fixture(scope="module")
def es_config(tiny_model, tmp_path_factory) -> Path:
    """A tiny ES run: 3 training prompts, one per step, so step 2 is in the middle of an epoch."""
    return write_tiny_config(
        tmp_path_factory.mktemp("cfg") / "es_tiny.yaml", tiny_model, max_steps=STEPS,
        es={"population_size": 4, "sigma": 0.05, "alpha": 0.02, "checksum_every": 1},
        trainer={"enable_checkpointing": True,
                 "callbacks": [{"class_path": "esrl.callbacks.Evaluation",
                                "init_args": {"every_n_steps": 2, "num_samples": 2, "kl": True}},
                               {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                                "init_args": {"every_n_train_steps": 1, "save_top_k": -1, "filename": "{step}"}}]})


@pytest.fixture(scope="module")
def reference_run(es_config, tmp_path_factory) -> Path:
    return fit_final(es_config, tmp_path_factory.mktemp("run_a"))


def train_rows(run_dir: Path) -> list[dict[str, float]]:
    """metrics.csv's training rows, one per iteration, their logged values as floats."""
    import csv

    with open(run_dir / "metrics.csv") as f:
        return [{k: float(v) for k, v in r.items() if v} for r in csv.DictReader(f) if r.get("train/reward_mean")]


def test_fit_writes_final_model_logs_and_seed_log(reference_run):
    run_dir = reference_run.parent.parent
    assert (run_dir / "final" / "config.json").is_file()
    assert (run_dir / "metrics.csv").is_file()
    header = (run_dir / "metrics.csv").read_text().splitlines()[0]
    for key in ("train/reward_mean", "train/reward_std", "time/noise", "time/rollout", "time/reward",
                "time/update", "time/step", "eval/reward"):
        assert key in header
    rows = train_rows(run_dir)
    assert len(rows) == STEPS
    for row in rows:  # the completions' series GRPO logs over its samples, here over the members'
        assert 1 <= row["train/completion_length_min"] <= row["train/completion_length_mean"] \
            <= row["train/completion_length_max"] <= 6  # max_new_tokens
        assert 0 <= row["train/truncated_frac"] <= 1
        # the task's one reward function, weight 1: its mean is the members' mean fitness
        assert row["train/rewards/length_reward/mean"] == pytest.approx(row["train/reward_mean"], rel=1e-6)
    lines = (run_dir / "seed_log.jsonl").read_text().splitlines()
    assert len(lines) == 1 + STEPS  # header + one record per iteration
    assert len(list((run_dir / "checkpoints").glob("step=*.ckpt"))) == STEPS


def test_evaluation_before_during_after_with_kl_and_pass_at_k(reference_run):
    evals = [json.loads(line) for line in (reference_run.parent.parent / "eval.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [0, 2, 4]
    for key in ("reward", "sampled/reward", "pass@1", "pass@2", "kl", "hacking/empty", "hacking/repetition"):
        assert all(key in e for e in evals), key
    assert evals[0]["kl"] == 0.0  # the starting weights are the base model
    assert evals[-1]["kl"] > 0.0
    samples = (reference_run.parent.parent / "samples.csv").read_text().splitlines()
    assert samples[0] == "step,prompt,greedy,reward,sample" and len(samples) > 3
    import csv

    prompts = [row["prompt"] for row in csv.DictReader(samples)]
    assert prompts and all(p.strip() and "'role'" not in p for p in prompts), prompts[:2]  # the text, not a list repr


def test_two_runs_with_one_seed_give_identical_weights(es_config, reference_run, tmp_path):
    again = fit_final(es_config, tmp_path)
    assert_same_tensors(load_safetensors(reference_run), load_safetensors(again))


def test_weights_move(tiny_model, reference_run):
    base = load_safetensors(Path(tiny_model) / "model.safetensors")
    final = load_safetensors(reference_run)
    assert any(not (base[k] == final[k]).all() for k in base)


def test_two_processes_give_the_weights_of_one(es_config, reference_run, tmp_path):
    two = fit_final(es_config, tmp_path, "--trainer.devices", "2")
    assert_same_tensors(load_safetensors(reference_run), load_safetensors(two))
    keys = ("train/reward_mean", "train/completion_length_min", "train/completion_length_mean",
            "train/completion_length_max", "train/truncated_frac", "train/rewards/length_reward/mean")
    assert [[r[k] for k in keys] for r in train_rows(two.parent.parent)] == \
        [[r[k] for k in keys] for r in train_rows(reference_run.parent.parent)]  # each rank's members gathered


def test_a_weight_that_drifts_on_one_rank_stops_the_run_naming_the_iteration(es_config, tmp_path, monkeypatch):
    """checksum_every 1: one ulp of one weight on rank 1 at iteration 1 stops both ranks in one line naming it (the
    seed log's 0-based number; the message said 2, global_step having counted the update)."""
    from conftest import FIXTURES

    monkeypatch.setenv("PYTHONPATH", str(FIXTURES))
    out = run_esrl("fit", "--config", es_config, "--trainer.devices", "2", "--trainer.default_root_dir", tmp_path,
                   "--trainer.callbacks+=drift_at_step.DriftAtStep", "--trainer.callbacks.at=1")
    assert out.returncode != 0 and "ES weights differ across ranks at iteration 1: checksums" in out.stderr, \
        out.stderr[-3000:]
    assert not list(tmp_path.rglob("final"))


def test_resume_from_mid_epoch_equals_uninterrupted(es_config, reference_run, tmp_path):
    ckpt = next(reference_run.parent.parent.glob("checkpoints/step=2.ckpt"))
    resumed = fit_final(es_config, tmp_path, "--ckpt_path", ckpt)
    assert_same_tensors(load_safetensors(reference_run), load_safetensors(resumed))
    # the resumed run's seed log holds the whole history, restored from the checkpoint
    assert (resumed.parent.parent / "seed_log.jsonl").read_text() == \
        (reference_run.parent.parent / "seed_log.jsonl").read_text()


def test_export_from_seed_log_equals_final_weights(tiny_model, reference_run, tmp_path):
    log = reference_run.parent.parent / "seed_log.jsonl"
    out = run_esrl("export", "--seed-log", log, "--base", tiny_model, "--out", tmp_path / "rebuilt")
    assert out.returncode == 0 and "warning" not in out.stderr, out.stderr[-3000:]
    assert_same_tensors(load_safetensors(reference_run), load_safetensors(tmp_path / "rebuilt" / "model.safetensors"))
    assert json.loads(log.read_text().splitlines()[0])["noise_source"] == "cpu"
    out = run_esrl("export", "--seed-log", log, "--base", tiny_model, "--step", "0", "--out", tmp_path / "base")
    assert out.returncode == 0, out.stderr[-3000:]
    assert_same_tensors(load_safetensors(Path(tiny_model) / "model.safetensors"),
                        load_safetensors(tmp_path / "base" / "model.safetensors"))


def test_an_export_that_fails_part_way_leaves_no_out_folder(tiny_model, reference_run, tmp_path, monkeypatch):
    """The export wrote into --out in place: a save that failed after config.json (here the tokenizer's) left a
    folder that looked like a model, and a rerun was refused for its files. --out appears only complete."""
    import esrl.export as export_module
    from esrl.models import load_tokenizer

    def failing(path):
        tok = load_tokenizer(path)
        tok.save_pretrained = lambda *a, **k: (_ for _ in ()).throw(OSError("disk full (injected)"))
        return tok

    monkeypatch.setattr(export_module, "load_tokenizer", failing)
    log = reference_run.parent.parent / "seed_log.jsonl"
    with pytest.raises(OSError, match="disk full"):
        export_module.export(str(log), str(tmp_path / "rebuilt"), tiny_model)
    assert not (tmp_path / "rebuilt").exists()
    monkeypatch.undo()
    export_module.export(str(log), str(tmp_path / "rebuilt"), tiny_model)
    assert (tmp_path / "rebuilt" / "tokenizer_config.json").is_file()
    (tmp_path / "here").mkdir()  # `--out .`, an empty working folder: kept (not replaced), filled whole
    monkeypatch.chdir(tmp_path / "here")
    inode = os.stat(".").st_ino
    export_module.export(str(log), ".", tiny_model)
    assert os.stat(".").st_ino == inode and Path("model.safetensors").is_file() and Path("config.json").is_file()


@pytest.mark.parametrize("below", [False, True])
def test_export_refuses_an_out_that_cannot_be_a_folder(tmp_path, below):
    """transformers only warns when asked to save into a file: --out a file (or below one) is refused in one line,
    before the seed log is even read, and the file is left as it was."""
    existing = tmp_path / "notes.txt"
    existing.write_text("keep me")
    out_arg = existing / "model" if below else existing
    out = run_esrl("export", "--seed-log", tmp_path / "never_read.jsonl", "--out", out_arg)
    assert out.returncode == 2 and "Traceback" not in out.stderr and "wrote" not in out.stdout
    (error,) = out.stderr.strip().splitlines()
    assert error == f"esrl export: error: --out: {out_arg} cannot be a folder: {existing} is a file"
    assert existing.read_text() == "keep me"


def test_seed_log_of_a_paper_run_is_under_one_megabyte():
    from esrl.es.seed_log import bytes_per_iteration

    assert 1000 * bytes_per_iteration(30) < 1_000_000


def test_export_checks_the_base_and_rebuilds_steps_before_a_torn_line(tiny_model, reference_run, tmp_path, capsys):
    """Another --base is refused in one line (the header's fingerprint); a torn last line (a run killed mid-write)
    still lets every earlier step be rebuilt, and asking for all names the torn line; an old log without a
    fingerprint exports with a warning."""
    from esrl.errors import DataError
    from esrl.export import export
    from esrl.models import tiny_llama

    log = reference_run.parent.parent / "seed_log.jsonl"
    lines = log.read_text().splitlines()
    other = tiny_llama(tmp_path / "other", seed=1)
    out = run_esrl("export", "--seed-log", log, "--base", other, "--out", tmp_path / "wrong")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    (error,) = [line for line in out.stderr.splitlines() if "error" in line]
    assert error.startswith(f"esrl export: error: --base {other}: not the base model of {log} (weights fingerprint ")
    assert f"the log's {json.loads(lines[0])['base_fingerprint']}; the run started from {tiny_model})" in error
    assert not (tmp_path / "wrong").exists()

    torn = tmp_path / "torn.jsonl"
    torn.write_text("\n".join(lines[:-1]) + "\n" + lines[-1][:40])  # the last record cut mid-write
    rebuilt = load_safetensors(export(str(torn), str(tmp_path / "torn3"), tiny_model, STEPS - 1) / "model.safetensors")
    assert_same_tensors(rebuilt, load_safetensors(
        export(str(log), str(tmp_path / "log3"), tiny_model, STEPS - 1) / "model.safetensors"))
    with pytest.raises(DataError, match=rf"torn.jsonl:{STEPS + 1}: invalid JSON .*; the first {STEPS - 1} iterations "
                                        rf"are intact \(pass --step {STEPS - 1} or less\)$"):
        export(str(torn), str(tmp_path / "all"), tiny_model)

    # The noise is the generator's of the device the run drew it on (a GPU's Philox differs from the CPU's draws):
    # a run from a GPU is refused where there is none, never replayed with the CPU's numbers.
    header = json.loads(lines[0])
    assert header["device"] == "cpu"
    if not torch.cuda.is_available():
        gpu = tmp_path / "gpu.jsonl"
        gpu.write_text("\n".join([json.dumps({**header, "device": "cuda"}), *lines[1:]]) + "\n")
        with pytest.raises(DataError, match="drew its noise on cuda, .*export it on a machine with cuda$"):
            export(str(gpu), str(tmp_path / "gpu"), tiny_model)
        assert not (tmp_path / "gpu").exists()

    old = tmp_path / "old.jsonl"
    del header["base_fingerprint"], header["device"]
    old.write_text("\n".join([json.dumps(header), *lines[1:]]) + "\n")
    capsys.readouterr()
    export(str(old), str(tmp_path / "old"), other, 1)
    err = capsys.readouterr().err
    assert "records no base fingerprint (an older log): cannot check" in err and "records no device" in err


def test_noise_drawn_on_another_gpu_model_is_named():
    """torch's CUDA generator sizes its grid by the chip's SMs, so an H100 SXM and an H100 PCIe draw other numbers
    from one seed for large tensors: the seed log and checkpoints record the model (esrl.es.noise.noise_source), and
    an export or resume elsewhere says so. The GPU side: tests/test_gpu.py."""
    from esrl.es.noise import noise_source, other_noise_source

    assert noise_source("cpu") == "cpu" and other_noise_source(None, "cpu") is None
    sxm = "cuda: NVIDIA H100 80GB HBM3, 132 SMs, 2048 threads/SM"
    pcie = "cuda: NVIDIA H100 PCIe, 114 SMs, 2048 threads/SM"
    assert other_noise_source(sxm, sxm) is None
    assert other_noise_source(sxm, pcie).startswith(f"the noise was drawn on {sxm}; here {pcie}")
