"""math-verify behind a time limit, in a child process that can be killed: the math task's only verifier.

HuggingFace's `math-verify` parses a gold answer and a completion (LaTeX through an ANTLR grammar, plain
arithmetic through SymPy on a string its regex limits to digits and operators) and checks their equivalence.
Its own timeout uses `signal.alarm`, which works only in the main thread of the main interpreter and cannot
interrupt C code (a huge integer power). So esrl runs it in a child process (`python -m
esrl.tasks.math_verifier`, JSON lines over pipes; no fork of the training process, no signal in it): the
child gives each completion a soft limit of its own (an interval timer, 0.8 x the limit) and the parent waits
at most `time_limit` seconds for the answer, then kills the child, scores the completion 0 as `timeout` and
starts a fresh child for the next one. The child also caps its address space (MEMORY_LIMIT) so a
memory bomb fails there. Nothing in it ever executes model output as code.

Statuses: `correct`, `wrong`, `unparsed` (no answer found in the completion, or math-verify failed on it),
`timeout` (past the limit, or the child died on it), `bad_gold` (the data set's answer itself did not parse).
Only `correct` scores 1.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import threading
import time
from collections import Counter
from typing import Sequence

from esrl.errors import ConfigError

STATUSES = ("correct", "wrong", "unparsed", "timeout", "bad_gold")
INSTALL_HINT = "data.task: math needs math-verify: pip install 'esrl[math]'"
MEMORY_LIMIT = 4 << 30
"""Address-space cap of the child process (bytes)."""
START_TIMEOUT = 120.0
"""Seconds a fresh child may take to import math-verify and say it is ready."""
_CACHE_SIZE = 8192


def math_verify_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("math_verify") is not None


class MathVerifier:
    """`verify(golds, completions)` -> one status per completion, each within `time_limit` seconds.

    Results are cached by (gold, completion), so an evaluation that asks for the reward and then the metrics
    of the same completions verifies them once. `counts` holds how many completions got each status (fresh
    answers only, not cache hits) and `restarts` how many children were killed; both are cumulative.
    """

    def __init__(self, time_limit: float = 5.0, soft_limit: float | None = None):
        if not time_limit > 0:
            raise ConfigError(f"data.task_args.time_limit: must be > 0 seconds, got {time_limit}")
        self.time_limit = float(time_limit)
        # The child's own limit: past it, it answers `timeout` itself and stays alive (default 0.8 x limit).
        self.soft_limit = 0.8 * self.time_limit if soft_limit is None else float(soft_limit)
        self.counts: Counter[str] = Counter()
        self.restarts = 0
        self._proc: subprocess.Popen | None = None
        self._buffer = b""
        self._cache: dict[tuple[str, str], str] = {}
        self._lock = threading.Lock()

    # -- the child ---------------------------------------------------------------------------------------
    def _start(self) -> None:
        if not math_verify_available():
            raise ConfigError(INSTALL_HINT)
        self._buffer = b""
        # Its own session: a Ctrl-C meant for the run does not reach it (it exits when its stdin closes, and dies
        # with this process where the kernel can tell it: _die_with_parent).
        main = threading.current_thread() is threading.main_thread()
        self._proc = subprocess.Popen([sys.executable, "-m", "esrl.tasks.math_verifier"],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0,
                                      env={**os.environ, "OMP_NUM_THREADS": "1",
                                           PARENT_ENV: str(os.getpid()) if main else ""}, start_new_session=True)
        line = self._read_line(START_TIMEOUT)
        if line is None or json.loads(line).get("ready") is not True:
            detail = json.loads(line).get("error", "") if line else "no answer"
            self.close()
            raise ConfigError(f"{INSTALL_HINT} (the verifier process did not start: {detail})")

    def _read_line(self, timeout: float) -> bytes | None:
        """One line from the child within `timeout` seconds; None if it is late or gone."""
        deadline = time.monotonic() + timeout
        fd = self._proc.stdout.fileno()
        while b"\n" not in self._buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
                return None
            chunk = os.read(fd, 65536)
            if not chunk:  # the child died
                return None
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line

    def close(self) -> None:
        """Stop the child (a later call starts a new one)."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc is not None:
            for stream in (proc.stdin, proc.stdout):
                stream.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    def __getstate__(self) -> dict:  # a process handle does not pickle; a copy starts its own child
        state = self.__dict__.copy()
        state.update(_proc=None, _buffer=b"", _lock=None)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, _lock=threading.Lock())

    # -- verification ------------------------------------------------------------------------------------
    def _one(self, gold: str, completion: str) -> str:
        if self._proc is None or self._proc.poll() is not None:
            self._start()
        request = json.dumps({"gold": gold, "pred": completion, "limit": self.soft_limit}) + "\n"
        try:
            self._proc.stdin.write(request.encode())
            line = self._read_line(self.time_limit)
        except (BrokenPipeError, OSError):
            line = None
        if line is None:  # late (or it died): kill it, score 0; the next completion gets a fresh child
            self.close()
            self.restarts += 1
            return "timeout"
        status = json.loads(line).get("status")
        return status if status in STATUSES else "unparsed"

    def verify(self, golds: Sequence[str], completions: Sequence[str]) -> list[str]:
        with self._lock:
            out = []
            for gold, completion in zip(golds, completions):
                key = (gold, completion)
                if key not in self._cache:
                    if len(self._cache) >= _CACHE_SIZE:
                        self._cache.clear()
                    self._cache[key] = self._one(gold, completion)
                    self.counts[self._cache[key]] += 1
                out.append(self._cache[key])
            return out


# ---------------------------------------------------------------------------------------------------------
# The child process: python -m esrl.tasks.math_verifier


class _SoftTimeout(BaseException):
    """Raised by the child's interval timer; a BaseException, so math-verify's handlers let it pass."""


PARENT_ENV = "ESRL_VERIFIER_PARENT"
"""The parent's pid, given to the child when the parent's main thread starts it (the kernel's parent-death signal
fires when the starting *thread* ends, so a child another thread started does without it)."""


def _die_with_parent() -> None:
    """Linux: the kernel kills the child when its parent dies. A parent killed by SIGKILL (the OOM killer, srun past
    its grace period) cannot close the child, which would run on for minutes inside a costly completion, in C code
    its soft timer does not interrupt, an orphan holding a core."""
    import signal

    parent = os.environ.get(PARENT_ENV, "")
    if not parent or not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != int(parent):  # it died before the line above took effect
        os._exit(0)


def _serve() -> None:
    import logging
    import resource
    import signal

    _die_with_parent()

    out = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    sys.stdout = sys.stderr  # only answers go to the parent's pipe
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        if hard == resource.RLIM_INFINITY or hard > MEMORY_LIMIT:
            resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, hard))
    except (ValueError, OSError):
        pass
    try:
        from math_verify import parse, verify
    except ImportError as e:
        out.write(json.dumps({"error": str(e)}) + "\n")
        return
    logging.disable(logging.CRITICAL)  # math-verify logs every input it could not parse, in full

    def alarm(signum, frame):
        raise _SoftTimeout

    signal.signal(signal.SIGALRM, alarm)
    golds: dict[str, list] = {}
    out.write(json.dumps({"ready": True}) + "\n")
    for line in sys.stdin:
        request = json.loads(line)
        signal.setitimer(signal.ITIMER_REAL, max(0.01, request["limit"]))
        try:
            gold = golds.get(request["gold"])
            if gold is None:
                gold = golds[request["gold"]] = parse(request["gold"], parsing_timeout=None)
                if len(golds) > _CACHE_SIZE:
                    golds.clear()
            pred = parse(request["pred"], parsing_timeout=None)
            if not gold:
                status = "bad_gold"
            elif not pred:
                status = "unparsed"
            else:
                status = "correct" if verify(gold, pred, timeout_seconds=None) else "wrong"
        except _SoftTimeout:
            status = "timeout"
        except (Exception, RecursionError, MemoryError):  # noqa: BLE001 - any failure scores 0
            status = "unparsed"
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        out.write(json.dumps({"status": status}) + "\n")


if __name__ == "__main__":
    _serve()
