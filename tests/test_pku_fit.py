"""ES on PKU-SafeRLHF through the real scorer service (`esrl serve-scorer` on 127.0.0.1, tiny random score models
in Safe-RLHF's layout): adaptive lambda logged and checkpointed; the service killed mid-run gives a clean stop with
the weights restored, and a resume from the last checkpoint equals the uninterrupted run."""

from __future__ import annotations

import csv
import json
import math
import os
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import torch
import yaml
from conftest import (ESRL, FIXTURES, ROOT, assert_same_tensors, fit_final, free_port, load_safetensors,
                      run_esrl)

pytestmark = pytest.mark.slow

TOKEN = "pku-test-token"
STEPS = 3
LAMBDA_LR = 0.5


class Service:
    """`esrl serve-scorer` in its own process (so a test can kill it), ready once /health answers."""

    def __init__(self, reward: str, cost: str, port: int):
        self.port = port
        self.proc = subprocess.Popen([*ESRL, "serve-scorer", "--reward-model", reward, "--cost-model", cost,
                                      "--port", str(port), "--token", TOKEN, "--device", "cpu",
                                      "--log-level", "warning"], cwd=ROOT, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"{self.url}/health", timeout=1,
                             headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"scorer service did not start: {self.proc.stdout.read()[-2000:]}")
            time.sleep(0.2)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def service(score_models):
    s = Service(*score_models, free_port())
    yield s
    s.stop()


def pku_config(path: Path, tiny_model: str, url: str, callbacks: list | None = None) -> Path:
    config = {
        "seed_everything": 5,
        "algo": "es",
        "model": {"policy": {"name_or_path": tiny_model},
                  "rollout": {"max_new_tokens": 8},
                  "es": {"population_size": 4, "sigma": 0.05, "alpha": 0.02},
                  "grpo": {"num_generations": 4, "learning_rate": 1e-4, "beta": 0.0}},
        "data": {"task": "pku_saferlhf",
                 "task_args": {"train_path": str(FIXTURES / "pku_train4.jsonl"),
                               "eval_path": str(FIXTURES / "pku_eval2.jsonl"), "num_train": None, "num_eval": None,
                               "scorer": url, "token": TOKEN, "retries": 1, "backoff": 0.1, "timeout": 10,
                               "lambda_init": 1.0, "lambda_adapt": True, "lambda_lr": LAMBDA_LR,
                               "lambda_ema": 0.0},
                 "prompts_per_step": 2, "eval_batch_size": 2},
        "trainer": {"accelerator": "cpu", "devices": 1, "max_steps": STEPS, "enable_progress_bar": False,
                    "enable_model_summary": False,
                    "callbacks": [{"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                                   "init_args": {"every_n_train_steps": 1, "save_top_k": -1,
                                                 "filename": "{step}"}}, *(callbacks or [])]},
    }
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.fixture(scope="module")
def reference_run(tiny_model, service, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("pku_ref")
    return fit_final(pku_config(root / "pku.yaml", tiny_model, service.url), root / "run")


def metric_rows(run_dir: Path) -> list[dict[str, str]]:
    with open(run_dir / "metrics.csv") as f:
        return [r for r in csv.DictReader(f) if r.get("train/lambda")]


def test_es_trains_through_the_scorer_service_with_adaptive_lambda(reference_run):
    run_dir = reference_run.parent.parent
    rows = metric_rows(run_dir)
    assert len(rows) == STEPS
    # lambda of iteration t+1 = exp(log lambda_t + lr * mean cost_t)  (ema 0, d 0, within the clip)
    lam = 1.0
    for r in rows:
        assert float(r["train/lambda"]) == pytest.approx(lam, rel=1e-6)  # the CSV holds float32
        assert 0.0 <= float(r["train/safe_frac"]) <= 1.0
        # fitness = mean raw reward - lambda * mean cost, averaged over the population
        assert float(r["train/reward_mean"]) == pytest.approx(
            float(r["train/raw_reward_mean"]) - lam * float(r["train/cost_mean"]), abs=1e-5)
        lam = math.exp(math.log(lam) + LAMBDA_LR * float(r["train/cost_mean"]))
    assert len({r["train/lambda"] for r in rows}) == STEPS  # it adapted every iteration
    # the checkpoint carries lambda's state
    ckpt = torch.load(run_dir / "checkpoints" / f"step={STEPS}.ckpt", weights_only=True)
    assert ckpt["esrl_lagrangian"]["steps"] == STEPS
    assert ckpt["esrl_lagrangian"]["lambda"] == pytest.approx(lam, rel=1e-6)  # the CSV holds float32
    # evaluation through the same service: safety quadrants on the eval split, before and after
    evals = [json.loads(line) for line in (run_dir / "eval.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [0, STEPS]
    for key in ("reward", "safe", "helpful", "safe_helpful", "safe_unhelpful", "unsafe_helpful",
                "unsafe_unhelpful", "raw_reward", "cost"):
        assert all(key in e for e in evals), key
    quadrants = sum(evals[-1][k] for k in ("safe_helpful", "safe_unhelpful", "unsafe_helpful", "unsafe_unhelpful"))
    assert quadrants == pytest.approx(1.0)


def test_killed_service_stops_cleanly_and_resume_loses_nothing(tiny_model, score_models, reference_run, tmp_path,
                                                                monkeypatch):
    service = Service(*score_models, free_port())
    report = tmp_path / "report.json"
    try:
        kill = {"class_path": "scorer_kill.KillScorerAt",
                "init_args": {"step": 1, "pid": service.proc.pid, "port": service.port, "report": str(report)}}
        monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]))
        out = run_esrl("fit", "--config", pku_config(tmp_path / "kill.yaml", tiny_model, service.url, [kill]),
                       "--trainer.default_root_dir", tmp_path / "killed")
    finally:
        service.stop()
    # one clear line naming the scorer, a non-zero exit, no traceback
    assert out.returncode == 2, out.stderr[-3000:]
    errors = [line for line in out.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and errors[0].startswith(f"esrl: error: scorer {service.url}"), out.stderr[-2000:]
    assert "Traceback" not in out.stderr
    # the failed iteration restored its perturbation before the error left it
    assert json.loads(report.read_text()) == {"exception": "ScorerError", "step": 1, "restored": True}
    killed_dir = next((tmp_path / "killed").rglob("checkpoints")).parent
    # the failure came where the ModelCheckpoint had saved (step 1's start): no second copy (esrl.callbacks.failure)
    assert sorted(p.name for p in (killed_dir / "checkpoints").iterdir()) == ["step=1.ckpt"]

    # the service comes back on the same address; the run resumes from its last checkpoint
    service = Service(*score_models, service.port)
    try:
        resumed = fit_final(pku_config(tmp_path / "resume.yaml", tiny_model, service.url), tmp_path / "resumed",
                            "--ckpt_path",
                            killed_dir / "checkpoints" / "step=1.ckpt")
    finally:
        service.stop()
    ref_dir = reference_run.parent.parent
    assert_same_tensors(load_safetensors(reference_run), load_safetensors(resumed))
    assert (resumed.parent.parent / "seed_log.jsonl").read_text() == (ref_dir / "seed_log.jsonl").read_text()
    ref_lambda = [r["train/lambda"] for r in metric_rows(ref_dir)]
    assert [r["train/lambda"] for r in metric_rows(resumed.parent.parent)] == ref_lambda[1:]


def test_a_run_resumed_at_its_last_step_evaluates_with_the_checkpoints_lambda(tiny_model, service, reference_run,
                                                                             tmp_path):
    """Resumed from its last step's checkpoint (its final evaluation was cut off: a scorer outage, a signal), a run
    trains nothing and Lightning skips the train hooks, where lambda was restored: the final evaluation scored with
    lambda_init. It gives the uninterrupted run's record."""
    ckpt = reference_run.parent.parent / "checkpoints" / f"step={STEPS}.ckpt"
    resumed = fit_final(pku_config(tmp_path / "last.yaml", tiny_model, service.url), tmp_path / "last",
                        "--ckpt_path", ckpt)
    want = json.loads((reference_run.parent.parent / "eval.jsonl").read_text().splitlines()[-1])
    (got,) = [json.loads(line) for line in (resumed.parent.parent / "eval.jsonl").read_text().splitlines()]
    assert got["step"] == want["step"] == STEPS
    assert got["reward"] == want["reward"] and got["raw_reward"] == want["raw_reward"], (got, want)


def test_a_step_that_fails_after_its_update_resumes_with_its_lambda(tiny_model, service, reference_run, tmp_path,
                                                                   monkeypatch):
    """The engine's push after iteration 1's update fails: the update is counted and interrupted.ckpt holds it, but
    lambda adapted after that push, so the checkpoint held the lambda before it and the resumed run trained on
    another fitness. Lambda moves with the update: the resume ends in the uninterrupted run's weights."""
    monkeypatch.setenv("PYTHONPATH", str(FIXTURES))
    out = run_esrl("fit", "--config", pku_config(tmp_path / "fail.yaml", tiny_model, service.url),
                   "--trainer.default_root_dir", tmp_path / "failed",
                   "--trainer.callbacks+=fail_after_update.FailAfterUpdate", "--trainer.callbacks.at=1")
    assert out.returncode != 0 and "after_update failed at iteration 1" in out.stderr, out.stderr[-3000:]
    (ckpt,) = (tmp_path / "failed").rglob("interrupted.ckpt")
    state = torch.load(ckpt, map_location="cpu", weights_only=True)
    assert state["global_step"] == 2 and state["esrl_lagrangian"]["steps"] == 2
    monkeypatch.delenv("PYTHONPATH")
    resumed = fit_final(pku_config(tmp_path / "resume.yaml", tiny_model, service.url), tmp_path / "failed",
                        "--ckpt_path", ckpt)
    assert_same_tensors(load_safetensors(reference_run), load_safetensors(resumed))


def test_grpo_adapts_lambda_from_its_rollouts_costs(tiny_model, service, tmp_path):
    """GRPO trains on per-sample reward - lambda * cost and adapts lambda the same way after each step, logging the
    constraint metrics ES logs (GRPO logged no raw reward or safe fraction: its runs could not be compared on them)."""
    final = fit_final(pku_config(tmp_path / "grpo.yaml", tiny_model, service.url), tmp_path / "run",
                      "--algo", "grpo", "--trainer.max_steps", "2")
    run_dir = final.parent.parent
    rows = metric_rows(run_dir)
    assert len(rows) == 2
    with open(run_dir / "metrics.csv") as f:  # GRPO logs the rewards' statistics in a row of their own
        reward_mean = {r["step"]: r["train/reward_mean"] for r in csv.DictReader(f) if r.get("train/reward_mean")}
    lam = 1.0
    for r in rows:
        assert float(r["train/lambda"]) == pytest.approx(lam, rel=1e-6)  # the CSV holds float32
        assert 0.0 <= float(r["train/safe_frac"]) <= 1.0
        # the rewards trained on: raw reward - lambda * cost per sample, so their mean is the same of the means
        assert float(reward_mean[r["step"]]) == pytest.approx(
            float(r["train/raw_reward_mean"]) - lam * float(r["train/cost_mean"]), abs=1e-5)
        lam = math.exp(math.log(lam) + LAMBDA_LR * float(r["train/cost_mean"]))
    ckpt = torch.load(run_dir / "checkpoints" / "step=2.ckpt", weights_only=True)
    assert ckpt["esrl_lagrangian"]["steps"] == 2
    assert ckpt["esrl_lagrangian"]["lambda"] == pytest.approx(lam, rel=1e-6)


def test_env_asks_the_service_with_the_token_a_fit_sends(service, tiny_model, tmp_path, monkeypatch):
    """`esrl env --config` once called a running, token-protected service missing (its /health answered 401 to a
    request without the token) and advised starting it: it now sends the config's or the environment's token, and
    a refused or absent token is named as such."""
    from esrl import needs

    for name in ("ESRL_SCORER_TOKEN", "ESRL_SCORER_TOKEN_FILE"):
        monkeypatch.delenv(name, raising=False)
    config = yaml.safe_load(pku_config(tmp_path / "pku.yaml", tiny_model, service.url).read_text())

    def scorer_need():
        (need,) = [n for n in needs.remote_needs(config) if n.field.startswith("data.task_args.scorer")]
        return need

    assert scorer_need().status == needs.OK  # the config's token
    del config["data"]["task_args"]["token"]
    need = scorer_need()
    assert need.status == needs.MISSING and "it answers 401: it wants a token; set ESRL_SCORER_TOKEN" in need.fix
    monkeypatch.setenv("ESRL_SCORER_TOKEN", TOKEN)
    assert scorer_need().status == needs.OK
    monkeypatch.setenv("ESRL_SCORER_TOKEN", "wrong")
    assert "the token is refused" in scorer_need().fix
    service_down = {**config, "data": {**config["data"], "task_args": {**config["data"]["task_args"],
                                                                          "scorer": f"http://127.0.0.1:{free_port()}"}}}
    (down,) = [n for n in needs.remote_needs(service_down) if n.field.startswith("data.task_args.scorer")]
    assert down.status == needs.MISSING and down.fix.startswith("start it: esrl serve-scorer")


def test_a_fit_whose_scorer_is_down_is_one_line_before_any_model_loads(tiny_model, tmp_path):
    """The scorer is asked once (GET /health, the config's retries) before the policy loads: with a 7B policy the
    user heard of a scorer that is down only after the whole load, and an empty run folder was left behind."""
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens
    out = run_esrl("fit", "--config", pku_config(tmp_path / "pku.yaml", tiny_model, url),
                   "--trainer.default_root_dir", tmp_path / "run")
    assert out.returncode != 0 and "Traceback" not in out.stderr, out.stderr[-3000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("esrl: error:")]
    assert len(errors) == 1, out.stderr[-3000:]
    assert errors[0].startswith(f"esrl: error: data.task_args.scorer: scorer {url}/health: unreachable after 2 "
                                "attempts (ConnectError")
    assert errors[0].endswith("start it: esrl serve-scorer --reward-model ... --port ...")
    assert not (tmp_path / "run").exists()  # nothing built: no run folder, no model loaded
