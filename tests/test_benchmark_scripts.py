"""Every benchmark script imports and parses its command line (`--help`), as litgpt's tests load every config: a
moved helper or a renamed import breaks a benchmark where no test runs it (most need minutes, or a GPU). One child
process runs them all, so torch is imported once. This checks that they start, not what they measure."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = sorted(p for p in [*ROOT.glob("benchmarks/*.py"), *ROOT.glob("benchmarks/gpu/*.py")]
                 if p.name != "bench_setup.py")

CHILD = """
import contextlib, io, json, runpy, sys
failed, usage = [], {}
for path in sys.argv[1:]:
    sys.argv = [path, "--help"]
    sys.path[:0] = [str(__import__("pathlib").Path(path).parent)]
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_path(path, run_name="__main__")
        failed.append((path, "no SystemExit from --help"))
    except SystemExit as e:
        if e.code not in (0, None) or "usage:" not in out.getvalue():
            failed.append((path, f"exit {e.code}"))
        usage[path] = out.getvalue()
    except Exception as e:
        failed.append((path, f"{type(e).__name__}: {e}"))
    finally:
        del sys.path[0]
print(json.dumps({"failed": failed, "usage": usage}))
"""


@pytest.fixture(scope="module")
def usages() -> dict:
    """{"failed": [(script, why)], "usage": {script: its --help text}}, from one child process."""
    done = subprocess.run([sys.executable, "-c", CHILD, *map(str, SCRIPTS)], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_every_benchmark_script_starts_and_prints_its_usage(usages):
    assert len(SCRIPTS) >= 10, SCRIPTS
    assert not usages["failed"], usages["failed"]
    assert set(usages["usage"]) == set(map(str, SCRIPTS))


def test_the_gpu_call_scripts_parse_and_pass_only_flags_their_benchmarks_have(usages):
    """A device session's one call runs benchmarks/gpu/*.sh on a machine lent for minutes: a shell syntax error, or
    a flag a benchmark no longer has, would spend it. Each script parses (`bash -n`), and every --flag written on a
    line that runs a benchmark (or in the shell variables it passes, BENCH's) is in that benchmark's --help."""
    import re

    flag = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
    checked = 0
    for script in sorted(ROOT.glob("benchmarks/gpu/*.sh")):
        assert subprocess.run(["bash", "-n", script], capture_output=True).returncode == 0, script
        text = script.read_text()
        variables = dict(re.findall(r'^(\w+)="([^"]*)"', text, re.MULTILINE))
        for bench in sorted(set(re.findall(r"(\w+\.py) ", text))):
            path = next((p for p in SCRIPTS if p.name == bench), None)
            if path is None:
                continue
            lines = [line for line in text.replace("\\\n", " ").splitlines()
                     if f"{bench} " in line and "python" in line]
            used = {f for line in lines for f in flag.findall(line)}
            used |= {f for line in lines for name in re.findall(r"\$(\w+)", line)
                     for f in flag.findall(variables.get(name, ""))}
            help_text = usages["usage"][str(path)]
            assert not used - set(flag.findall(help_text)), (script.name, bench, used - set(flag.findall(help_text)))
            checked += len(used)
    assert checked > 20, checked  # the scripts' benchmark lines were found
