"""`esrl env`: versions and devices for a bug report, and a config's needs on this machine."""

from __future__ import annotations

import pytest
import torch
import yaml
from conftest import ROOT, run_esrl

from esrl import needs
from esrl.errors import ConfigError


def test_env_lists_versions_devices_and_the_model_cache():
    out = run_esrl("env")
    assert out.returncode == 0, out.stderr[-2000:]
    for key in ("Python", "torch", "CUDA", "transformers", "lightning", "trl", "peft", "vllm", "deepspeed",
                "wandb", "Devices", "Embedded model", "Configs"):
        assert f"- {key}: " in out.stdout, key


def test_env_names_an_esrl_cache_on_a_file_and_exits_non_zero(tmp_path, monkeypatch):
    """No embedded model can be converted there: listed as missing, one error line naming ESRL_CACHE."""
    (tmp_path / "cachefile").write_text("not a folder\n")
    for cache in (tmp_path / "cachefile", tmp_path / "cachefile" / "below"):
        monkeypatch.setenv("ESRL_CACHE", str(cache))
        out = run_esrl("env")
        assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
        assert "- Embedded model: smollm2-135m-instruct: missing" in out.stdout
        assert out.stderr.strip().splitlines() == [
            f"esrl env: error: ESRL_CACHE: {cache} cannot be a folder: {tmp_path / 'cachefile'} is a file; "
            "point ESRL_CACHE at a writable folder"]


def test_env_configs_prints_the_shipped_configs_folder(tmp_path):
    """The folder itself, not the editable install's link to it (`cp -r "$(esrl env --configs)" .` copied a link
    relative to the package, broken where it landed)."""
    import subprocess

    out = run_esrl("env", "--configs")
    assert out.returncode == 0 and (ROOT / "configs" / "demo" / "es_conciseness.yaml").samefile(
        out.stdout.strip() + "/demo/es_conciseness.yaml")
    subprocess.run(["cp", "-r", out.stdout.strip(), str(tmp_path / "mine")], check=True)
    assert (tmp_path / "mine" / "demo" / "es_conciseness.yaml").is_file()


def test_a_grpo_configs_deepspeed_is_no_need_under_algo_es():
    """`esrl fit --algo es` runs a GRPO config's DeepSpeed strategy as `es`; `esrl env --algo es` asked for deepspeed
    and a GPU all the same (exit 2 on a CPU machine the fit runs on)."""
    from esrl import needs

    trainer = {"strategy": "deepspeed_stage_2", "accelerator": "cpu"}
    assert not [n for n in needs.local_needs({"algo": "es", "trainer": trainer}) if "deepspeed" in n.field]
    assert [n.what for n in needs.local_needs({"algo": "grpo", "trainer": trainer}) if "deepspeed" in n.field] == [
        "deepspeed", "a CUDA GPU"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU machine the GPU need is met")
def test_env_config_names_each_missing_piece_and_exits_non_zero():
    out = run_esrl("env", "--config", ROOT / "configs" / "es_pku.yaml")
    assert out.returncode != 0
    listed = out.stdout.split("needs:", 1)[1]
    assert "[missing] trainer.accelerator: gpu" in listed
    assert "[missing] data.task_args.scorer: http://127.0.0.1:8000" in listed and "esrl serve-scorer" in listed
    assert "PKU-Alignment/alpaca-7b-reproduced" in listed and "PKU-Alignment/PKU-SafeRLHF" in listed
    errors = [line for line in out.stderr.splitlines() if line.startswith("esrl env: error:")]
    assert len(errors) == 1 and "2 missing" in errors[0] and "--trainer.accelerator cpu" in errors[0]
    assert "Traceback" not in out.stderr


def test_demo_config_needs_nothing_more():
    out = run_esrl("env", "--config", ROOT / "configs" / "demo" / "es_pku.yaml", cwd=ROOT)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "[missing]" not in out.stdout


@pytest.mark.parametrize(("config", "module", "command"), [
    ({"model": {"es": {"mode": "lora"}}}, "peft", "pip install 'esrl[peft]'"),
    ({"model": {"rollout": {"engine": "vllm"}}}, "vllm", "pip install 'esrl[vllm]'"),
    ({"algo": "grpo", "trainer": {"strategy": "deepspeed_stage_3"}}, "deepspeed", "pip install 'esrl[deepspeed]'"),
    ({"trainer": {"logger": [{"class_path": "lightning.pytorch.loggers.WandbLogger"}]}}, "wandb", "pip install wandb"),
])
def test_each_optional_package_is_a_need_with_its_install_command(config, module, command, monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, module, None)  # as if it were not installed
    missing = [n for n in needs.local_needs(config) if n.status == needs.MISSING and n.what == module]
    assert len(missing) == 1 and command in missing[0].line()
    with pytest.raises(needs.ConfigError, match=command.replace("[", r"\[").replace("]", r"\]")):
        needs.check(config)


def test_lora_is_not_a_need_for_grpo():
    assert not needs.local_needs(yaml.safe_load("algo: grpo\nmodel: {es: {mode: lora}}"))


def test_env_config_that_is_not_a_mapping_is_one_line(tmp_path):
    config = tmp_path / "string.yaml"
    config.write_text("just a string\n")
    out = run_esrl("env", "--config", config)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip() == (f"esrl env: error: --config {config}: expected a mapping of config sections "
                                  "(model:, data:, trainer:, ...), found a str")


def test_env_config_lists_the_policy_model_and_a_missing_folder_fails(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({"model": {"policy": {"name_or_path": str(tmp_path / "no_model")}}}))
    out = run_esrl("env", "--config", config)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert f"- [missing] model.policy.name_or_path: {tmp_path / 'no_model'}: the model folder -> no such folder" \
        in out.stdout
    (error,) = out.stderr.strip().splitlines()
    assert error.startswith(f"esrl env: error: {config}: 1 missing: model.policy.name_or_path: {tmp_path / 'no_model'}"
                            " needs the model folder (no such folder")


def test_policy_model_found_missing_or_left_to_the_hub(tmp_path):
    """Checked as fit resolves it: a folder needs a config.json; a hub id (offline here, not cached) is fetched on
    first use, not missing; the embedded model is a local need (its package)."""
    def policy_needs(name):
        return [n for n in needs.remote_needs({"model": {"policy": {"name_or_path": name}}})
                if n.field.startswith("model.policy.name_or_path")]

    (tmp_path / "model").mkdir()
    (no_config,) = policy_needs(str(tmp_path / "model"))
    assert no_config.status == needs.MISSING and "has no config.json" in no_config.fix
    (tmp_path / "model" / "config.json").write_text("{}")
    assert [n.status for n in policy_needs(str(tmp_path / "model"))] == [needs.OK]
    (hub,) = policy_needs("esrl-tests/not-a-cached-model")
    assert hub.status == needs.FETCHED and "hf download esrl-tests/not-a-cached-model" in hub.fix
    assert policy_needs("smollm2-135m-instruct") == []


@pytest.mark.parametrize(("devices", "wanted"), [(1, 1), ("2", 2), (-1, 1), ("-1", 1), ("auto", 1), ([0], 1),
                                                 ([1], 2), ("0,1", 2), ("1,", 2), ([0, 3], 4)])
def test_the_gpus_a_trainer_devices_value_needs(devices, wanted, monkeypatch):
    """As Lightning reads `devices` on a GPU: a count, GPU indices (a list, or a string with commas), or all; a
    list of indices once counted its length ([1] on a one-GPU machine passed, "0,1" counted as 1)."""
    monkeypatch.setattr(needs, "_gpus", lambda: 1)
    assert needs.gpus_wanted(devices) == wanted
    (need,) = [n for n in needs.local_needs({"trainer": {"accelerator": "gpu", "devices": devices}})
               if n.field.startswith("trainer.accelerator")]
    assert need.status == (needs.OK if wanted == 1 else needs.MISSING) and need.what == f"{wanted} CUDA GPU(s)"


def test_a_devices_value_that_is_no_gpu_index_is_named():
    with pytest.raises(ConfigError, match=r"^trainer.devices '0,x': expected a count, -1, 'auto' or GPU indices"):
        needs.gpus_wanted("0,x")


def test_env_config_checks_the_fields_as_fit_does(tmp_path):
    """A typo fit refuses was "[ok]" everywhere and exit 0 here."""
    config = tmp_path / "typo.yaml"
    config.write_text(yaml.safe_dump({"model": {"es": {"populaton_size": 2}}}))
    out = run_esrl("env", "--config", config)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "- [refused] its fields, as `esrl fit` checks them: esrl fit: " in out.stdout
    assert "model.es has no option populaton_size" in out.stderr.strip().splitlines()[-1]
    good = run_esrl("env", "--config", ROOT / "configs/demo/es_conciseness.yaml")
    assert good.returncode == 0 and "- [ok] its fields, as `esrl fit` checks them" in good.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU config on a machine without one")
def test_env_config_words_a_missing_gpu_once():
    """A GPU config on a CPU: the GPU is missing, and fit's refusal of the same field points at that line instead of
    wording it again (it did)."""
    out = run_esrl("env", "--config", ROOT / "configs/es_conciseness.yaml")
    assert out.returncode == 2
    assert out.stdout.count("CUDA GPU(s)") == 1, out.stdout
    assert "- [refused] its fields, as `esrl fit` checks them: trainer.accelerator: gpu, above" in out.stdout
