"""ES runs that fail part way: the weights are never left perturbed, a checkpoint never holds an update its seed log
lacks, and a run whose final save fails keeps its interrupted.ckpt."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from conftest import FailAt, conciseness_data


def _fit(tiny_model, root, steps: int = 2, callbacks=(), mode: str = "full", ckpt_path=None):
    """An in-process ES fit on the tiny model (4 members, 1 prompt a step); the module, however the fit ended."""
    from esrl.es.config import ESConfig
    from esrl.es.module import ESModule
    from esrl.policy import PolicyConfig
    from esrl.rollout import RolloutConfig

    module = ESModule(PolicyConfig(name_or_path=tiny_model), RolloutConfig(max_new_tokens=4),
                      ESConfig(population_size=4, sigma=0.05, alpha=0.01, seed=1, mode=mode))
    data = conciseness_data(1)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, enable_progress_bar=False,
                        enable_model_summary=False, logger=False, default_root_dir=root, limit_val_batches=0,
                        callbacks=list(callbacks), enable_checkpointing=any(isinstance(c, ModelCheckpoint)
                                                                             for c in callbacks))
    try:
        trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
    except RuntimeError as e:
        module.error = e
    return module


def test_a_perturbation_that_fails_part_way_is_restored(tiny_model, tmp_path):
    """Full mode writes a member's noise tensor by tensor: a failure at the third (a CUDA OOM drawing its noise)
    left the first two perturbed, with nothing to restore them, for Lightning's on_exception hooks and any
    checkpoint saved there. The weights after the failed fit are the base model's, bit for bit."""
    from esrl.models import load_causal_lm

    module = _fit(tiny_model, tmp_path, callbacks=[FailAt(lambda m: m.backend.perturber.mode, "direction", 0,
                                                          when=lambda seed, j, *a: j == 2)])
    assert "direction failed" in str(module.error)
    assert not module.backend.is_perturbed
    base = dict(load_causal_lm(tiny_model).named_parameters())
    assert all(torch.equal(p, base[n]) for n, p in module.policy.named_parameters())


def test_a_checkpoint_saved_when_a_step_fails_after_its_update_holds_that_update_in_its_seed_log(tiny_model,
                                                                                                   tmp_path):
    """The update of iteration 1 applied, then the engine's sync after it failed: Lightning's save_on_exception
    checkpoint once held 2 updates and 1 seed-log record, a log `esrl export` could not finish. Its records now
    match its updates; a checkpoint that lacks one is refused in one line on resume."""
    saver = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_on_exception=True, every_n_train_steps=100)
    module = _fit(tiny_model, tmp_path, steps=3, callbacks=[saver, FailAt(lambda m: m.backend, "after_update", 2)])
    assert "after_update failed" in str(module.error)
    (saved,) = (tmp_path / "ckpt").glob("*.ckpt")
    ckpt = torch.load(saved, map_location="cpu", weights_only=False)
    assert ckpt["global_step"] == 2 and [r["t"] for r in ckpt["esrl_es"]["seed_log"]] == [0, 1]

    ckpt["esrl_es"]["seed_log"].pop()
    torch.save(ckpt, tmp_path / "torn.ckpt")
    with pytest.raises(Exception, match=r"2 ES updates but 1 seed-log records \(saved mid-iteration\)"):
        _fit(tiny_model, tmp_path / "resumed", steps=3, ckpt_path=str(tmp_path / "torn.ckpt"))


def test_a_checkpoint_resumes_only_on_the_device_type_that_drew_its_noise(tiny_model, tmp_path):
    """The same seeds draw other noise on a GPU (Triton's Philox) and on the CPU: a run resumed on the other one went
    on as another run, under a seed log whose one device could then rebuild neither part. The checkpoint names its
    device; another is refused in one line. Only the CPU runs here, so the checkpoint is edited to name a GPU; a
    checkpoint without the field (older esrl) resumes as before."""
    saver = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=1, save_top_k=-1)
    _fit(tiny_model, tmp_path, steps=1, callbacks=[saver])
    ckpt = torch.load(tmp_path / "ckpt" / "epoch=0-step=1.ckpt", map_location="cpu", weights_only=False)
    assert ckpt["esrl_es"]["device"] == "cpu"

    ckpt["esrl_es"]["device"] = "cuda"
    torch.save(ckpt, tmp_path / "gpu.ckpt")
    with pytest.raises(Exception) as err:
        _fit(tiny_model, tmp_path / "resumed", steps=2, ckpt_path=str(tmp_path / "gpu.ckpt"))
    assert str(err.value) == (f"--ckpt_path {tmp_path / 'gpu.ckpt'}: its 1 ES updates drew their noise on cuda; on "
                              "cpu the same seeds draw other noise, so the run would not be the one it continues and "
                              "its seed log could not rebuild it: resume on cuda")

    del ckpt["esrl_es"]["device"]
    torch.save(ckpt, tmp_path / "old.ckpt")
    assert _fit(tiny_model, tmp_path / "old", steps=2, ckpt_path=str(tmp_path / "old.ckpt")).trainer.global_step == 2


def test_a_run_whose_final_save_fails_keeps_its_interrupted_checkpoint(tiny_model, tmp_path):
    """interrupted.ckpt was deleted at the callbacks' on_fit_end, before the module's wrote final/: a final save
    that failed (a full disk) left neither. It goes only after a fit that ended without an error."""
    from esrl.callbacks import Interruption

    spent = tmp_path / "checkpoints" / "interrupted.ckpt"
    spent.parent.mkdir(parents=True)
    spent.write_bytes(b"resumable")
    module = _fit(tiny_model, tmp_path, steps=1, callbacks=[Interruption(), FailAt(lambda m: m.mode, "save_final", 0)])
    assert "save_final failed" in str(module.error) and spent.is_file()
    _fit(tiny_model, tmp_path, steps=1, callbacks=[Interruption()])
    assert not spent.exists() and (tmp_path / "final" / "model.safetensors").is_file()


def test_a_finished_run_spends_a_deepspeed_interrupted_checkpoint_folder(tiny_model, tmp_path):
    """Under DeepSpeed interrupted.ckpt is a folder (DeepSpeed's layout, made by hand here: it runs on a GPU only):
    the finished run's unlink raised IsADirectoryError after final/ was written. It is removed as a file is."""
    from esrl.callbacks import Interruption

    spent = tmp_path / "checkpoints" / "interrupted.ckpt"
    (spent / "checkpoint").mkdir(parents=True)
    (spent / "latest").write_text("checkpoint")
    module = _fit(tiny_model, tmp_path, steps=1, callbacks=[Interruption()])
    assert not hasattr(module, "error") and not spent.exists() and (tmp_path / "final").is_dir()


def test_a_final_save_that_fails_part_way_leaves_no_final_folder(tiny_model, tmp_path):
    """transformers writes config.json before the weights, and sweeps and studies count a run with final/config.json
    as done (esrl.fit_runs.final_dir): a save that failed after it (here the tokenizer's, after the model's) left a
    final/ that a rerun skipped instead of resuming. final/ appears only complete; the next finished fit writes it."""
    root = tmp_path / "run"
    module = _fit(tiny_model, root, steps=1, callbacks=[FailAt(lambda m: m.tokenizer, "save_pretrained", 0)])
    assert "save_pretrained failed" in str(module.error)
    assert (root / "final.partial" / "config.json").is_file() and not (root / "final").exists()
    _fit(tiny_model, root, steps=1)
    assert (root / "final" / "tokenizer_config.json").is_file() and not (root / "final.partial").exists()


def test_a_checkpoint_saved_when_a_step_fails_resumes_with_that_steps_prompt(tiny_model, tmp_path):
    """A reward that fails at iteration 1 (a scorer outage): Lightning's save_on_exception checkpoint counted that
    iteration's prompt as consumed, so the resumed run skipped it and ended in other weights than a run never
    stopped. The data position holds the prompts whose step completed: the resumed run takes the same prompts and
    ends in the same weights, bit for bit."""
    whole = _fit(tiny_model, tmp_path / "whole", steps=3)
    saver = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_on_exception=True, every_n_train_steps=100)
    failed = _fit(tiny_model, tmp_path / "failed", steps=3, callbacks=[saver, FailAt(lambda m: m.task, "rewards", 1)])
    assert "rewards failed" in str(failed.error)
    (saved,) = (tmp_path / "ckpt").glob("*.ckpt")
    ckpt = torch.load(saved, map_location="cpu", weights_only=False)
    assert ckpt["global_step"] == 1
    assert ckpt["PromptDataModule"] == {"epoch": 0, "batches": 1, "replicas": 1, "micro_batches": 1}
    resumed = _fit(tiny_model, tmp_path / "resumed", steps=3, ckpt_path=str(saved))
    assert not hasattr(resumed, "error")
    after = dict(resumed.policy.named_parameters())
    assert all(torch.equal(p, after[n]) for n, p in whole.policy.named_parameters())


def test_an_es_step_that_fails_part_way_through_its_gradient_leaves_no_grad(monkeypatch):
    """es_step drops its grads however it ends; a failure while the gradient is still being set (an OOM drawing
    its noise, group by group) left the groups set so far holding theirs, a gradient's memory for nothing."""
    from esrl.es import update
    from esrl.es.noise import population
    from esrl.es.params import select_params

    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 5))  # groups of other shapes
    selection = select_params(model)
    real = update.es_gradient_groups

    def failing(*args, **kwargs):
        for k, group in enumerate(real(*args, **kwargs)):
            if k == 2:
                raise RuntimeError("out of memory (injected)")
            yield group

    monkeypatch.setattr(update, "es_gradient_groups", failing)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match="injected"):
        update.es_step(torch.optim.SGD(selection.params, lr=0.1), selection, population(0, 1, 4),
                       torch.tensor([1.0, -1.0, 0.5, -0.5], dtype=torch.float64))
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))


@pytest.mark.parametrize("fails", [False, True], ids=["finished", "failed"])
def test_a_lora_fit_leaves_no_hooks_on_the_policy(tiny_model, tmp_path, fails):
    """lora's population hooks (installed once, kept for the run) stayed on the policy after every fit, finished or
    failed: inactive, but a second population on the same model was refused."""
    callbacks = [FailAt(lambda m: m.task, "rewards", 1)] if fails else []
    module = _fit(tiny_model, tmp_path, steps=2, mode="lora", callbacks=callbacks)
    assert hasattr(module, "error") == fails
    hooked = [name for name, m in module.policy.named_modules() if m._forward_hooks or m._forward_pre_hooks]
    assert not hooked and module.backend.static is None


@pytest.mark.slow
def test_a_final_save_that_fails_on_rank_0_ends_every_rank(tiny_model, tmp_path):
    """Two processes; rank 0 cannot write final/ (a file of that name is in the way). Rank 1 waited for rank 0 at a
    barrier rank 0 never reached (under NCCL, until the collective's timeout, holding its GPU); now both ranks end,
    rank 1 with a line that points to rank 0's error."""
    from cli_runner import run_esrl
    from conftest import write_tiny_config

    config = write_tiny_config(tmp_path / "c.yaml", tiny_model, max_steps=1, es={"population_size": 4},
                               trainer={"devices": 2, "logger": False})
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "final").write_text("in the way")
    out = run_esrl("fit", "--config", config, "--trainer.default_root_dir", tmp_path / "run", timeout=240)
    assert out.returncode != 0 and "NotADirectoryError" in out.stderr, out.stderr[-3000:]
    line = f"esrl: error [rank 1]: rank 0 could not write {tmp_path / 'run' / 'final'}"
    assert line in out.stderr, out.stderr[-3000:]
    assert (tmp_path / "run" / "final").read_text() == "in the way"
