"""Shared fixtures: a tiny random Llama with the real SmolLM2 tokenizer, and a CLI runner."""

from __future__ import annotations

import os
import socket
from pathlib import Path

# Before the imports below: huggingface_hub reads HF_HUB_OFFLINE once, when lightning's imports first load it (under
# pytest-xdist the workers inherited it from the controller; one process, `make test TEST_WORKERS=1`, did not).
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never touch the network
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import lightning as L  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from cli_runner import CALLS, ESRL, ROOT, run_esrl, stop_server  # noqa: E402, F401 (ESRL, ROOT, run_esrl: tests')

FIXTURES = Path(__file__).parent / "fixtures"
SMALL_VLLM = {"max_model_len": 256, "kv_cache_memory_bytes": 64 << 20}  # vllm_kwargs: a tiny model needs little cache
CONCISENESS_FILES = {"train_path": str(FIXTURES / "conciseness_train3.jsonl"),  # 3 train prompts
                     "eval_path": str(FIXTURES / "conciseness_eval2.jsonl")}  # 2 eval prompts


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    from esrl.models import tiny_llama

    return tiny_llama(tmp_path_factory.mktemp("tiny") / "llama")


@pytest.fixture(scope="session")
def score_models(tmp_path_factory) -> tuple[str, str]:
    """Tiny random reward and cost models in Safe-RLHF's score-model layout (SmolLM2's tokenizer)."""
    from esrl.models import load_tokenizer
    from esrl.models.tiny import tiny_score_model

    root = tmp_path_factory.mktemp("score")
    tok = load_tokenizer("smollm2-135m-instruct")
    return (tiny_score_model(root / "reward", seed=1, score_type="reward", tokenizer=tok),
            tiny_score_model(root / "cost", seed=2, score_type="cost", tokenizer=tok))


@pytest.fixture
def tiny_lm(tiny_model):
    from esrl.models import load_causal_lm

    return load_causal_lm(tiny_model)


def conciseness_data(prompts_per_step: int = 1):
    """The conciseness fixtures as a data module that serves its prompts in file order."""
    from esrl.data import PromptDataModule

    return PromptDataModule("conciseness", dict(CONCISENESS_FILES), prompts_per_step=prompts_per_step, shuffle=False)


class FailAt(L.Callback):
    """Makes `target(module)`'s `name` raise `error` once trainer.global_step reaches `step` (`when(*args)` narrows
    the calls; an iteration's update counts its step before the calls after it); `after`: the call runs first, then
    raises (a failure part way through it, its work done)."""

    def __init__(self, target, name: str, step: int, when=lambda *a: True, error: type[Exception] = RuntimeError,
                 after: bool = False):
        self.target, self.name, self.step, self.when, self.error = target, name, step, when, error
        self.after = after

    def on_train_start(self, trainer, module):
        obj = self.target(module)
        method = getattr(obj, self.name)

        def failing(*args, **kwargs):
            if trainer.global_step >= self.step and self.when(*args):
                if self.after:
                    method(*args, **kwargs)
                raise self.error(f"{self.name} failed (injected)")
            return method(*args, **kwargs)

        setattr(obj, self.name, failing)


def write_tiny_config(path: Path, model: str, *, seed: int = 3, prompts_per_step: int = 1, max_steps: int = 2,
                      rollout: dict | None = None, es: dict | None = None, grpo: dict | None = None,
                      trainer: dict | None = None) -> Path:
    """A `esrl fit` YAML for the tests' tiny runs: the conciseness fixtures (3 train, 2 eval prompts) on `model`
    on CPU, no progress bar, no summary, no checkpoints unless `trainer` says otherwise; the given sections
    are merged over those defaults."""
    import yaml

    model_section = {"policy": {"name_or_path": str(model)}, "rollout": {"max_new_tokens": 6, **(rollout or {})}}
    model_section.update({k: v for k, v in (("es", es), ("grpo", grpo)) if v is not None})
    config = {
        "seed_everything": seed,
        "algo": "es",
        "model": model_section,
        "data": {"task": "conciseness",
                 "task_args": dict(CONCISENESS_FILES),
                 "prompts_per_step": prompts_per_step},
        "trainer": {"accelerator": "cpu", "devices": 1, "max_steps": max_steps, "enable_progress_bar": False,
                    "enable_model_summary": False, "enable_checkpointing": False, **(trainer or {})},
    }
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.fixture(scope="session", autouse=True)
def _cli_server():
    yield
    stop_server()


LONGEST_FIRST = ("test_resume_slurm.py", "test_resume.py", "test_grpo_fit.py", "test_study.py", "test_vllm_es.py",
                 "test_vllm_engine.py", "test_vllm_lowrank.py", "test_es_fit.py", "test_pku_fit.py",
                 "test_cli_errors.py", "test_analysis.py", "test_study_interrupt.py", "test_elo.py",
                 "test_failure_checkpoint.py", "test_lowrank_kernel.py")
"""The files that took longest (`pytest --durations`, 2 cores), in that order. `make test` hands whole files to its
workers in collection order (--no-loadscope-reorder; pytest-xdist's own order, by test count, left the longest for
last, and one worker ran them while the others idled). A stale entry costs minutes, never a result."""


def pytest_collection_modifyitems(items) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep pytest's order


def pytest_sessionfinish(session) -> None:
    """Under pytest-xdist (`make test`), a worker hands its calls' count to the controller, which prints them."""
    if hasattr(session.config, "workeroutput"):
        session.config.workeroutput["esrl_calls"] = dict(CALLS)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:  # pytest-xdist's hook, in the controller
    CALLS.update(getattr(node, "workeroutput", {}).get("esrl_calls", {}))


def pytest_terminal_summary(terminalreporter) -> None:
    """How the `esrl` calls ran: a call in a fresh interpreter costs its imports (~8 s on the CI machine)."""
    if CALLS:
        terminalreporter.write_line("esrl CLI calls: " + "; ".join(f"{n} {how}" for how, n in CALLS.most_common()))


def fit_final(config: Path, root: Path, *extra: str) -> Path:
    """`esrl fit` a config into root; the path of the one final/model.safetensors it must leave."""
    out = run_esrl("fit", "--config", config, "--trainer.default_root_dir", root, *extra)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    finals = list(root.rglob("final/model.safetensors"))
    assert len(finals) == 1, finals
    return finals[0]


def assert_batched_equals_member_by_member(engine, prompts, members, population_of, perturber,
                                           max_new_tokens: int = 8) -> None:
    """Greedy completions of ONE population-batched generate equal, member by member, those of the engine with
    that member's perturbation written into the weights (`perturber.perturbed`); and the members really differ."""
    batched = engine.generate_population(prompts, len(members), population_of, max_new_tokens=max_new_tokens)
    for i, m in enumerate(members):
        with perturber.perturbed(m):
            single = engine.generate(prompts, max_new_tokens=max_new_tokens, greedy=True)
        assert [c.token_ids for c in batched[i]] == [c.token_ids for c in single], f"member {i}"
    assert len({tuple(batched[i][-1].token_ids) for i in range(len(members))}) > 1


def written_out_update(selection, spec, members, z: torch.Tensor, alpha: float) -> list[torch.Tensor]:
    """The paper's update written out: theta + alpha (1/N) sum_i z_i (theta_i - theta) / sigma, each theta_i read off
    a copy of the weights with member i's perturbation written in (Perturber), whatever the noise mode."""
    from esrl.es import Perturber

    theta = [p.detach().clone() for p in selection.params]
    perturber = Perturber(selection, spec)
    copies = []
    for m in members:
        with perturber.perturbed(m):
            copies.append([p.detach().clone() for p in selection.params])
    n = len(members)
    return [t + alpha * sum(float(z[i]) * (copies[i][k] - t) / spec.sigma for i in range(n)) / n
            for k, t in enumerate(theta)]


def load_safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


def assert_same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"tensor {k} differs (max abs diff {(a[k] - b[k]).abs().max():.3g})"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def loaded(score_models):
    """The reward and cost models (ScoreModel), loaded once for the module."""
    from esrl.scoring.score_model import ScoreModel

    return ScoreModel(score_models[0], device="cpu", batch_size=3), ScoreModel(score_models[1], device="cpu")


@pytest.fixture(scope="module")
def scorer(loaded):
    """The Safe-RLHF reward and cost models as one ScoreModelScorer."""
    from esrl.scoring.score_model import ScoreModelScorer

    return ScoreModelScorer(*loaded)
