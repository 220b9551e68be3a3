"""Fits in their own processes, for `esrl sweep` and `esrl study`: each one's output in ROOT/fit.log (appended to
on a resume), its exit status in ROOT/returncode, and a signal to the parent (SIGTERM: kill, SLURM's time limit;
Ctrl+C) passed on to the running fits, so each stops after its step with interrupted.ckpt
(esrl.callbacks.interruption) and the parent exits 143 / 130. subprocess.run in worker threads kept them out of
reach: the parent waited for them to finish."""

from __future__ import annotations

import signal
import subprocess
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from esrl.checkpoints import newest_checkpoint, run_checkpoints


def version_folders(root: Path) -> list[Path]:
    """A run's lightning_logs/version_N folders, oldest first (N as a number; a version_0_old copy is not one of
    them: its name once ended a study's report in a traceback)."""
    found = [p for p in Path(root).glob("lightning_logs/version_*")
             if p.is_dir() and p.name.removeprefix("version_").isdigit()]
    return sorted(found, key=lambda p: int(p.name.removeprefix("version_")))


def final_dir(root: Path) -> Path | None:
    """The run's trained model (its newest lightning_logs/version_N/final/), None while it has none."""
    finals = [v / "final" for v in version_folders(root) if (v / "final" / "config.json").is_file()]
    return finals[-1] if finals else None


def last_checkpoint(root: Path) -> Path | None:
    """The newest of a study's periodic checkpoints (checkpoints/) and the fit's own (a signal's interrupted.ckpt
    in lightning_logs/version_N/checkpoints/), picked as slurm/fit.sbatch and `--ckpt_path last` pick: where a
    rerun of a study or a sweep resumes a run."""
    return newest_checkpoint([*root.glob("checkpoints/*.ckpt"), *run_checkpoints(root)])


class Fits:
    """The running fits of one sweep or study."""

    def __init__(self) -> None:
        self.lock = threading.RLock()  # a second signal may arrive while the handler holds it
        self.running: set[subprocess.Popen] = set()
        self.signal: str | None = None
        """The first signal the parent got (SIGTERM, SIGINT); no run starts after it."""
        self.active = False
        """Whether runs are under way: a signal before that stops the parent at once."""

    def stop(self, signum: int) -> None:
        """SIGTERM to each running fit. SIGTERM for a Ctrl+C too: a terminal's reaches the fits itself, and a
        second SIGINT would stop them at once, without a checkpoint."""
        with self.lock:
            self.signal = self.signal or signal.Signals(signum).name
            for proc in self.running:
                proc.send_signal(signal.SIGTERM)

    def run(self, cmd: list[str], root: Path, append: bool = False) -> int | None:
        """Run one fit command, where stop() reaches it; None, and nothing run, once the parent was stopped."""
        root.mkdir(parents=True, exist_ok=True)
        with (root / "fit.log").open("a" if append else "w") as log:
            log.write("$ " + " ".join(cmd) + "\n")
            log.flush()
            with self.lock:
                if self.signal:
                    return None
                proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
                self.running.add(proc)
            rc = proc.wait()
            with self.lock:
                self.running.discard(proc)
        (root / "returncode").write_text(f"{rc}\n")
        return rc

    @contextmanager
    def under_way(self) -> Iterator[None]:
        """While runs are under way, a signal stops them (stop) rather than the parent at once."""
        self.active = True
        try:
            yield
        finally:
            self.active = False

    def exit_if_stopped(self, tool: str, unfinished: list[str]) -> None:
        """After a signal: one line naming the unfinished runs, and the signal's exit status."""
        if self.signal:
            print(f"esrl {tool}: {self.signal}: stopped, {len(unfinished)} run(s) unfinished ({', '.join(unfinished)})"
                  f"; rerun the {tool} to resume them", flush=True)
            raise SystemExit(128 + signal.Signals[self.signal])


@contextmanager
def signals_reach(fits: Fits) -> Iterator[None]:
    """SIGTERM and SIGINT to this process go to `fits`; before runs start they stop it at once (143, Ctrl+C's
    KeyboardInterrupt). Only the main thread can take signals (a tool called from another thread runs as before)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_signal(signum, frame) -> None:
        fits.stop(signum)
        if not fits.active:
            raise KeyboardInterrupt if signum == signal.SIGINT else SystemExit(128 + signum)

    before = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)
