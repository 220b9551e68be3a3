"""Bad input gets one clear line naming the culprit and a non-zero exit, never a traceback."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import ROOT, run_esrl

DEMO = ROOT / "configs" / "demo" / "es_conciseness.yaml"


def error_lines(out) -> list[str]:
    return [line for line in out.stderr.splitlines() if line.startswith("esrl: error:")]


@pytest.mark.parametrize("args,culprit", [
    (["--model.policy.name_or_path", "/no/such/model"], "/no/such/model"),
    (["--data.task", "nosuchtask"], "unknown task 'nosuchtask'"),
    (["--model.es.population_size", "1"], "model.es.population_size"),
    (["--model.es.sigma", "0"], "model.es.sigma"),
    (["--model.es.sigma", "-0.1"], "model.es.sigma"),
    (["--model.es.sigma", "-1e-3"], "model.es.sigma: must be > 0, got -0.001"),  # not "--model.es: expected one"
    (["--data.prompts_per_step", "3"],
     "data.prompts_per_step: 3 prompts per step, but task 'conciseness' has only 2 training prompts"),
    (["--trainer.strategy", "xla"], "trainer.strategy xla: ES runs on esrl's own strategy `es`"),
    (["--algo", "grpo", "--trainer.strategy", "fsdp"], "trainer.strategy fsdp: GRPO under FSDP is not supported"),
    # what Lightning's Trainer refuses: its own message, one line naming the section
    (["--algo", "grpo", "--trainer.strategy", "nosuch"], "trainer: You selected an invalid strategy name"),
    (["--trainer.devices", "0"], "trainer: `Trainer(devices='0')` value is not a valid input"),
    (["--trainer.accumulate_grad_batches", "0"], "trainer.accumulate_grad_batches: must be >= 1, got 0"),
    (["--model.es.include", "[zzz_nomatch]"], "model.es.include / exclude / layers: the filter"),
    (["--model.es.layers", "50-60"], "model.es.layers: '50-60' reaches past the model's 2 layers (0-1)"),
    (["--model.es.layers", "0,200"], "model.es.layers: '0,200' reaches past the model's 2"),  # 200 was dropped
    (["--model.es.layers", "1-"], "model.es.layers: expected layer ranges"),  # was layer 1 alone
    (["--model.es.layers", "abc"], "model.es.layers: expected layer ranges such as '0-5,20', got 'abc'"),
    (["--model.es.layers", "5-2"], "model.es.layers: expected layer ranges"),
    (["--model.es.exclude", "[(]"], "model.es.exclude: '(' is not a regular expression"),
    (["--model.es.momentum", "1.5"], "model.es.momentum: must be in [0, 1)"),
    (["--model.es.optimizer", "adam", "--model.es.momentum", "0.9"],
     "model.es.momentum: applies to optimizer sgd only"),  # AdamW dropped it silently
    (["--trainer.precision", "bf16-true"],  # Lightning converted the weights the seed log calls float32
     "trainer.precision bf16-true with model.policy.dtype float32: ES would perturb and update torch.bfloat16"),
    (["--trainer.precision", "bf16-true", "--model.policy.dtype", "fp32"],  # an alias: getattr(torch, 'fp32') raised
     "trainer.precision bf16-true with model.policy.dtype fp32: ES would perturb and update torch.bfloat16"),
    (["--trainer.precision", "64-true"], "trainer.precision 64-true: ES runs 32-true"),  # trained fp64, exported fp32
    (["--model.es.mode", "lora", "--trainer.precision", "bf16-true", "--model.policy.dtype", "bf16"],
     "trainer.precision bf16-true with model.es.mode lora: the adapter ES trains is float32"),  # converted to bf16
    (["--model.rollout.stop", '[""]'], "model.rollout.stop: stop strings must be non-empty"),
    (["--algo", "grpo", "--model.grpo.lora", "{layers: '5-9'}"],
     "model.grpo.lora.layers: '5-9' reaches past the model's 2 layers (0-1)"),  # not PEFT's "target modules"
    (["--model.es.mode", "lora", "--model.es.layers", "1-3"], "model.es.layers: '1-3' reaches past the model's 2"),
])
def test_bad_config_exits_with_one_line(args, culprit, tiny_model, tmp_path):
    out = run_esrl("fit", "--config", DEMO, "--trainer.default_root_dir", tmp_path,
                   "--model.policy.name_or_path", tiny_model, *args)
    assert out.returncode != 0
    lines = error_lines(out)
    assert len(lines) == 1 and culprit in lines[0], out.stderr[-2000:]
    assert "Traceback" not in out.stderr and "LightningCLI's args" not in out.stderr  # no warning before the line


def test_malformed_data_line_names_file_and_line(tiny_model, tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text('{"question": "ok?", "answer": "yes"}\n{"question": "broken", \n')
    out = run_esrl("fit", "--config", DEMO, "--trainer.default_root_dir", tmp_path,
                   "--model.policy.name_or_path", tiny_model,
                   "--data.task_args", f'{{"train_path": "{data}"}}')
    assert out.returncode != 0
    lines = error_lines(out)
    assert len(lines) == 1 and f"{data}:2" in lines[0], out.stderr[-2000:]
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize(("module", "args", "command"), [
    ("peft", ["--model.es.mode", "lora"], "pip install 'esrl[peft]'"),
    ("vllm", ["--model.rollout.engine", "vllm"], "pip install 'esrl[vllm]'"),
])
def test_missing_optional_package_is_one_line_before_any_model_loads(module, args, command, tmp_path):
    """The package is hidden from the CLI's process; the model path does not exist, so a needs error (not a
    model error) shows the check ran before any model was looked for."""
    import subprocess
    import sys

    hide = f"import sys; sys.modules[{module!r}] = None; from esrl.cli import main; main()"
    out = subprocess.run([sys.executable, "-c", hide, "fit", "--config", str(DEMO), *args,
                          "--model.policy.name_or_path", str(tmp_path / "no-model"),
                          "--trainer.default_root_dir", str(tmp_path)],
                         check=False, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode != 0
    lines = error_lines(out)
    assert len(lines) == 1 and command in lines[0] and "no-model" not in lines[0], out.stderr[-2000:]
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize(("text", "where"), [
    ("model:\n  es: {population_size: 2}\ntrainer: {max_steps: 1}\nmodel:\n  es: {sigma: 0.5}\n", ":4: key 'model'"),
    ("model:\n  es: {population_size: 2, population_size: 3}\n", ":2: key 'population_size'"),
    ("model:\n  es: {sigma: 0.5}\n  es: {alpha: 0.1}\n", ":3: key 'es'"),
    ("model:\n  rollout: {max_new_tokens: 8}\n  \"rollout\": {temperature: 0.5}\n", ":3: key 'rollout'"),
])
def test_a_key_given_twice_is_one_line_naming_its_lines(tmp_path, text, where):
    """YAML keeps a repeated key's last value: a second `model:` section dropped the first whole (the run trained the
    embedded default model with 30 members, no error). Refused, naming both lines."""
    config = tmp_path / "twice.yaml"
    config.write_text(text)
    out = run_esrl("fit", "--config", config, "--print_config")
    assert out.returncode == 2
    (line,) = error_lines(out)
    assert line.startswith(f"esrl: error: {config}{where} given twice (first at line ") and "Traceback" not in out.stderr


@pytest.mark.parametrize(("text", "repeated"), [
    ("1e-3: a\n0.001: b\n", ":2: key '0.001' given twice (first at line 1 as '1e-3')"),
    ("on: a\ntrue: b\n", ":2: key 'true' given twice (first at line 1 as 'on')"),
    ("1: a\n'1': b\n", None),
    ("1: a\n!!str 1: b\n", None),  # a tag says how to read it
])
def test_repeated_keys_are_compared_as_the_config_loader_reads_them(tmp_path, text, repeated):
    """Keys were compared as written: `1e-3` and `0.001` (one float to jsonargparse's loader) each passed, and the
    first was dropped; `1` and `'1'` (an int and a string) are two keys."""
    from esrl.config_files import load_yaml
    from esrl.errors import ConfigError

    path = tmp_path / "keys.yaml"
    if repeated is None:
        assert load_yaml(text, str(path)) == {1: "a", "1": "b"}
        return
    with pytest.raises(ConfigError) as err:
        load_yaml(text, str(path))
    assert str(err.value).startswith(f"{path}{repeated}; YAML keeps the last")


def test_an_empty_config_file_is_named(tmp_path):
    """jsonargparse said only "Unexpected config:", naming no file."""
    config = tmp_path / "empty.yaml"
    config.write_text("")
    out = run_esrl("fit", "--config", config)
    assert out.returncode == 2 and error_lines(out) == [f"esrl: error: {config}: the file is empty (a config is a "
                                                        "mapping of sections: model, data, trainer)"], out.stderr


@pytest.mark.parametrize("text, problem", [
    ("trainer: 5\n", "section 'trainer' is 5, not a mapping of its options (or the path of a YAML file of them)"),
    ("model: [a, b]\n", "section 'model' is ['a', 'b'], not a mapping of its options (or the path of a YAML file"),
    ("data:\n", "section 'data' is empty: give its options or leave it out"),
])
def test_a_section_of_another_type_is_named(tmp_path, text, problem):
    """`trainer: 5` was dropped without a word (the run went on with the trainer's defaults); `data:` gave
    jsonargparse's "Unexpected config: data:"."""
    config = tmp_path / "odd.yaml"
    config.write_text(text)
    out = run_esrl("fit", "--config", DEMO, "--config", config, "--print_config")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    (line,) = error_lines(out)
    assert line.startswith(f"esrl: error: {config}: {problem}"), line


def test_a_section_given_as_a_path_is_a_file_of_its_options(tmp_path):
    """The string a section may be (not refused with the types above): the path of a YAML file of its options."""
    (tmp_path / "trainer.yaml").write_text("max_steps: 3\n")
    config = tmp_path / "odd.yaml"
    config.write_text(f"trainer: {tmp_path / 'trainer.yaml'}\n")
    out = run_esrl("fit", "--config", DEMO, "--config", config, "--print_config")
    assert out.returncode == 0 and "  max_steps: 3\n" in out.stdout, out.stderr[-2000:]


def test_print_config_says_it_has_not_checked_the_values():
    """--print_config prints at parse time, before the constructors' checks (running them needs the fit's machine:
    its GPUs, its data): `sigma: -1.0` printed with exit 0 and no word; it now says that a fit checks the values."""
    out = run_esrl("fit", "--config", DEMO, "--model.es.sigma", "-1", "--print_config")
    assert out.returncode == 0 and "sigma: -1.0" in out.stdout, out.stderr[-2000:]
    assert "esrl: --print_config prints the values as given; a fit checks them when it starts" in out.stderr


def test_yaml_syntax_error_names_the_file_line_and_column(tmp_path):
    config = tmp_path / "broken.yaml"
    config.write_text("model:\n  policy: {name_or_path: x\ntrainer:\n  max_steps: 2\n")
    out = run_esrl("fit", "--config", config)
    assert out.returncode == 2
    assert error_lines(out) == [f"esrl: error: {config}:3:8: invalid YAML (did not find expected ',' or '}}', "
                                "while parsing a flow mapping)"], out.stderr[-2000:]
    assert "<unicode string>" not in out.stderr and "Traceback" not in out.stderr


def test_corrupt_config_json_is_named_as_such(tiny_model, tmp_path):
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    (model / "config.json").write_text('{"model_type": "llama",')
    out = run_esrl("fit", "--config", DEMO, "--model.policy.name_or_path", model,
                   "--trainer.default_root_dir", tmp_path)
    assert out.returncode == 2
    lines = error_lines(out)
    assert len(lines) == 1 and f"{model / 'config.json'} is not valid JSON" in lines[0], out.stderr[-2000:]
    assert "Traceback" not in out.stderr


def _truncated_checkpoint(path):
    import torch

    torch.save({"state_dict": {"w": torch.arange(4096.0)}, "global_step": 3}, path)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])  # a copy or a save cut short
    return path


@pytest.mark.parametrize("make, problem", [
    (lambda tmp: tmp / "absent.ckpt", "no such file"),
    (lambda tmp: _truncated_checkpoint(tmp / "cut.ckpt"), "not a readable checkpoint, truncated or not written by torch.save"),
])
def test_bad_ckpt_path_is_one_line_naming_the_file(make, problem, tiny_model, tmp_path):
    ckpt = make(tmp_path)
    out = run_esrl("fit", "--config", DEMO, "--model.policy.name_or_path", tiny_model, "--ckpt_path", ckpt,
                   "--trainer.default_root_dir", tmp_path)
    assert out.returncode == 2
    assert [line.split(" (")[0] for line in error_lines(out)] == [f"esrl: error: --ckpt_path {ckpt}: {problem}"], \
        out.stderr[-2000:]
    assert "Traceback" not in out.stderr


def test_parser_error_is_one_line_and_a_help_hint(tmp_path):
    out = run_esrl("fit", "--config", DEMO, "--trainer.max_steps", "abc", "--trainer.default_root_dir", tmp_path)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-2:] == [
        "esrl: error: Parser key \"trainer.max_steps\": Expected a <class 'int'>. Got value: abc",
        "(`esrl fit --help` lists the options)"], out.stderr[-2000:]
    assert "usage:" not in out.stderr and "Traceback" not in out.stderr


def test_an_unknown_option_of_a_config_class_is_named_whole(tmp_path):
    """Not jsonargparse's 'Parser key "model.es": Problem with given class_path 'esrl.es.config.ESConfig': Option
    'bogus' is not accepted'."""
    out = run_esrl("fit", "--config", DEMO, "--model.es.bogus", "1", "--trainer.default_root_dir", tmp_path)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-2] == 'esrl: error: Parser key "model.es.bogus": model.es has no option bogus'


def test_a_bad_value_in_a_config_file_is_named_without_its_whole_section(tmp_path):
    """jsonargparse adds the section the value came in ("Given value: {...}", a dozen fields): the value is named."""
    import yaml

    config = yaml.safe_load(Path(DEMO).read_text())
    config.setdefault("model", {}).setdefault("rollout", {})["max_new_tokens"] = "many"
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(config))
    out = run_esrl("fit", "--config", tmp_path / "bad.yaml", "--trainer.default_root_dir", tmp_path)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-2:] == [
        "esrl: error: Parser key \"model.rollout.max_new_tokens\": Expected a <class 'int'>. Got value: many",
        "(`esrl fit --help` lists the options)"], out.stderr[-2000:]


def _rewritten(src, dst, member: str, change) -> None:
    """A copy of the zip checkpoint `src` with one record's bytes changed (the zip itself stays valid)."""
    import copy
    import zipfile

    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_STORED) as zout:
        for info in zin.infolist():
            data = zin.read(info.filename)
            zout.writestr(copy.copy(info), change(data) if info.filename.endswith(member) else data)


def test_corrupt_records_in_a_valid_zip_checkpoint_are_one_line(tiny_model, tmp_path):
    """Garbage data.pkl through the CLI; a truncated tensor record through the same reader (esrl.resume), which
    memory-maps the tensors: their sizes are checked, their bytes not read."""
    import torch

    from esrl.errors import DataError
    from esrl.resume import load_for_plan

    torch.save({"state_dict": {"w": torch.arange(4096.0)}, "global_step": 3}, tmp_path / "ok.ckpt")
    assert load_for_plan(tmp_path / "ok.ckpt")["global_step"] == 3
    ckpt = tmp_path / "bad.ckpt"
    _rewritten(tmp_path / "ok.ckpt", ckpt, "data.pkl", lambda b: (b"\x00garbage" * len(b))[:len(b)])
    out = run_esrl("fit", "--config", DEMO, "--model.policy.name_or_path", tiny_model, "--ckpt_path", ckpt,
                   "--trainer.default_root_dir", tmp_path)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert error_lines(out) == [f"esrl: error: --ckpt_path {ckpt}: a corrupt checkpoint: its data.pkl does not "
                                "unpickle as a checkpoint (garbage, or not written by torch.save)"], out.stderr[-2000:]
    _rewritten(tmp_path / "ok.ckpt", ckpt, "data/0", lambda b: b[: len(b) // 2])
    with pytest.raises(DataError, match=f"--ckpt_path {ckpt}: a corrupt checkpoint: a tensor's stored bytes do not "
                                        "match its size"):
        load_for_plan(ckpt)


def test_default_root_dir_below_a_file_is_one_line(tiny_model, tmp_path):
    (tmp_path / "notes.txt").write_text("a file")
    out = run_esrl("fit", "--config", DEMO, "--model.policy.name_or_path", tiny_model,
                   "--trainer.default_root_dir", tmp_path / "notes.txt" / "runs")
    assert out.returncode == 2
    assert error_lines(out) == [f"esrl: error: trainer.default_root_dir: {tmp_path / 'notes.txt' / 'runs'} cannot be "
                                f"a folder: {tmp_path / 'notes.txt'} is a file"], out.stderr[-2000:]


def test_truncated_weights_and_offline_hub_ids_are_one_line_naming_them(tiny_model, tmp_path):
    """In process (the loaders `esrl fit` calls; the CLI prints any EsrlError as one line, tested above)."""
    import shutil
    import time

    from esrl.errors import DataError, ModelNotFoundError
    from esrl.models import load_causal_lm, load_tokenizer

    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(DataError, match=f"^model '{model}': {weights}: not a readable safetensors file, truncated "
                                        "or corrupt"):
        load_causal_lm(str(model))
    start = time.monotonic()  # conftest sets HF_HUB_OFFLINE=1: no minute of retries
    with pytest.raises(ModelNotFoundError, match="'someorg/not-cached-model': not in the HF cache .* and "
                                                 "HF_HUB_OFFLINE is set"):
        load_tokenizer("someorg/not-cached-model")
    assert time.monotonic() - start < 30


def test_a_folder_that_is_no_causal_lm_or_cannot_pad_or_refuses_the_prompt_is_one_line(tiny_model, tmp_path):
    """transformers' ValueError for a config.json without a model_type (or a T5's), tokenizer.pad's for a tokenizer
    with neither pad nor EOS at the first rollout, and jinja2's for a template refusing a role, were tracebacks."""
    import shutil

    from esrl.errors import ConfigError, ModelNotFoundError
    from esrl.models import load_causal_lm, load_tokenizer
    from esrl.rollout.text import render_prompts
    from transformers import AutoTokenizer

    no_type = tmp_path / "no_type"
    shutil.copytree(tiny_model, no_type)
    (no_type / "config.json").write_text("{}")
    with pytest.raises(ModelNotFoundError, match=f"^model '{no_type}': {no_type} does not load as "
                                                 "AutoModelForCausalLM: Unrecognized model"):
        load_causal_lm(str(no_type))
    no_pad = tmp_path / "no_pad"
    shutil.copytree(tiny_model, no_pad)
    tok = AutoTokenizer.from_pretrained(no_pad)
    tok.eos_token = tok.pad_token = None
    tok.save_pretrained(no_pad)
    with pytest.raises(ModelNotFoundError, match="its tokenizer has neither a pad token nor an end-of-sequence"):
        load_tokenizer(str(no_pad))
    tok = load_tokenizer(tiny_model)
    tok.chat_template = "{{ raise_exception('System role not supported') }}"
    with pytest.raises(ConfigError, match="refuses the task's prompt: System role not supported"):
        render_prompts(tok, [[{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]])


def test_an_error_every_process_raises_is_one_line_each_naming_its_rank(tiny_model, tmp_path):
    """Two processes: both find the bad filter at model setup; rank 0's line reads as one process's would, rank 1's
    (when it prints before Lightning stops it on rank 0's error) says whose it is; the run exits non-zero without a
    traceback."""
    out = run_esrl("fit", "--config", DEMO, "--trainer.default_root_dir", tmp_path,
                   "--model.policy.name_or_path", tiny_model, "--trainer.devices", "2",
                   "--model.es.include", "[zzz_nomatch]")
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-3000:]
    # Both processes share the terminal: rank 0's line may land after rank 1's progress bar, on its line.
    lines = re.findall(r"esrl: error(?: \[rank 1\])?: [^\n\r]*", out.stderr)
    assert sorted(line.split(":")[1] for line in lines) in ([" error"], [" error", " error [rank 1]"]), out.stderr
    assert all("selects no parameter" in line for line in lines)


def test_predict_is_no_subcommand():
    """esrl's modules generate and score in their steps, with no predict step: `esrl predict` is refused by the parser
    like any unknown command, not by Lightning's traceback after the model loads."""
    out = run_esrl("predict", "--config", DEMO)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert error_lines(out)[0].startswith("esrl: error: unknown command 'predict'; the commands: fit, validate, test,")


@pytest.mark.parametrize("algo", ["es", "grpo"])
def test_a_prompt_past_the_models_context_is_one_line_not_hours_of_attention(algo, tiny_model, tmp_path):
    """A data line of megabytes once ran for hours (its attention) and ignored SIGTERM, waiting for the step's end; a
    prompt that leaves no room for max_new_tokens in the model's context (the tiny model's 512 positions) stops
    the run at its first rollout, in one line, with no final/."""
    import json

    from conftest import FIXTURES

    train = tmp_path / "train.jsonl"
    train.write_text(json.dumps({"question": "why " * 200_000, "answer": "1"}) + "\n")
    out = run_esrl("fit", "--config", DEMO, "--model.policy.name_or_path", tiny_model, "--algo", algo,
                   "--data.task_args", json.dumps({"train_path": str(train),
                                                   "eval_path": str(FIXTURES / "conciseness_eval2.jsonl")}),
                   "--data.prompts_per_step", "1", "--trainer.default_root_dir", tmp_path / "runs", timeout=120)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-3000:]
    (line,) = error_lines(out)
    assert "exceed the model's context of 512 tokens" in line and "'why why" in line, line
    assert not list((tmp_path / "runs").rglob("final"))
