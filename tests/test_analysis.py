"""`esrl analyze`, `esrl sweep` and notebooks/analysis.ipynb on tiny real runs (ES and GRPO through the CLI).

One 2 x 2 ES sweep (alpha x seed) provides the ES runs; one GRPO run (`--algo grpo`) the other optimizer
(two ES seeds stand in when GRPO cannot run). The analyses use the tiny model, 2 eval prompts and 4 new tokens,
so that their numbers can be checked against the runs' own eval.jsonl.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
from conftest import FIXTURES, ROOT, run_esrl, write_tiny_config

pytestmark = pytest.mark.slow

TOKENS = 4
TASK_ARGS = ["--task", "conciseness", "--task-arg", f"eval_path={FIXTURES / 'conciseness_eval2.jsonl'}",
             "--task-arg", f"train_path={FIXTURES / 'conciseness_train3.jsonl'}"]


@pytest.fixture(scope="module")
def config(tiny_model, tmp_path_factory) -> Path:
    return write_tiny_config(
        tmp_path_factory.mktemp("cfg") / "tiny.yaml", tiny_model, seed=0, rollout={"max_new_tokens": TOKENS},
        es={"population_size": 2, "sigma": 0.05, "alpha": 0.02},
        grpo={"num_generations": 2, "learning_rate": 1e-2, "beta": 0.0},
        trainer={"callbacks": [{"class_path": "esrl.callbacks.Evaluation", "init_args": {"num_samples": 2, "kl": True}}]})


@pytest.fixture(scope="module")
def sweep(config, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("sweep")
    res = run_esrl("sweep", "--config", config, "--out", out,
                   "--grid", "model.es.alpha=0.02,0.04", "--grid", "seed_everything=0,1", "--jobs", 2)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return out


def final_of(root: Path) -> Path:
    finals = list(root.rglob("final/config.json"))
    assert len(finals) == 1, finals
    return finals[0].parent


def eval_log(final: Path) -> list[dict]:
    return [json.loads(line) for line in (final.parent / "eval.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(config, sweep, tmp_path_factory) -> dict[str, Path]:
    """{'es': final/, 'grpo': final/}: an ES run of the sweep and a GRPO fit on the same config."""
    es = final_of(sweep / "alpha=0.02_seed_everything=0")
    root = tmp_path_factory.mktemp("grpo")
    res = run_esrl("fit", "--config", config, "--algo", "grpo", "--trainer.default_root_dir", root)
    assert res.returncode == 0, res.stderr[-3000:]
    return {"es": es, "grpo": final_of(root)}


@pytest.fixture(scope="module")
def analysis(tiny_model, runs, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("analysis")
    res = run_esrl("analyze", "all", "--base", tiny_model, "--models", f"es={runs['es']}", f"grpo={runs['grpo']}",
                   *TASK_ARGS, "--max-new-tokens", TOKENS, "--num-prompts", 2, "--sigmas", "0,0.05", "--seeds", 1,
                   "--alphas", "0,0.5,1", "--coverage-k", 2, "--coverage-sigma", "0.05", "--out", out)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return out


def load(out: Path, name: str) -> dict:
    return json.loads((out / f"{name}.json").read_text())


def test_every_analysis_writes_json_and_png(analysis):
    summary = load(analysis, "summary")
    assert set(summary["analyses"]) == {"robustness", "connectivity", "similarity", "coverage"}
    for name, entry in summary["analyses"].items():
        assert (analysis / entry["json"]).stat().st_size > 100
        png = (analysis / entry["png"]).read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000, name


def test_robustness_at_sigma_zero_is_the_unperturbed_eval_reward(analysis, runs):
    rob = load(analysis, "robustness")
    for label, final in runs.items():
        res = rob["models"][label]
        assert res["restored_exactly"] and res["tied_embeddings"]  # the tiny Llama ties its embeddings
        assert set(res["groups"]) == {"all", "embeddings=unembedding (tied)", "attention", "mlp"}
        final_eval = eval_log(final)[-1]["reward"]
        assert res["unperturbed_reward"] == pytest.approx(final_eval)
        for curve in res["groups"].values():
            assert curve["points"][0]["sigma"] == 0.0
            assert curve["points"][0]["reward_mean"] == pytest.approx(final_eval)
            assert len(curve["points"]) == 2


def test_connectivity_endpoints_equal_the_models(analysis, runs):
    lmc = load(analysis, "connectivity")
    pairs = {(p["a"], p["b"]): p for p in lmc["pairs"]}
    assert sorted(p["kind"] for p in pairs.values()) == ["base->run", "base->run", "run->run"]
    assert ("es", "grpo") in pairs
    evals = {label: eval_log(final) for label, final in runs.items()}
    base_reward = evals["es"][0]["reward"]  # the step-0 evaluation is the base model's
    for (a, b), pair in pairs.items():
        rewards = [p["reward"] for p in pair["points"]]
        assert [p["alpha"] for p in pair["points"]] == [0.0, 0.5, 1.0]
        start = base_reward if pair["kind"] == "base->run" else evals[a][-1]["reward"]
        assert rewards[0] == pytest.approx(start)
        assert rewards[-1] == pytest.approx(evals[b][-1]["reward"])
        assert pair["reward_barrier"] >= 0.0 and pair["nll_barrier"] >= 0.0


def test_similarity_of_a_run_with_itself_is_one(analysis, tiny_model, runs, tmp_path):
    from esrl.analysis.cli import main

    sim = load(analysis, "similarity")
    pair = sim["cosine"]["es|grpo"]
    assert all(c is None or -1.0 <= c <= 1.0 for c in pair["per_unit"].values())
    assert sim["units"][0].startswith("embeddings") and "L1.mlp" in sim["units"]
    assert sim["update_magnitude_total"]["es"]["relative"] > 0
    main(["similarity", "--base", tiny_model, "--models", f"a={runs['es']}", f"b={runs['es']}", *TASK_ARGS,
          "--num-prompts", "1", "--out", str(tmp_path), "--no-progress"])
    same = load(tmp_path, "similarity")["cosine"]["a|b"]
    moved = [c for c in same["per_unit"].values() if c is not None]
    assert moved and all(c == pytest.approx(1.0, abs=1e-9) for c in moved)
    assert same["whole_model"] == pytest.approx(1.0, abs=1e-9)


def test_coverage_curves(analysis):
    cov = load(analysis, "coverage")
    for res in cov["models"].values():
        for key in ("perturbation", "temperature"):
            curve = res[key]["curve"]
            assert [p["k"] for p in curve] == [1, 2]
            assert 0.0 <= curve[0]["pass_at_k"] <= curve[1]["pass_at_k"] <= 1.0
            assert curve[0]["best_of_k_reward"] <= curve[1]["best_of_k_reward"] + 1e-12


def test_bad_input_is_one_line_and_exit_2(tmp_path):
    from esrl.analysis.cli import main
    from esrl.errors import EsrlError

    res = run_esrl("analyze", "--models", tmp_path / "missing", "--out", tmp_path / "out")
    assert res.returncode == 2
    assert res.stderr.strip().count("\n") == 0 and "no such folder" in res.stderr
    with pytest.raises(EsrlError, match="unknown analysis 'bogus'"):
        main(["bogus", "--models", str(tmp_path), "--out", str(tmp_path / "out")])


@pytest.mark.parametrize("flags, message", [
    (["--device", "banana"], r"^--device 'banana': not a device name"),
    (["--device", "cuda:99"], r"^--device 'cuda:99': (no cuda device|this machine has \d+ cuda device)"),
    (["--task-args", "{bad"], r"^--task-args: not valid JSON/YAML"),
    (["--task-arg", "limit=[1"], r"^--task-arg limit: not valid JSON/YAML"),
    (["--task-arg", "num_train=1.5"], r"^--task-arg num_train: expected int, got 1.5"),  # was data.task_args.
    (["--task-arg", "num_train=1e-4"], r"^--task-arg num_train: expected int, got 0.0001"),  # 1e-4 a number, as fit's
    (["--batch-size", "0"], r"^--batch-size must be >= 1, got 0"),  # ran as 1
    (["--models", "run={model}"], r"^model labels must differ, got \['run', 'run', "),  # the first dropped
])
def test_bad_flags_are_one_error_before_any_model_loads(tiny_model, tmp_path, monkeypatch, flags, message):
    from esrl.analysis import common
    from esrl.analysis.cli import main
    from esrl.errors import EsrlError

    monkeypatch.setattr(common, "load_model", lambda *a: pytest.fail("a model loaded despite the bad flag"))
    with pytest.raises(EsrlError, match=message):
        main(["similarity", "--base", tiny_model, "--models", f"run={tiny_model}", "--out",
              str(tmp_path / "out"), "--no-progress", *(f.replace("{model}", tiny_model) for f in flags)])


@pytest.mark.parametrize("argv, message", [
    (["all", "--alphas", "0,0.5"], r"^--alphas must include 0 and 1"),
    (["connectivity", "--alphas", "0,0.5,nan,1"], r"^--alphas must lie in \[0, 1\]"),
    (["connectivity", "--alphas", "0,1,1.5"], r"^--alphas must lie in \[0, 1\]"),
    (["all", "--temperature", "0"], r"^--coverage-sigma and --temperature must be finite and > 0"),
    (["robustness", "connectivity", "--sigmas", "0,inf"], r"^--sigmas must be finite non-negative numbers"),
    (["robustness", "similarity", "--no-base"], r"^similarity needs --base"),
])
def test_every_selected_analysis_checks_its_flags_before_any_model_loads(tiny_model, tmp_path, monkeypatch, argv,
                                                                         message):
    """`esrl analyze all` (the default) checked connectivity's --alphas or similarity's --base only once robustness
    had run in full, then stopped without a summary."""
    from esrl.analysis import common
    from esrl.analysis.cli import main
    from esrl.errors import EsrlError

    monkeypatch.setattr(common, "load_model", lambda *a: pytest.fail("a model loaded despite the bad flag"))
    base = [] if "--no-base" in argv else ["--base", tiny_model]
    with pytest.raises(EsrlError, match=message):
        main([*(a for a in argv if a != "--no-base"), *base, "--models", f"run={tiny_model}", "--out",
              str(tmp_path / "out"), "--no-progress"])


def test_a_run_folder_with_an_equals_sign_is_a_path_and_a_label_before_it_still_names_it(tiny_model, tmp_path):
    """esrl study's runs/es_seed=0 and esrl sweep's sigma=0.01 folders were read as LABEL=PATH ("model '0': no such
    folder")."""
    import shutil

    from esrl.analysis.cli import resolve_model

    run = tmp_path / "runs" / "es_seed=0"
    shutil.copytree(tiny_model, run / "lightning_logs" / "version_0" / "final")
    assert resolve_model(str(run), 0).label == "es_seed=0/version_0"
    assert resolve_model(f"es={run}", 0).label == "es"
    assert resolve_model(f"es={run}", 0).path == resolve_model(str(run), 0).path


def test_out_that_is_a_file_is_one_line_and_exit_2(tiny_model, tmp_path):
    (tmp_path / "taken").write_text("a file, not a folder")
    res = run_esrl("analyze", "similarity", "--base", tiny_model, "--models", f"run={tiny_model}", "--out",
                   tmp_path / "taken", "--no-progress")
    assert res.returncode == 2
    taken = tmp_path / "taken"
    assert res.stderr.strip().splitlines() == [f"esrl analyze: error: --out: {taken} cannot be a folder: "
                                               f"{taken} is a file"]


def test_models_of_two_architectures_are_one_line_before_any_analysis_runs(tiny_model, tmp_path):
    """`all` ran robustness to its end (hours on a 7B model) before similarity loaded both models and found them
    apart; their configs are now compared first (on the meta device, no weights read)."""
    from esrl.models import tiny_llama

    wider = tiny_llama(tmp_path / "wider", hidden_size=32)
    out = tmp_path / "out"
    res = run_esrl("analyze", "all", "--base", tiny_model, "--models", f"wide={wider}", *TASK_ARGS,
                   "--max-new-tokens", 2, "--num-prompts", 1, "--sigmas", "0,0.05", "--seeds", 1, "--alphas", "0,1",
                   "--coverage-k", 1, "--no-progress", "--out", out)
    assert res.returncode == 2, res.stderr[-3000:]
    (line,) = res.stderr.strip().splitlines()
    assert line.startswith("esrl analyze: error: models ") and "have different parameters" in line, line
    assert not out.exists()  # nothing ran


def test_sweep_summary_table(sweep):
    rows = list(csv.DictReader((sweep / "summary.csv").open()))
    assert len(rows) == 4
    assert [(r["model.es.alpha"], r["seed_everything"]) for r in rows] == [("0.02", "0"), ("0.02", "1"), ("0.04", "0"),
                                                                   ("0.04", "1")]
    for r in rows:
        assert r["status"] == "ok" and r["step"] == "2"
        float(r["reward"]), float(r["kl"])
        assert r["hacked"] in ("True", "False")
    md = (sweep / "summary.md").read_text().splitlines()
    assert len(md) == 2 + 4 and md[0].startswith("| run | model.es.alpha")


def test_sweep_flags_hacked_runs():
    from esrl.sweep import hacked

    assert hacked({"reward": -3.0, "hacking/empty": 0.0, "hacking/repetition": 0.1}) == []
    assert hacked({"reward": float("nan")}) == ["reward NaN"]
    assert any("empty" in r for r in hacked({"reward": 0.0, "hacking/empty": 1.0}))
    assert any("cjk_share" in r for r in hacked({"reward": 0.0, "hacking/cjk_share": 0.9}))


def test_notebook_runs_top_to_bottom(analysis, sweep, tmp_path, monkeypatch):
    import nbformat
    from nbclient import NotebookClient

    monkeypatch.setenv("ESRL_ANALYSIS_DIR", str(analysis))
    monkeypatch.setenv("ESRL_SWEEP_DIR", str(sweep))
    monkeypatch.setenv("ESRL_FIGURES_DIR", str(tmp_path / "figures"))
    nb = nbformat.read(ROOT / "notebooks" / "analysis.ipynb", as_version=4)
    NotebookClient(nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    figures = sorted(p.stem for p in (tmp_path / "figures").glob("*.png"))
    assert figures == ["connectivity", "coverage", "robustness", "similarity", "sweep"]
    text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert "not found" not in text and "4 runs over" in text


def test_each_tensor_is_grouped_by_its_own_module(tiny_model):
    """A Llama layer's post_attention_layernorm (the MLP's input norm) is a norm, not attention: the regex once
    matched the "attention" in its name, so robustness's attention curve perturbed it and similarity's L*.norm units
    missed it."""
    from esrl.analysis.common import group_names, layer_unit
    from esrl.models import load_causal_lm

    groups = group_names(load_causal_lm(tiny_model))
    for layer in (0, 1):
        prefix = f"model.layers.{layer}."
        assert groups[prefix + "post_attention_layernorm.weight"] == "norm"
        assert groups[prefix + "input_layernorm.weight"] == "norm"
        assert groups[prefix + "self_attn.o_proj.weight"] == "attention"
        assert groups[prefix + "mlp.down_proj.weight"] == "mlp"
        assert layer_unit(prefix + "post_attention_layernorm.weight", "norm") == f"L{layer}.norm"
    assert groups["model.norm.weight"] == "norm" and groups["model.embed_tokens.weight"] == "embeddings"
