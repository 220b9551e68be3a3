"""`esrl study` end to end on the tiny model: 2 seeds x {ES, GRPO}, 1 step each, then the report.

The report's numbers are checked against the runs' own files (eval.jsonl, final/ weights); a rerun skips the
finished runs and resumes one whose final/ is gone from its checkpoint. Bad study files: test_study_inputs.py;
interruption: test_study_interrupt.py.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path
from statistics import fmean, stdev

import pytest
from conftest import ROOT, run_esrl
from study_files import write_study

from esrl.sweep import hacked

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def study(tiny_model, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("study")
    path = write_study(folder, tiny_model)
    res = run_esrl("study", path, "--jobs", 2, timeout=900)  # 4 fits, 2 at a time: about 40 s on 2 idle cores
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert res.stdout.count(": ok (") == 4
    return path


def final_eval(run: Path) -> dict:
    lines = (run / "lightning_logs" / "version_0" / "eval.jsonl").read_text().splitlines()
    return json.loads(lines[-1])


def ci95(values: list[float]) -> float:
    return 12.706 * stdev(values) / math.sqrt(len(values))  # Student t, 1 degree of freedom


def test_report_numbers_are_the_runs_own(study):
    out = study.parent / "out"
    summary = json.loads((out / "summary.json").read_text())
    report = (out / "report.md").read_text()
    groups = {g["algorithm"]: g for g in summary["groups"]}
    assert set(groups) == {"es", "grpo"}
    for algo, g in groups.items():
        evals = [final_eval(out / "runs" / f"{algo}_seed={s}") for s in (0, 1)]
        assert g["seeds"] == [0, 1] and g["hacked_runs"] == [f"{algo}_seed={s}" for s in (0, 1) if hacked(evals[s])]
        for metric in ("reward", "kl", "sampled/reward", "pass@2", "hacking/empty"):
            values = [e[metric] for e in evals]
            assert g[metric]["values"] == pytest.approx(values), (algo, metric)
            assert g[metric]["mean"] == pytest.approx(fmean(values))
            assert g[metric]["ci95"] == pytest.approx(ci95(values), abs=1e-12)
        cell = f"{g['reward']['mean']:.4g} ± {g['reward']['ci95']:.2g}"
        assert f"| {algo} | all | 2 |" in report and cell in report
    for png in ("curves.png", "cosine_all.png", "unembedding_all.png", "connectivity_all_seed=0.png",
                "robustness_all.png", "similarity_all.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png
        assert f"]({png})" in report


def test_weight_analyses_match_the_final_weights(study, tiny_model):

    from esrl.models import load_causal_lm

    out = study.parent / "out"
    numbers = json.loads((out / "summary.json").read_text())["analyses"]["all"]
    base = dict(load_causal_lm(tiny_model).named_parameters())
    deltas = {}
    for algo in ("es", "grpo"):
        for s in (0, 1):
            final = out / "runs" / f"{algo}_seed={s}" / "lightning_logs" / "version_0" / "final"
            model = load_causal_lm(str(final))
            deltas[f"{algo}/s{s}"] = {n: (p.double() - base[n].double()) for n, p in model.named_parameters()}
    # Unembedding share: the tiny Llama ties its embeddings, so it is the embedding matrix's share of |delta|^2.
    emb = "model.embed_tokens.weight"
    share = numbers["unembedding_share"]
    assert share["unit"] == "embeddings=unembedding (tied)"
    moved = 0
    for algo in ("es", "grpo"):
        totals = [float(sum(d.square().sum() for d in deltas[f"{algo}/s{s}"].values())) for s in (0, 1)]
        want = [float(deltas[f"{algo}/s{s}"][emb].square().sum()) / t for s, t in zip((0, 1), totals) if t > 0]
        assert share["by_algorithm"][algo] == pytest.approx(want, rel=1e-6)  # a run that did not move has no share
        moved += len(want)
    assert moved >= 2
    # Whole-model cosine across algorithms: the 4 ES x GRPO pairs, from the deltas themselves.
    cos = numbers["cosine"]
    assert sorted(cos) == ["es vs es", "es vs grpo", "grpo vs grpo"] and len(cos["es vs grpo"]["pairs"]) == 4

    def whole(a: str, b: str) -> float:
        dot = sum(float((deltas[a][n] * deltas[b][n]).sum()) for n in base)
        na = math.sqrt(sum(float(d.square().sum()) for d in deltas[a].values()))
        nb = math.sqrt(sum(float(d.square().sum()) for d in deltas[b].values()))
        return dot / (na * nb) if na * nb > 0 else None  # a run that did not move has no direction

    want = [whole(*p.split("|")) for p in cos["es vs grpo"]["pairs"]]
    assert cos["es vs grpo"]["whole_model"] == pytest.approx(want, abs=1e-9)
    assert cos["es vs es"]["whole_model"] == pytest.approx([whole("es/s0", "es/s1")], abs=1e-9)
    # Connectivity base -> run ends at the run's own final greedy reward (the whole 2-prompt eval split).
    ends = sorted((p["kind"], p["b"] if p["kind"] == "base->run" else f"{p['a']}->{p['b']}")
                  for p in numbers["connectivity"])
    assert ends == [("base->run", "es/s0"), ("base->run", "grpo/s0"), ("run->run", "es/s0->grpo/s0")]
    conn = json.loads((out / "analysis" / "all" / "connectivity_seed=0" / "connectivity.json").read_text())
    for pair in conn["pairs"]:
        if pair["kind"] == "base->run":
            algo = pair["b"].split("/")[0]
            assert pair["points"][-1]["reward"] == pytest.approx(final_eval(out / "runs" / f"{algo}_seed=0")["reward"])
    rob = numbers["robustness"]
    assert set(rob) == {"es/s0", "grpo/s0"}
    for label, groups in rob.items():
        assert groups["all"][0] == pytest.approx(final_eval(out / "runs" / f"{label.split('/')[0]}_seed=0")["reward"])


def test_rerun_skips_finished_runs_and_resumes_an_interrupted_one(study, capsys):
    from esrl.study.cli import main

    out = study.parent / "out"
    runs = out / "runs"
    logs = {p.name: (p / "fit.log").read_text() for p in runs.iterdir()}
    victim = runs / "grpo_seed=1"
    assert list((victim / "checkpoints").glob("*.ckpt"))
    shutil.rmtree(victim / "lightning_logs" / "version_0" / "final")  # as if killed after its last checkpoint
    main([str(study), "--report"])  # runs nothing; the report names the unfinished run
    assert "grpo_seed=1" in (out / "report.md").read_text().split("Not finished", 1)[1].splitlines()[0]
    capsys.readouterr()
    main([str(study)])
    printed = capsys.readouterr().out
    assert printed.count("done (final/ exists), skipped") == 3
    assert "grpo_seed=1: resuming from step=1.ckpt" in printed and "grpo_seed=1: ok" in printed
    for name, text in logs.items():
        now = (runs / name / "fit.log").read_text()
        assert now == text if name != victim.name else (now.startswith(text) and "--ckpt_path" in now[len(text):])
    tree = sorted(str(p.relative_to(victim)) for p in victim.glob("lightning_logs/*/*"))
    assert list(victim.glob("lightning_logs/version_*/final/config.json")), tree  # the resumed fit's final/
    summary = json.loads((out / "summary.json").read_text())
    assert {g["algorithm"]: len(g["seeds"]) for g in summary["groups"]} == {"es": 2, "grpo": 2}


def test_a_rerun_of_an_edited_study_refuses_runs_finished_under_the_old_settings(study, tmp_path):
    """trainer.max_steps changed after the runs finished: they were skipped as done and reported under the new
    settings. Now one line naming a run and the setting, before anything runs or is written."""
    import yaml
    from esrl.study.cli import main
    from esrl.study.cli import StudyError

    edited = yaml.safe_load(study.read_text())
    edited.update(base_config=str(study.parent / "base.yaml"), overrides={"trainer.max_steps": 2})
    (tmp_path / "edited.yaml").write_text(yaml.safe_dump(edited))
    report = (study.parent / "out" / "report.md").read_text()
    with pytest.raises(StudyError, match=r"es_seed=0 finished with other settings than the study now gives "
                                         r"\(trainer.max_steps: 1 there, 2 now\)"):
        main([str(tmp_path / "edited.yaml")])
    assert (study.parent / "out" / "report.md").read_text() == report


def test_slurm_array_task_runs_its_run_then_writes_the_report(study):
    """slurm/sweep.sbatch with ESRL_TOOL=study as SLURM runs array task 3 (no SLURM here: the script runs under
    bash with the array index set): its run (finished: skipped), then the report, since every run is done."""
    out = study.parent / "out"
    (out / "report.md").unlink()
    env = {**os.environ, "ESRL_TOOL": "study", "SLURM_ARRAY_TASK_ID": "3",
           "ESRL": str(Path(sys.executable).parent / "esrl")}
    res = subprocess.run(["bash", str(ROOT / "slurm" / "sweep.sbatch"), str(study), str(out)], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert "skipped" in res.stdout and (out / "report.md").is_file()


