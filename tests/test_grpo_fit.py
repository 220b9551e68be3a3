"""GRPO through the real CLI and Lightning Trainer (`--algo grpo`): outputs, determinism, bad config."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import FIXTURES, assert_same_tensors, fit_final, load_safetensors, run_esrl, write_tiny_config

pytestmark = pytest.mark.slow

STEPS = 3


@pytest.fixture(scope="module")
def grpo_config(tiny_model, tmp_path_factory) -> Path:
    """A tiny GRPO run that goes through every branch of a step: a frozen reference (beta > 0), two
    optimizer steps per rollout batch (old log-probs, clipping) and the default linear LR schedule."""
    return write_tiny_config(
        tmp_path_factory.mktemp("cfg") / "grpo_tiny.yaml", tiny_model, prompts_per_step=2, max_steps=STEPS,
        rollout={"temperature": 1.0}, es={"population_size": 4},  # algo: es; --algo grpo swaps it, as a user would
        grpo={"num_generations": 4, "learning_rate": 1e-3, "beta": 0.04, "num_iterations": 2})


def fit(config: Path, root: Path, *extra: str) -> Path:
    return fit_final(config, root, "--algo", "grpo", *extra)


@pytest.fixture(scope="module")
def reference_run(grpo_config, tmp_path_factory) -> Path:
    return fit(grpo_config, tmp_path_factory.mktemp("run_a"))


def test_fit_writes_final_model_and_logs(reference_run):
    run_dir = reference_run.parent.parent
    assert (run_dir / "final" / "config.json").is_file()
    assert not (run_dir / "seed_log.jsonl").exists()  # the ES seed log is ES's alone
    header = (run_dir / "metrics.csv").read_text().splitlines()[0].split(",")
    for key in ("train/reward_mean", "train/reward_std", "train/advantage_abs_mean", "train/kl",
                "train/clip_ratio/region_mean", "train/completion_length_mean", "train/grad_norm", "train/lr",
                "time/rollout", "time/reward", "time/logps", "time/update", "eval/reward"):
        assert key in header, key


def test_two_runs_with_one_seed_give_identical_weights(grpo_config, reference_run, tmp_path):
    again = fit(grpo_config, tmp_path)
    assert_same_tensors(load_safetensors(reference_run), load_safetensors(again))


def test_weights_move(tiny_model, reference_run):
    base = load_safetensors(Path(tiny_model) / "model.safetensors")
    final = load_safetensors(reference_run)
    assert base.keys() == final.keys()
    assert all(not (base[k] == final[k]).all() for k in base if k.endswith("q_proj.weight"))


@pytest.mark.parametrize(("flag", "value", "field"), [
    ("--model.grpo.num_generations", "1", "model.grpo.num_generations"),
    ("--model.grpo.beta", "-1", "model.grpo.beta"),
    ("--model.grpo.loss_type", "ppo", "model.grpo.loss_type"),
    ("--trainer.strategy", "ddp_spawn", "trainer.strategy"),  # its child crashed unpickling the CLI's module class
    pytest.param("--trainer.strategy", "deepspeed_stage_2", "trainer.strategy", marks=pytest.mark.skipif(
        torch.cuda.is_available(), reason="the check only fires without a CUDA GPU or deepspeed")),
])
def test_bad_grpo_config_is_one_line_naming_the_field(grpo_config, tmp_path, flag, value, field):
    out = run_esrl("fit", "--config", grpo_config, "--algo", "grpo", "--trainer.default_root_dir", tmp_path,
                   flag, value)
    assert out.returncode != 0
    errors = [line for line in out.stderr.splitlines() if line.startswith("esrl: error:")]
    assert len(errors) == 1 and field in errors[0], out.stderr
    assert "Traceback" not in out.stderr
    assert not list(tmp_path.rglob("final"))


def test_micro_batches_follow_lightnings_accumulation_windows(grpo_config, tmp_path, monkeypatch):
    """accumulate_grad_batches 2, 1 prompt per micro-batch, 3 prompts an epoch: one window of 2 prompts per epoch
    (the third, a window not full, is skipped that epoch, as TRL's RepeatSampler skips it), so the micro-batch
    index restarts with every optimizer step and every epoch. Both micro-batches roll out at the window's first
    one, before its first backward, each on its own prompt of the window. With num_iterations 2 the rollouts are
    made on steps 0 and 2 (micro-batches 0 and 1) and reused, by micro-batch index, on steps 1 and 3."""
    from esrl.cli import EsrlCLI
    from esrl.data import PromptDataModule
    from esrl.module_factory import build_module

    cli = EsrlCLI(build_module, PromptDataModule, run=False, args=[
        "--config", str(grpo_config), "--algo", "grpo", "--trainer.accumulate_grad_batches", "2",
        "--data.prompts_per_step", "1", "--trainer.max_steps", "4", "--trainer.default_root_dir", str(tmp_path)])
    module, made, steps = cli.model, [], []
    sample, training_step = module.sample, module.training_step

    def recording(rows, micro_batch):
        made.append((module.global_step, micro_batch, [row["question"] for row in rows]))
        return sample(rows, micro_batch)

    def stepping(batch, batch_idx):
        steps.append((module.global_step, batch_idx, [row["question"] for row in batch["rows"]]))
        return training_step(batch, batch_idx)

    monkeypatch.setattr(module, "sample", recording)
    monkeypatch.setattr(module, "training_step", stepping)
    cli.trainer.fit(module, cli.datamodule)
    assert cli.trainer.global_step == 4
    assert [m[:2] for m in made] == [(0, 0), (0, 1), (2, 0), (2, 1)]
    # every micro-batch of a window is served the window's 2 prompts; micro-batch k rolls out prompt k of them
    assert [(step, idx) for step, idx, _ in steps] == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1), (3, 0), (3, 1)]
    for step, idx, prompts in steps:
        assert len(prompts) == 2 and prompts == steps[step * 2][2]
    for step, k, prompts in made:
        assert prompts == [steps[step * 2][2][k]]
    assert steps[0][2] != steps[4][2]  # the next epoch reshuffles
    # beta > 0: the frozen reference was used, and it is neither a child module nor in the checkpointed state
    assert module.reference is not None and module.reference.model not in list(module.modules())
    assert set(module.state_dict()) == {f"policy.{k}" for k in module.policy.state_dict()}


def test_accumulated_dapo_step_has_trls_gradient(grpo_config, tmp_path, monkeypatch):
    """Two micro-batches of unequal token counts (stop strings cut completions at varying lengths): the gradient
    the backward passes accumulate is TRL's dapo one, every token of the step weighted 1 / (the step's tokens),
    recomputed here from the step's own rollouts; each micro-batch normalized by its own tokens would differ. It is
    checked before the module's own on_before_optimizer_step: nothing rescales gradients after the backwards, so
    the same holds where DeepSpeed owns the gradient buffers."""
    from esrl.cli import EsrlCLI
    from esrl.data import PromptDataModule
    from esrl.grpo import GRPOLoss
    from esrl.models.logps import per_token_logps
    from esrl.module_factory import build_module

    cli = EsrlCLI(build_module, PromptDataModule, run=False, args=[
        "--config", str(grpo_config), "--algo", "grpo", "--trainer.accumulate_grad_batches", "2",
        "--data.prompts_per_step", "1", "--trainer.max_steps", "1", "--model.grpo.beta", "0", "--model.grpo.num_iterations", "1",
        "--model.rollout.stop", '["e", "a", "o"]', "--trainer.default_root_dir", str(tmp_path)])
    module, checked = cli.model, []
    hook = module.on_before_optimizer_step

    def checking(optimizer):
        rollouts = module._rollouts
        tokens = [r.completion_mask.sum() for r in rollouts]
        assert len(rollouts) == 2 and tokens[0] != tokens[1], tokens
        params = [p for p in module.policy.parameters() if p.requires_grad]
        with torch.enable_grad():
            loss = sum(GRPOLoss()(per_token_logps(module.policy, r.input_ids, r.attention_mask, r.completion_width,
                                                  module.rollout_config.temperature),
                                  None, r.advantages, r.completion_mask, num_items_in_batch=sum(tokens))[0]
                       for r in rollouts)
            expected = torch.autograd.grad(loss, params)
        for p, g in zip(params, expected):
            torch.testing.assert_close(p.grad, g, rtol=1e-4, atol=1e-7)
        checked.append(float(module._num_items))
        hook(optimizer)

    monkeypatch.setattr(module, "on_before_optimizer_step", checking)
    cli.trainer.fit(module, cli.datamodule)
    assert len(checked) == 1


@pytest.mark.parametrize("num_iterations, stop, devices", [(1, "ModelCheckpoint", 1), (2, "SIGTERM", 1),
                                                           (2, "ModelCheckpoint", 2)])
def test_accumulated_run_resumed_from_a_checkpoint_equals_uninterrupted(tiny_model, tmp_path_factory, tmp_path,
                                                                        monkeypatch, num_iterations, stop, devices):
    """accumulate_grad_batches 2 (dapo, windows rolled out whole): a run resumed from step 1's checkpoint continues
    with the same windows, seeds and token counts, and ends with the uninterrupted run's weights. num_iterations 2:
    step 1 trains on step 0's rollouts (old log-probs of step 0's weights), so the checkpoint (ModelCheckpoint's, or
    interrupted.ckpt after a SIGTERM) holds them; without them the resumed run sampled a fresh batch for step 1.
    Two processes: each one's own rollouts (rank 0 wrote its own alone, and rank 1 trained on them). The SIGTERM
    case resumes from both checkpoints, ModelCheckpoint's step=1.ckpt first, against one uninterrupted run."""
    config = write_tiny_config(
        tmp_path_factory.mktemp("cfg") / "grpo_acc.yaml", tiny_model, prompts_per_step=1, max_steps=3,
        rollout={"temperature": 1.0, "stop": ["e", "a", "o"]},
        grpo={"num_generations": 4, "learning_rate": 1e-3, "beta": 0.0, "num_iterations": num_iterations},
        trainer={"accumulate_grad_batches": 2, "enable_checkpointing": True,
                 "callbacks": [{"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                                "init_args": {"every_n_train_steps": 1, "save_top_k": -1, "filename": "{step}"}}]})
    procs = ("--trainer.devices", str(devices))
    whole = fit(config, tmp_path / "whole", *procs)
    checkpoints = [next((tmp_path / "whole").rglob("checkpoints/step=1.ckpt"))]
    if stop == "SIGTERM":  # stops after step 0's optimizer step (esrl.callbacks.interruption)
        monkeypatch.setenv("PYTHONPATH", str(FIXTURES))
        out = run_esrl("fit", "--config", config, "--algo", "grpo", "--trainer.default_root_dir", tmp_path / "stop",
                       "--trainer.callbacks+=signal_at_step.SignalAtStep", "--trainer.callbacks.at=0")
        assert out.returncode == 143, out.stderr[-3000:]
        checkpoints.append(next((tmp_path / "stop").rglob("checkpoints/interrupted.ckpt")))
    for i, ckpt in enumerate(checkpoints):
        assert torch.load(ckpt, map_location="cpu", weights_only=True)["global_step"] == 1  # rollouts: plain tensors
        resumed = fit(config, tmp_path / f"resumed{i}", "--ckpt_path", str(ckpt), *procs)
        assert_same_tensors(load_safetensors(whole), load_safetensors(resumed))
    if devices == 2:  # another number of processes cannot share the window's rollouts out: one line
        out = run_esrl("fit", "--config", config, "--algo", "grpo", "--trainer.default_root_dir", tmp_path / "one",
                       "--ckpt_path", ckpt)
        assert out.returncode == 2 and "saved inside a num_iterations window on 2 process(es)" in out.stderr


EVALUATION_LOADS = """
import sys
import esrl.models
loads, load = [], esrl.models.load_causal_lm  # the name the evaluation's KL loads the base with
esrl.models.load_causal_lm = lambda *args, **kwargs: loads.append(args) or load(*args, **kwargs)
from esrl.cli import main
try:
    main(sys.argv[1:])
finally:
    print("EVALUATION_LOADS", len(loads), flush=True)
"""


@pytest.mark.parametrize("algo, lora, loads", [("grpo", False, 0), ("es", False, 1), ("grpo", True, 0),
                                               ("es", True, 0)])
def test_the_evaluation_kl_reads_grpos_reference_not_a_second_copy(tiny_model, tmp_path, algo, lora, loads):
    """GRPO with beta > 0 holds the base weights (its KL reference) on the device; the evaluation's KL once loaded
    another copy (a 7B model's 14-28 GB more per GPU). It reads the reference now; ES, which holds none, loads it.
    A LoRA run of either (its base never trains) reads the policy with its adapter off: it loaded a copy too.
    Either way the KL is to the base: 0 before the first step, above 0 after it."""
    import json
    import subprocess
    import sys

    from conftest import ROOT

    config = write_tiny_config(tmp_path / "c.yaml", tiny_model, max_steps=1,
                               es={"population_size": 2, "sigma": 0.05, "alpha": 0.02},
                               grpo={"num_generations": 2, "beta": 0.04, "learning_rate": 1e-2},
                               trainer={"callbacks": [{"class_path": "esrl.callbacks.Evaluation",
                                                       "init_args": {"num_samples": 2, "kl": True}}]})
    adapter = {"es": ["--model.es.mode", "lora", "--model.es.lora_rank", "2"],
               "grpo": ["--model.grpo.lora", "{rank: 2, alpha: 4}", "--model.grpo.learning_rate", "3e-1"]}[algo]
    done = subprocess.run([sys.executable, "-c", EVALUATION_LOADS, "fit", "--config", str(config), "--algo", algo,
                           "--trainer.default_root_dir", str(tmp_path), *(adapter if lora else [])], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and f"EVALUATION_LOADS {loads}\n" in done.stdout, \
        done.stdout[-2000:] + done.stderr[-3000:]
    evals = [json.loads(line) for line in next(tmp_path.rglob("eval.jsonl")).read_text().splitlines()]
    assert evals[0]["kl"] == 0.0 and evals[-1]["kl"] > 0.0


@pytest.mark.parametrize("shares", [True, False])
def test_a_sleeping_engine_sleeps_once_a_window_after_all_its_samples(grpo_config, tmp_path, monkeypatch, shares):
    """rollout.vllm_sleep (vLLM on a GPU only, so a fake here: the HF engine declaring `sleeps` and recording its
    calls): a window of 2 micro-batches (kept for num_iterations 2 steps) samples both, then sleeps once, before any
    log-probs. Each micro-batch's sample once slept and the next woke the engine: a weights offload and reload per
    micro-batch. An engine with its own weights (shares False) is woken by each step's push: it sleeps again where
    the next step reuses the window (it stayed awake through the reused steps' backwards)."""
    from esrl.cli import EsrlCLI
    from esrl.data import PromptDataModule
    from esrl.module_factory import build_module
    from esrl.rollout import EngineCapabilities, HFEngine

    calls = []
    generate = HFEngine.generate
    monkeypatch.setattr(HFEngine, "capabilities", property(lambda self: EngineCapabilities(
        shares_policy_weights=shares, row_adapters=False, sleeps=True)))
    monkeypatch.setattr(HFEngine, "sleep", lambda self: calls.append("sleep"))
    monkeypatch.setattr(HFEngine, "load_weights", lambda self, named: calls.append("push"), raising=False)
    monkeypatch.setattr(HFEngine, "generate", lambda self, *a, **k: calls.append(
        "sample" if not k.get("greedy", True) else "eval") or generate(self, *a, **k))
    cli = EsrlCLI(build_module, PromptDataModule, run=False, args=[
        "--config", str(grpo_config), "--algo", "grpo", "--trainer.accumulate_grad_batches", "2",
        "--data.prompts_per_step", "1", "--trainer.max_steps", "4", "--trainer.default_root_dir", str(tmp_path)])
    logps = cli.model.reference_logps
    monkeypatch.setattr(cli.model, "reference_logps", lambda *a: calls.append("logps") or logps(*a))
    cli.trainer.fit(cli.model, cli.datamodule)
    trained = [c for c in calls if c != "eval"]
    window = ["sample", "sample", "sleep"] + ["logps"] * 2 * (cli.model.grpo.beta > 0)
    assert cli.model.grpo.num_iterations == 2
    assert trained == (window if shares else window + ["push", "sleep", "push"]) * 2, calls


def test_per_token_logps_refuses_to_score_the_first_token(tiny_model):
    """No position comes before the first token: logits_to_keep == length wrapped to the last position's logits."""
    from esrl.models import load_causal_lm
    from esrl.models.logps import per_token_logps

    ids = torch.tensor([[5, 6, 7, 8, 9]])
    model = load_causal_lm(tiny_model)
    assert per_token_logps(model, ids, torch.ones_like(ids), 4).shape == (1, 4)
    with pytest.raises(ValueError, match=r"logits_to_keep 5: must be in \[1, 4\] for 5 tokens"):
        per_token_logps(model, ids, torch.ones_like(ids), 5)


def test_esrl_validate_on_two_processes_gives_one_process_numbers(tiny_model, tmp_path):
    """3 evaluation prompts over GRPO's 2 processes: Lightning's DistributedSampler padded them to 4, the first
    counted twice in the mean; every process now evaluates every row, as ES and the Evaluation callback do."""
    import re

    config = write_tiny_config(tmp_path / "validate.yaml", tiny_model)
    train3 = str(FIXTURES / "conciseness_train3.jsonl")
    rewards = []
    for devices in ("1", "2"):
        out = run_esrl("validate", "--config", config, "--algo", "grpo", "--data.task_args.eval_path", train3,
                       "--trainer.devices", devices, "--trainer.default_root_dir", tmp_path / devices)
        assert out.returncode == 0, out.stderr[-3000:]
        rewards.append(re.search(r"eval/reward\s*│\s*(-?[\d.]+)", out.stdout + out.stderr).group(1))
    assert rewards[0] == rewards[1]


def test_a_reused_window_logs_its_rewards_once_as_trl(reference_run):
    """num_iterations 2: a window sampled at step 0 trains steps 0 and 1. TRL logs a generation's reward, length and
    advantage metrics on the step that generates it only; logged again on the reuse step, a mean over steps would
    count each rollout twice (and bad_rewards twice). The loss's metrics (kl, clip ratios) come every step."""
    import csv

    with (reference_run.parent.parent / "metrics.csv").open() as f:
        rows = list(csv.DictReader(f))

    def steps_with(key):
        return [int(r["step"]) for r in rows if r.get(key, "") != ""]

    assert steps_with("train/kl") == list(range(STEPS)) and STEPS > 2
    for key in ("train/reward_mean", "train/bad_rewards", "train/completion_length_mean"):
        assert steps_with(key) == list(range(0, STEPS, 2)), key
