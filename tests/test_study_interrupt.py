"""`esrl study` interrupted: a run's newest checkpoint, and SIGTERM reaching the running fits, which a rerun resumes."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from conftest import ROOT, run_esrl
from study_files import write_study

pytestmark = pytest.mark.slow


def test_an_interrupted_runs_newest_checkpoint_is_its_interrupted_ckpt_or_a_newer_periodic_one(tmp_path):
    """A signal saves lightning_logs/version_N/checkpoints/interrupted.ckpt, not in the study's checkpoints/: the
    run is interrupted and resumes from the newer of the two (it restarted from step 0, or an older step)."""
    from esrl.fit_runs import last_checkpoint
    from esrl.study.config import AlgorithmSpec
    from esrl.study.runner import Run, status

    run = Run(AlgorithmSpec("es", "es", {}), {}, 0, tmp_path / "es_seed=0")
    interrupted = run.root / "lightning_logs" / "version_0" / "checkpoints" / "interrupted.ckpt"
    interrupted.parent.mkdir(parents=True)
    interrupted.write_bytes(b"x")
    (run.root / "fit.log").write_text("...\nesrl: SIGTERM at step 3: saved ...\n")
    (run.root / "returncode").write_text("143\n")
    assert last_checkpoint(run.root) == interrupted and status(run) == "interrupted"
    older = [run.root / "checkpoints" / "step=2.ckpt", run.root / "lightning_logs/version_1/checkpoints/last.ckpt"]
    for when, ckpt in enumerate(older):  # saved before the signal
        ckpt.parent.mkdir(parents=True)
        ckpt.write_bytes(b"x")
        os.utime(ckpt, (1_000_000 + when, 1_000_000 + when))
    assert last_checkpoint(run.root) == interrupted
    pick = re.search(r"^CKPT=\$\((.*)\)$", (ROOT / "slurm" / "fit.sbatch").read_text(), re.M).group(1)
    shell = subprocess.run(["bash", "-c", pick], env={**os.environ, "ROOT": str(run.root)}, capture_output=True,
                           text=True)
    assert shell.stdout.strip() == str(interrupted)  # slurm/fit.sbatch's pick is the same
    periodic = older[0]
    os.utime(periodic, (4_000_000_000, 4_000_000_000))  # the resumed run went on past the interrupted step
    assert last_checkpoint(run.root) == periodic


def test_sigterm_stops_the_running_fits_with_their_checkpoints_and_a_rerun_resumes_them(tiny_model, tmp_path):
    """SIGTERM to `esrl study` (kill, SLURM's time limit) reaches its running fits: each stops after its step
    with interrupted.ckpt, the study exits 143, and a rerun resumes each from that checkpoint into its folder.
    Before, the fits ran to the end (the signal reached only the study's main thread, which waited for them)."""
    import signal
    import time

    path = write_study(tmp_path, tiny_model, algorithms={"es": None}, checkpoint_every_n_steps=0,
                       overrides={"trainer.max_steps": 1000})
    runs = [tmp_path / "out" / "runs" / f"es_seed={s}" for s in (0, 1)]
    proc = subprocess.Popen([sys.executable, "-m", "esrl", "study", str(path), "--jobs", "2"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        deadline = time.monotonic() + 300
        while not all((r / "lightning_logs" / "version_0" / "eval.jsonl").is_file() for r in runs):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-3000:]
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)  # the study alone, as `kill PID` does
        out = proc.communicate(timeout=120)[0]
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail("the study did not stop its fits: " + proc.communicate()[0][-3000:])
    assert proc.returncode == 143, out[-3000:]
    assert out.count("interrupted by SIGTERM") == 2 and "report" not in out, out[-3000:]
    for run in runs:
        assert (run / "lightning_logs" / "version_0" / "checkpoints" / "interrupted.ckpt").is_file(), out[-3000:]
        assert not (run / "lightning_logs" / "version_0" / "final").exists()
    path = write_study(tmp_path, tiny_model, algorithms={"es": None}, checkpoint_every_n_steps=0,
                       overrides={"trainer.max_steps": 2}, analysis={"analyses": []})  # the report: test_study
    res = run_esrl("study", path, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert res.stdout.count("resuming from interrupted.ckpt") == 2, res.stdout
    for run in runs:
        assert [p.name for p in (run / "lightning_logs").iterdir()] == ["version_0"]  # resumed into its folder
        assert (run / "lightning_logs" / "version_0" / "final" / "config.json").is_file()
        assert "Restored all states from the checkpoint" in (run / "fit.log").read_text()
