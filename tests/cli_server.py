"""Forks `esrl` runs from one process that has imported esrl.cli already (started by tests/cli_runner.py).

Reads one JSON request per line on stdin: {"argv", "cwd", "env", "stdout", "stderr", "timeout"}; forks a child that
becomes its own process group, takes the call's cwd, environment, argv and output files, and runs the CLI's
`main()` as `python -m esrl.cli` would (SystemExit codes, uncaught errors as a traceback and exit 1, atexit
handlers, flushed streams); waits for it (killing its group past the timeout) and answers one JSON line:
{"returncode", "timed_out"}. A returncode is negative for a signal, as subprocess reports it. A request whose
PYTHONPATH adds a folder holding a module this process imported already is answered {"unforkable": name} instead
(a fresh interpreter would import that module from the folder).
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import sys
import time
import traceback

import esrl.cli  # the ~8 s of imports (torch, transformers, Lightning) every forked call skips

STARTED_WITH = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]


def python_path(env: dict) -> list[str]:
    """The request's PYTHONPATH folders."""
    return [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]


def shadowed(folders: list[str]) -> str | None:
    """A module this process imported already that one of `folders` (added by a request) also holds."""
    for folder in set(folders) - set(STARTED_WITH):
        names = os.listdir(folder) if os.path.isdir(folder) else []
        for name in names:
            module = name[:-3] if name.endswith(".py") else name
            if module in sys.modules:
                return module
    return None


def run_child(request: dict) -> None:
    """In the forked child: become the CLI process the request describes, run it, never return."""
    code = 1
    try:
        os.setpgid(0, 0)
        os.chdir(request["cwd"])
        sys.path[0] = request["cwd"]  # as `python -m` puts the working directory first, then PYTHONPATH
        sys.path[1:] = python_path(request["env"]) + [p for p in sys.path[1:] if p not in STARTED_WITH]
        os.environ.clear()
        os.environ.update(request["env"])
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
            os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
        # What `python -m esrl.cli` sets, and what Lightning's DDP launcher re-runs for each further rank.
        sys.argv = [esrl.cli.__file__, *request["argv"]]
        sys.modules["__main__"].__spec__ = esrl.cli.__spec__
        try:
            esrl.cli.main()
            code = 0
        except SystemExit as e:
            if e.code is None or isinstance(e.code, int):
                code = e.code or 0
            else:
                print(e.code, file=sys.stderr)
        except BaseException:
            traceback.print_exc()
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code)


def wait(pid: int, timeout: float) -> tuple[int, bool]:
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status), False
        if time.monotonic() > deadline:
            os.killpg(pid, signal.SIGKILL)
            _, status = os.waitpid(pid, 0)
            return os.waitstatus_to_exitcode(status), True
        time.sleep(0.02)


def serve() -> None:
    print(json.dumps({"ready": os.getpid()}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        module = shadowed(python_path(request["env"]))
        if module is not None:
            print(json.dumps({"unforkable": module}), flush=True)
            continue
        pid = os.fork()
        if pid == 0:
            run_child(request)
        returncode, timed_out = wait(pid, request["timeout"])
        print(json.dumps({"returncode": returncode, "timed_out": timed_out}), flush=True)


if __name__ == "__main__":
    serve()
