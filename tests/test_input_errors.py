"""Mistakes a newcomer makes, each one line naming its culprit (and exit 2 from the command line)."""

from __future__ import annotations

import json
import shutil
import textwrap
from pathlib import Path

import pytest

from conftest import ROOT, run_esrl
from esrl.errors import ConfigError, DataError, EsrlError, RewardError


def _one_error(out) -> str:
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-3000:]
    (line,) = [x for x in out.stderr.splitlines() if x.startswith("esrl: error")]
    return line


@pytest.mark.parametrize("remove, message", [
    (lambda p: [f.unlink() for f in p.glob("*") if "token" in f.name or f.suffix in (".jinja", ".txt")]
     or None, "no tokenizer files in"),
    (lambda p: (p / "model.safetensors").unlink(), "no weights in"),
])
def test_a_model_folder_lacking_its_tokenizer_or_weights_says_which(tiny_model, tmp_path, remove, message):
    """transformers blamed a missing sentencepiece package, or a hub copy, for a local folder missing files."""
    from esrl.models import load_causal_lm, load_tokenizer

    folder = tmp_path / "model"
    shutil.copytree(tiny_model, folder)
    remove(folder)
    with pytest.raises(EsrlError, match=f"^model '{folder}': {message} {folder}"):
        load_causal_lm(str(folder)) if "weights" in message else load_tokenizer(str(folder))
    with pytest.raises(EsrlError, match=r"a file; give the model's folder"):
        load_causal_lm(str(Path(tiny_model) / "model.safetensors"))


def test_a_reward_module_that_fails_to_import_is_named_with_its_line(tmp_path, monkeypatch):
    from esrl.tasks.jsonl import import_function

    (tmp_path / "broken_rewards.py").write_text("def length(prompts, completions\n    return []\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match=r"cannot import 'broken_rewards:length' \(SyntaxError at .*"
                                          r"broken_rewards.py:1: "):
        import_function("broken_rewards:length")
    with pytest.raises(ConfigError, match=r"No module named 'my_rewards'\); a module in the current folder is found "
                                          r"only with the folder on PYTHONPATH"):
        import_function("my_rewards:length")


def test_a_reward_function_that_raises_is_one_line_naming_it():
    """A function without TRL's keywords (its TypeError) or with a bug of its own stops the run naming it."""
    from esrl.tasks.base import Task

    def length(completions):
        return [1.0 for _ in completions]

    rows = [{"prompt": "a"}]
    with pytest.raises(RewardError, match=r"^reward function length raised TypeError: .*'prompts' \(reward "
                                          r"and metric functions take f\(prompts, completions, \*\*kwargs\)"):
        Task("t", [], [], reward_funcs=[length]).rewards(rows, ["x"])
    with pytest.raises(RewardError, match=r"^reward function <lambda> raised ZeroDivisionError"):
        Task("t", [], [], reward_funcs=[lambda prompts, completions, **_: [1 / 0]]).rewards(rows, ["x"])


def test_an_option_a_task_does_not_take_is_named_with_what_it_takes():
    from esrl.tasks import build_task

    with pytest.raises(ConfigError, match=r"^data.task_args.train_pth: task 'jsonl' has no option 'train_pth' "
                                          r"\(did you mean train_path\?\); it takes train_path, eval_path"):
        build_task("jsonl", train_pth="x.jsonl")
    with pytest.raises(ConfigError, match=r"^data.task_args.train_path: task 'jsonl' needs it"):
        build_task("jsonl")


@pytest.mark.parametrize("task,options,message", [
    ("countdown", {"num_train": 1.5}, "data.task_args.num_train: expected int, got 1.5"),  # was a slice's error
    ("countdown", {"num_train": True}, "data.task_args.num_train: expected int, got True"),
    ("countdown", {"num_train": 5, "num_eval": 400, "num_numbers": 2, "max_number": 3},  # blamed `generate` before
     "data.task_args.num_eval: cannot find 400 distinct problems"),
    ("math", {"format_weight": "0.1"}, "data.task_args.format_weight: expected float, got '0.1'"),
    ("jsonl", {"train_path": "x", "reward_funcs": [1]},
     "data.task_args.reward_funcs: expected a list of str, got [1]"),
    ("jsonl", {"train_path": "x", "reward_funcs": "m:f", "stop": 5},
     "data.task_args.stop: expected a list of str, got 5"),
    ("mymod:build", {}, "data.task: cannot import 'mymod:build' (No module named 'mymod')"),  # was a traceback
    ("esrl.tasks.conciseness:nothing", {}, "data.task: cannot import 'esrl.tasks.conciseness:nothing' "
                                           "('esrl.tasks.conciseness' has no 'nothing')"),
    ("esrl.tasks.conciseness:completion_text", {"completion": "x"},
     "data.task: 'esrl.tasks.conciseness:completion_text' returned str, not an esrl.tasks.Task"),
])
def test_a_task_option_of_the_wrong_type_or_a_task_path_that_does_not_import_is_named(task, options, message):
    from esrl.tasks import build_task

    with pytest.raises(ConfigError) as err:
        build_task(task, **options)
    assert str(err.value).startswith(message)


def test_the_option_types_check_takes_paths_and_skips_builders_it_cannot_read():
    """A Path where a builder takes a str path (from Python code), a functools.partial builder, and annotations
    naming a type only imported for type checkers: checked where readable, never a traceback of their own."""
    import functools
    from pathlib import Path

    from esrl.tasks import check_option_types, conciseness

    check_option_types(conciseness.build, {"path": Path("x.jsonl"), "num_train": 2})
    check_option_types(functools.partial(conciseness.build, num_eval=1), {"num_train": "2"})

    def unreadable(num_train: "NotImported" = 1):  # noqa: F821
        pass

    check_option_types(unreadable, {"num_train": "2"})
    with pytest.raises(ConfigError, match="^data.task_args.num_train: expected int"):
        check_option_types(conciseness.build, {"num_train": "2"})


def test_an_infinite_or_nan_config_number_is_named():
    """`sigma: .inf` passed `sigma > 0` and trained on noise of infinite size (NaN fails comparisons silently)."""
    from esrl.es.config import ESConfig
    from esrl.grpo.config import GRPOConfig

    with pytest.raises(ConfigError, match=r"^model.es.sigma: must be a finite number, got inf$"):
        ESConfig(sigma=float("inf")).validate()
    with pytest.raises(ConfigError, match=r"^model.grpo.beta: must be a finite number, got nan$"):
        GRPOConfig(beta=float("nan")).validate()


def test_a_seed_log_cut_in_its_header_and_a_negative_step_are_named(tmp_path):
    from esrl.es.seed_log import read_seed_log

    log = tmp_path / "seed_log.jsonl"
    log.write_text('{"format": "esrl-seed-log/1", "noise_se\n')
    with pytest.raises(DataError, match=r":1: the seed log's header is not valid JSON \(cut short\?\)"):
        read_seed_log(log)
    log.write_text(json.dumps({"format": "esrl-seed-log/1"}) + "\n")
    with pytest.raises(DataError, match=r"^--step -1: must be >= 0"):
        read_seed_log(log, -1)


def test_a_model_folder_given_as_ckpt_path_says_how_to_start_from_it(tiny_model):
    from esrl.checkpoints import check_ckpt_path

    with pytest.raises(DataError, match="It holds a Hugging Face model .*--model.policy.name_or_path"):
        check_ckpt_path(tiny_model)


@pytest.mark.parametrize("argv, message", [
    (["analysis", "all"], "esrl: error: unknown command 'analysis' (did you mean analyze?); the commands: fit,"),
    (["--config", "x.yaml", "fit"], "esrl: error: options go after the command: esrl fit --config x.yaml"),
])
def test_an_unknown_or_misplaced_command_is_named(argv, message):
    assert _one_error(run_esrl(*argv)).startswith(message)


@pytest.mark.parametrize("init_args, message", [
    ({"num_samples": 2, "pass_k": [4]}, "trainer.callbacks (esrl.callbacks.Evaluation): Evaluation.pass_k [4]: "
                                        "each k must be in [1, num_samples (2)]"),
    ({"num_samples": 2, "pass_k": [0]}, "trainer.callbacks (esrl.callbacks.Evaluation): Evaluation.pass_k [0]: "),
    ({"num_samples": 2, "temperature": 0}, "trainer.callbacks (esrl.callbacks.Evaluation): Evaluation.temperature 0.0: "
                                           "must be > 0"),  # a division by 0 after the model loaded
    ({"num_sample": 2}, "trainer.callbacks: esrl.callbacks.Evaluation has no option num_sample (did you mean "
                        "num_samples?)"),
    ({"every_n_steps": -1}, "trainer.callbacks (esrl.callbacks.Evaluation): Evaluation.every_n_steps -1, "
                            "table_rows 8 and num_samples 0: must be >= 0"),  # step % -1 == 0: every step
])
def test_a_callbacks_bad_argument_is_one_line_naming_it(tmp_path, init_args, message):
    """jsonargparse tries a callback list as a Union: its report was ~80 lines, or a traceback (exit 1)."""
    config = tmp_path / "callbacks.yaml"
    config.write_text(textwrap.dedent(f"""\
        trainer:
          callbacks:
            - class_path: esrl.callbacks.Evaluation
              init_args: {json.dumps(init_args)}
        """))
    out = run_esrl("fit", "--config", ROOT / "configs/demo/es_conciseness.yaml", "--config", config,
                   "--trainer.default_root_dir", tmp_path / "run")
    assert _one_error(out).startswith(f"esrl: error: {message}")
    # the check study, sweep and `env --config` run before any fit: the same line (it was a traceback)
    from esrl.fit_check import check_fit_args

    with pytest.raises(ConfigError) as refused:
        check_fit_args([("run", ["--config", str(ROOT / "configs/demo/es_conciseness.yaml"), "--config", str(config)])])
    assert str(refused.value).startswith(f"run: {message}")


@pytest.mark.parametrize("command", ["env --config", "study"])
def test_invalid_yaml_names_file_line_and_column_in_every_command(tmp_path, command):
    """fit and sweep did; env and study said `while parsing a block mapping`, no line."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nbase_config: a.yaml\nalgorithms: [es\n")
    out = run_esrl(*command.split(), bad)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert f"{bad}:4:1: invalid YAML (did not find expected ',' or ']'" in out.stderr


@pytest.mark.parametrize("command", ["fit --config", "validate -c", "export --out {tmp}/x --seed-log",
                                     "sweep --out {tmp}/s --grid seed_everything=0 --config", "study",
                                     "serve-scorer --judge j --token-file"])
def test_a_binary_file_given_for_a_text_one_is_named(tmp_path, command):
    """A checkpoint or weights file given as a config, seed log or token file was a UnicodeDecodeError traceback."""
    binary = tmp_path / "last.ckpt"
    binary.write_bytes(b"PK\x03\x04\xff\xfe")
    out = run_esrl(*command.format(tmp=tmp_path).split(), binary)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert out.stderr.strip().splitlines()[-1].endswith(f"{binary}: not a text file (UTF-8): byte 4 is 0xff; a "
                                                        "binary file given by mistake?")


def test_inline_yaml_longer_than_a_file_name_is_still_a_config(tiny_model, tmp_path):
    """The check for binary config files stat()ed every --config value: inline YAML over 255 characters was an OSError
    (file name too long)."""
    from conftest import write_tiny_config

    inline = "{seed_everything: 5, trainer: {max_steps: 1, limit_val_batches: 0}, " + " " * 250 + "}"
    out = run_esrl("fit", "--config", write_tiny_config(tmp_path / "c.yaml", tiny_model), "--config", inline,
                   "--print_config")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "seed_everything: 5" in out.stdout


def test_export_into_a_folder_with_files_is_refused_leaving_them(tmp_path):
    """export wrote its model over another one's folder (its weights replaced, exit 0)."""
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "model.safetensors").write_bytes(b"another model")
    out = run_esrl("export", "--seed-log", tmp_path / "seed_log.jsonl", "--out", taken)
    assert out.returncode == 2 and out.stderr.strip() == (f"esrl export: error: --out {taken}: a folder with files in "
                                                          "it; export writes a new folder (or an empty one)")
    assert (taken / "model.safetensors").read_bytes() == b"another model"


def test_a_fit_config_given_to_study_says_what_a_study_file_is():
    out = run_esrl("study", ROOT / "configs/demo/es_conciseness.yaml", "--dry-run")
    assert out.returncode == 2 and "an `esrl fit` config, not a study file; a study names one as base_config" \
        in out.stderr


@pytest.mark.parametrize("mode, members, max_batch_size, idle", [("full", 2, 64, 2), ("lowrank", 6, 2, 1),
                                                                  ("lowrank", 4, 64, 3)])
def test_more_processes_than_an_iterations_work_warns_of_the_idle_ones(tiny_model, mode, members, max_batch_size,
                                                                       idle):
    """4 processes, 2 members (full: one each) or chunks of max_batch_size rows (lowrank, 1 prompt a step): the
    idle processes are said before the first step, not found in an idle GPU's utilisation. (The Trainer is a
    stand-in here: 4 real processes on this 2-core machine for a warning would cost a minute.)"""
    from types import SimpleNamespace

    from esrl.es.config import ESConfig
    from esrl.es.module import ESModule
    from esrl.policy import PolicyConfig
    from esrl.rollout import RolloutConfig

    module = ESModule(PolicyConfig(name_or_path=tiny_model), RolloutConfig(max_batch_size=max_batch_size),
                      ESConfig(population_size=members, mode=mode))
    module._trainer = SimpleNamespace(world_size=4, precision="32-true", log_dir=None, default_root_dir=".",
                                      datamodule=SimpleNamespace(prompts_per_step=1))
    with pytest.warns(UserWarning, match=rf"trainer.devices: 4 processes share {4 - idle} .* {idle} of them idle"):
        module.setup("fit")


def test_columns_named_like_esrls_own_arguments_reach_the_reward_function():
    """A data column `name` or `func` once collided with the reward call's own arguments (a TypeError)."""
    from esrl.tasks.base import Task

    task = Task("t", [], [], reward_funcs=[lambda prompts, completions, name, func, **_: [float(len(name[0] + func[0]))]])
    assert task.rewards([{"prompt": "a", "name": "bob", "func": "xy"}], ["x"]) == [5.0]


def test_chat_prompts_on_a_tokenizer_without_a_chat_template_say_what_to_change(tiny_model):
    """A base model's tokenizer (no template) got transformers' ValueError traceback at the first rollout."""
    from esrl.models import load_tokenizer
    from esrl.rollout import render_prompts

    tok = load_tokenizer(tiny_model)
    assert render_prompts(tok, [[{"role": "user", "content": "hi"}]])[0].endswith("assistant\n")
    tok.chat_template = None
    assert render_prompts(tok, ["raw text"]) == ["raw text"]
    with pytest.raises(ConfigError, match="no chat template.*data.task_args.chat false"):
        render_prompts(tok, [[{"role": "user", "content": "hi"}]])
