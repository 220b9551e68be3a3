"""`esrl study`'s report from the runs' files, without fitting: which evaluations count as a run's, grid values
that would share a run folder, the connectivity table, when an analysis is reused, and counts the evaluation logs
only when above 0. (The study end to end: test_study.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import CONCISENESS_FILES

from esrl.study.config import AlgorithmSpec, AnalysisSettings, StudyConfig
from esrl.study.runner import plan


def one_study(tmp_path: Path, **changes) -> StudyConfig:
    return StudyConfig(base_config="base.yaml", algorithms=[AlgorithmSpec("es", "es")], out=str(tmp_path / "out"),
                       **{"seeds": [0], **changes})


def write_version(root: Path, n: int, evals: list[tuple[int, float]], train: list[tuple[int, float]] = (),
                  final: bool = False) -> None:
    version = root / "lightning_logs" / f"version_{n}"
    version.mkdir(parents=True)
    (version / "eval.jsonl").write_text("".join(json.dumps({"step": s, "reward": r}) + "\n" for s, r in evals))
    (version / "metrics.csv").write_text("step,train/reward_mean\n" + "".join(f"{s},{r}\n" for s, r in train))
    if final:
        (version / "final").mkdir()
        (version / "final" / "config.json").write_text("{}")


def test_a_restart_from_scratch_drops_the_failed_attempts_steps_and_a_resume_keeps_its_past(tmp_path):
    """A first attempt that failed before any checkpoint left version_0 (evaluated at 0 and 5); the rerun started
    again in version_1 and finished at step 4. Its step 5 read as the finished run's final evaluation and curve."""
    from esrl.study.results import collect, curve, summarize

    restarted, resumed = plan(one_study(tmp_path, seeds=[0, 1]))
    write_version(restarted.root, 0, [(0, -100.0), (5, -999.0)], [(1, -90.0), (6, -900.0)])
    write_version(restarted.root, 1, [(0, -100.0), (4, -20.0)], [(1, -80.0), (3, -30.0)], final=True)
    r = collect(restarted)
    assert [(e["step"], e["reward"]) for e in r.evals] == [(0, -100.0), (4, -20.0)]
    assert r.train == {1: -80.0, 3: -30.0}
    assert summarize([r])["groups"][0]["reward"]["values"] == [-20.0]
    assert curve([r], "eval") == ([0, 4], [-100.0, -20.0], [0.0, 0.0])
    # a resume into a new version: the older version's steps before the newer's first stay
    write_version(resumed.root, 0, [(0, -100.0), (2, -50.0)], [(1, -90.0), (2, -60.0)])
    write_version(resumed.root, 1, [(4, -10.0)], [(3, -40.0), (4, -15.0)], final=True)
    r = collect(resumed)
    assert [(e["step"], e["reward"]) for e in r.evals] == [(0, -100.0), (2, -50.0), (4, -10.0)]
    assert r.train == {1: -90.0, 2: -60.0, 3: -40.0, 4: -15.0}


@pytest.mark.parametrize("grid, message", [
    ({"model.es.sigma": [0.01, 0.01]}, "grid.model.es.sigma: values 0.01, 0.01 share one run folder (sigma=0.01); "),
    ({"model.es.sigma": [0.01, "0.01"]}, "grid.model.es.sigma: values 0.01, '0.01' share one run folder"),
    ({"model.rollout.max_new_tokens": [4], "data.task_args.path": ["data/a.jsonl", "data_a.jsonl"]},
     "grid.data.task_args.path: values 'data/a.jsonl', 'data_a.jsonl' share one run folder (path=data-a.jsonl); "),
])
def test_grid_values_that_share_a_run_folder_are_one_line_before_any_run(tmp_path, grid, message):
    """Two grid points in one folder: one ran (or was skipped as done) for both, its seeds counted twice in the
    report, the other never ran."""
    from esrl.errors import ConfigError

    with pytest.raises(ConfigError) as error:
        one_study(tmp_path, grid=grid)
    assert str(error.value).startswith(message) and "\n" not in str(error.value), error.value
    assert not (tmp_path / "out").exists()
    runs = plan(one_study(tmp_path, grid={"model.es.sigma": [0.01, 0.02], "data.task_args.path": ["a/b", "c"]}))
    assert len({r.root for r in runs}) == len(runs) == 4


def test_the_connectivity_header_is_the_analysis_own_alphas(tmp_path):
    """The analysis sorts and deduplicates its alphas; the header gave the study's order ([0, 1, 0.5]) above cells
    in sorted order, so the reward at a = 0.5 read as the one at a = 1."""
    from esrl.study.report import _analyses_section

    study = one_study(tmp_path, analysis=AnalysisSettings(alphas=[0.0, 1.0, 0.5, 1.0]))
    data = {"alphas": [0.0, 0.5, 1.0], "pairs": [{"a": "base", "b": "es/s0", "kind": "base->run", "reward_barrier": 0.0,
            "nll_barrier": 0.0, "points": [{"alpha": a, "reward": 10 * a, "nll": 1.0} for a in (0.0, 0.5, 1.0)]}]}
    path = tmp_path / "connectivity.json"
    path.write_text(json.dumps(data))
    lines: list[str] = []
    _analyses_section(lines, study, "all", {"connectivity": [("seed=0", path)]}, {}, tmp_path)
    header, _, row = [line for line in lines if line.startswith("|")]
    assert header.endswith("| reward at a = 0.0, 0.5, 1.0 |") and row.endswith("| 0 / 5 / 10 |"), lines


def test_changed_analysis_settings_rerun_the_analysis_and_same_ones_reuse_it(tiny_model, tmp_path, monkeypatch):
    """The reuse check compared only the models: new alphas, sigmas, prompts, tokens... gave the old numbers
    under the new settings' labels. A real `esrl analyze` writes the record compared here."""
    import esrl.analysis.cli as analysis_cli
    from esrl.study import analyses
    from esrl.study.results import RunResult

    real, calls = analysis_cli.main, []
    monkeypatch.setattr(analysis_cli, "main", lambda argv: (calls.append(argv), real(argv)))
    run = plan(one_study(tmp_path))[0]
    config = {"model": {"policy": {"name_or_path": tiny_model}, "rollout": {"max_new_tokens": 2}},
              "data": {"task": "conciseness", "task_args": dict(CONCISENESS_FILES)}}
    model = RunResult(run, [{"step": 0, "reward": 0.0}], {}, Path(tiny_model))

    def report(**settings) -> None:
        study = one_study(tmp_path, analysis=AnalysisSettings(**{"analyses": ["connectivity"], "num_prompts": 1,
                                                                 "device": "cpu", **settings}))
        analyses.run_point(study, "all", {"es": [model]}, config)

    report(alphas=[0, 1])
    report(alphas=[0.0, 1.0])  # the same grid
    assert len(calls) == 1
    for changed in ({"alphas": [0, 0.5, 1]}, {"alphas": [0, 0.5, 1], "num_prompts": 2},
                    {"alphas": [0, 0.5, 1], "num_prompts": 2, "max_new_tokens": 3}):
        report(**changed)
    assert len(calls) == 4
    written = json.loads((tmp_path / "out" / "analysis" / "all" / "connectivity_seed=0" / "connectivity.json")
                         .read_text())
    assert written["alphas"] == [0.0, 0.5, 1.0]
    summary = tmp_path / "out" / "analysis" / "all" / "connectivity_seed=0" / "summary.json"
    assert not list(summary.parent.glob("*.partial"))
    for damaged in (summary.read_text()[:40], "[1, 2]"):  # a kill mid-write (before writes were whole), a hand edit
        summary.write_text(damaged)  # was a raw JSONDecodeError (AttributeError) out of `esrl study --report`
        report(alphas=[0, 0.5, 1], num_prompts=2, max_new_tokens=3)
        assert json.loads(summary.read_text())["models"][0]["path"] == tiny_model
    assert len(calls) == 6


def test_a_bad_reward_count_missing_from_an_evaluation_counts_as_zero(tmp_path):
    """The evaluation writes bad_rewards (and sampled/bad_rewards) only when above 0: 3 seeds with 0, 0 and 6 bad
    rewards read "6 (n=1)", a mean over the one seed that had any."""
    from esrl.study.report import _fmt
    from esrl.study.results import collect, summarize

    runs = plan(one_study(tmp_path, seeds=[0, 1, 2]))
    for r in runs:
        last = {"step": 4, "reward": 1.0, "sampled/reward": 0.5,
                **({"bad_rewards": 6.0, "sampled/bad_rewards": 3.0} if r.seed == 2 else {})}
        write_version(r.root, 0, [], final=True)
        (r.root / "lightning_logs" / "version_0" / "eval.jsonl").write_text(
            json.dumps({"step": 0, "reward": 0.0}) + "\n" + json.dumps(last) + "\n")
    group = summarize([collect(r) for r in runs])["groups"][0]
    assert group["bad_rewards"]["values"] == [0.0, 0.0, 6.0] and _fmt(group["bad_rewards"], 3).startswith("2 ± ")
    assert group["sampled/bad_rewards"]["values"] == [0.0, 0.0, 3.0]
    assert group["reward"]["n"] == 3


def test_t95_beyond_the_table_follows_the_t_distribution_not_the_normal():
    """Reference quantiles of Student's t (two-sided 95%); past 30 degrees of freedom t95 once gave 1.96."""
    from esrl.study.results import t95

    for df, exact in ((30, 2.042), (31, 2.0395), (40, 2.0211), (60, 2.0003), (120, 1.9799), (10_000, 1.9602)):
        assert t95(df) == pytest.approx(exact, abs=1e-4), df
    assert all(t95(df) > t95(df + 1) for df in range(1, 200))


def test_connectivity_pairs_the_runs_of_one_seed_when_a_run_failed(tmp_path, monkeypatch):
    """es seed 0 failed: connectivity "seed=1" compared es seed 1 with grpo seed 0 (runs paired by position)."""
    from esrl.study import analyses
    from esrl.study.results import RunResult

    algorithms = [AlgorithmSpec("es", "es"), AlgorithmSpec("grpo", "grpo")]
    study = StudyConfig(base_config="base.yaml", algorithms=algorithms, out=str(tmp_path / "out"), seeds=[0, 1],
                        analysis=AnalysisSettings(analyses=["connectivity", "robustness"], connectivity_seeds=2,
                                                  robustness_seeds=1))
    runs = {(r.algorithm.label, r.seed): r for r in plan(study)}
    done = lambda key: RunResult(runs[key], [{"step": 0, "reward": 0.0}], {}, tmp_path / "final")  # noqa: E731
    members = {"es": [done(("es", 1))], "grpo": [done(("grpo", 0)), done(("grpo", 1))]}
    calls = []
    monkeypatch.setattr(analyses, "_analyze", lambda name, study, config, models, out: calls.append(
        (name, out.name, [(m.run.algorithm.label, m.run.seed) for m in models])) or out)
    analyses.run_point(study, "", members, {})
    assert calls == [("connectivity", "connectivity_seed=0", [("grpo", 0)]),
                     ("connectivity", "connectivity_seed=1", [("es", 1), ("grpo", 1)]),
                     ("robustness", "robustness", [("grpo", 0)])]


def test_a_finished_run_counts_as_changed_by_its_settings_not_by_its_folder_or_checkpointing(tmp_path):
    """changed_setting: a study folder moved elsewhere, or a new checkpoint_every_n_steps, leaves the runs' results
    as they were (no refusal); a changed trainer.max_steps does not."""
    import shutil

    import yaml
    from esrl.study.runner import changed_setting, resolved_config

    study = one_study(tmp_path / "a", checkpoint_every_n_steps=2, base={"trainer": {"max_steps": 4}})
    (run,) = plan(study)
    write_version(run.root, 0, [(0, 0.0)], final=True)
    (run.root / "config.yaml").write_text(yaml.safe_dump(resolved_config(study, run), sort_keys=False))
    assert changed_setting(study, run) is None
    shutil.move(tmp_path / "a", tmp_path / "b")
    for moved in (one_study(tmp_path / "b", checkpoint_every_n_steps=2, base={"trainer": {"max_steps": 4}}),
                  one_study(tmp_path / "b", checkpoint_every_n_steps=0, base={"trainer": {"max_steps": 4}})):
        assert changed_setting(moved, plan(moved)[0]) is None
    edited = one_study(tmp_path / "b", base={"trainer": {"max_steps": 8}})
    assert changed_setting(edited, plan(edited)[0]) == "trainer.max_steps: 4 there, 8 now"
