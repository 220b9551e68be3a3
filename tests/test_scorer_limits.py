"""The scorer service's limits: a body over the size limit is refused while it streams in (chunked too), and a
token is required by default, found by the client where the service put it (benchmarks/scorer_load.py is the
load test)."""

from __future__ import annotations

import os
import re
import socket
import stat

import pytest
from conftest import free_port
from esrl.errors import ConfigError
from esrl.scoring.base import Scorer
from esrl.scoring.token import ENV, ENV_FILE, client_token, server_token


class Constant(Scorer):
    name = "constant"

    def _score(self, prompts, responses):
        return [1.0] * len(prompts), [0.0] * len(prompts)


@pytest.fixture
def service():
    from esrl.scoring.service import create_app, serve_in_thread

    server, thread, port = serve_in_thread(create_app(Constant(), token="t0ken", max_items=4, max_chars=1000))
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=10)


def test_a_chunked_body_over_the_limit_is_refused_without_reading_it_whole(service):
    import httpx

    sent = 0

    def stream():  # 128 MiB, no Content-Length (chunked transfer encoding)
        nonlocal sent
        for _ in range(2048):
            sent += 65536
            yield b"x" * 65536

    headers = {"Authorization": "Bearer t0ken"}
    answer = httpx.post(f"{service}/score_batch", content=stream(), headers=headers, timeout=30)
    assert answer.status_code == 413
    limit, read = map(int, re.search(r"limit of (\d+) bytes \(stopped reading at (\d+)\)",
                                     answer.json()["detail"]).groups())
    assert limit < read <= limit + 1024 * 1024  # stopped within a chunk or so of the limit
    assert sent < 32 * 1024 * 1024  # the client was cut off long before its 128 MiB
    assert httpx.get(f"{service}/health", headers=headers, timeout=5).status_code == 200  # still serving


def test_a_client_left_without_limits_splits_by_the_services_after_its_first_413(service):
    """The service takes 4 items a request; a client told no limits sends 10, is refused (413), reads GET /health
    once and sends them 4, 4 and 2 at a time: every reward comes back, in order."""
    from esrl.scoring.client import HTTPScorer

    scorer = HTTPScorer(service, token="t0ken", retries=0)
    assert scorer.score(["p"] * 10, [f"r{i}" for i in range(10)])[0] == [1.0] * 10
    assert (scorer.max_items, scorer.max_chars) == (4, 1000)
    with pytest.raises(ValueError, match="max_items and max_chars must be >= 1"):
        HTTPScorer(service, token="t0ken", max_items=0)


def test_a_bad_answer_names_its_item_in_the_whole_batch_not_in_its_request():
    """A service (not esrl's) that answers a string for the response "bad": the client names rewards[3] of the 4 it
    was asked, not rewards[1] of the second request of 2."""
    from esrl.errors import ScorerError
    from esrl.scoring.client import HTTPScorer
    from esrl.scoring.service import serve_in_thread
    from fastapi import FastAPI

    app = FastAPI()

    @app.post("/score_batch")
    async def score_batch(body: dict):
        responses = body["responses"]
        return {"rewards": ["x" if r == "bad" else 1.0 for r in responses], "costs": [0.0] * len(responses)}

    server, thread, port = serve_in_thread(app)
    try:
        scorer = HTTPScorer(f"http://127.0.0.1:{port}", retries=0, max_items=2)
        with pytest.raises(ScorerError, match=r"score_batch \(items 2\.\.3 of 4\): rewards\[3\] is not a number"):
            scorer.score(["p"] * 4, ["a", "b", "c", "bad"])
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def test_a_token_is_generated_printed_once_and_required(service, monkeypatch, capsys):
    import httpx

    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.delenv(ENV_FILE, raising=False)
    token = server_token(None, None, no_token=False, host="127.0.0.1")
    assert len(token) >= 32 and capsys.readouterr().err.count(token) == 1
    assert server_token(None, None, no_token=False, host="127.0.0.1") != token  # a new one each start
    assert httpx.get(f"{service}/health", timeout=5).status_code == 401  # no token: refused


def test_token_file_written_once_and_read_by_the_client(tmp_path, monkeypatch):
    from esrl.scoring.client import HTTPScorer

    monkeypatch.delenv(ENV, raising=False)
    path = tmp_path / "secrets" / "scorer_token"
    token = server_token(None, str(path), no_token=False, host="0.0.0.0")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert server_token(None, str(path), no_token=False, host="0.0.0.0") == token  # a restart keeps it
    monkeypatch.setenv(ENV_FILE, str(path))
    assert client_token() == token and HTTPScorer("http://127.0.0.1:1").token == token
    monkeypatch.setenv(ENV, "from-env")
    assert client_token("explicit") == "explicit"
    path.write_text("two words\n")
    with pytest.raises(ConfigError, match=f"scorer token file {path}: expected one token"):
        client_token()


def test_a_token_an_http_header_cannot_carry_is_named_where_it_came_from(tmp_path, monkeypatch):
    """httpx encodes a header as ASCII: a token 'clé' raised UnicodeEncodeError from inside the first request (or
    `esrl env`'s scorer check), naming neither the token nor where it came from. Each source is named, before any
    request; the judge's API key too."""
    from esrl.elo.judge import api_key_from_env

    monkeypatch.delenv(ENV_FILE, raising=False)
    monkeypatch.setenv(ENV, "clé")
    with pytest.raises(ConfigError, match=f"^{ENV}: a token must be printable ASCII without spaces"):
        client_token()
    with pytest.raises(ConfigError, match=r"^the scorer's token \(data.task_args.token\): a token must be"):
        client_token("clé")
    path = tmp_path / "token"
    path.write_text("pässwort\n")
    monkeypatch.setenv(ENV_FILE, str(path))
    with pytest.raises(ConfigError, match=f"^scorer token file {path}: a token must be"):
        client_token()
    with pytest.raises(ConfigError, match="^--token: a token must be"):
        server_token("clé", None, no_token=False, host="127.0.0.1")
    monkeypatch.setenv("OPENAI_API_KEY", "sk-é")
    monkeypatch.delenv("ESRL_JUDGE_API_KEY", raising=False)
    with pytest.raises(ConfigError, match="^OPENAI_API_KEY: a token must be"):
        api_key_from_env()


def test_no_token_is_refused_off_loopback_in_one_line(capsys):
    from esrl.cli import main

    with pytest.raises(SystemExit) as exit_:  # esrl's entry point in process: the error comes before any model
        main(["serve-scorer", "--no-token", "--host", "0.0.0.0", "--reward-model", "/no/such/model"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "esrl serve-scorer: error: --no-token serves anyone who can reach it: allowed on a loopback "
        "--host (127.0.0.1, localhost, ::1) only, got 0.0.0.0"]
    with pytest.raises(ConfigError, match="choose one"):
        server_token("t", None, no_token=True, host="127.0.0.1")
    assert server_token(None, None, no_token=True, host="::1") is None


@pytest.mark.parametrize("flags, message", [
    (["--device", "banana"], "--device 'banana': not a device name"),
    (["--device", "cuda:99"], "--device 'cuda:99': "),
    (["--judge", "REWARD"], "judge 'REWARD': its checkpoint lacks lm_head.weight"),  # a score model as judge
])
def test_bad_serve_scorer_flags_are_one_line_before_listening(score_models, monkeypatch, capsys, flags,
                                                              message):
    """Refused at startup, before it listens; no token line (printed only when it is about to listen)."""
    import uvicorn

    from esrl.cli import main

    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.delenv(ENV_FILE, raising=False)
    monkeypatch.setattr(uvicorn, "run", lambda *a, **k: pytest.fail("it listened despite the bad flag"))
    flags = [f.replace("REWARD", score_models[0]) for f in flags]
    message = message.replace("REWARD", score_models[0])
    with pytest.raises(SystemExit) as exit_:
        main(["serve-scorer", *(flags if "--judge" in flags else ["--reward-model", score_models[0], *flags]),
              "--port", str(free_port())])
    assert exit_.value.code == 2
    err = [line for line in capsys.readouterr().err.splitlines()
           if line.strip() and "Loading weights" not in line]  # transformers' progress bar
    assert len(err) == 1 and err[0].startswith(f"esrl serve-scorer: error: {message}"), err


def test_the_token_is_printed_once_the_models_have_loaded(score_models, monkeypatch, capsys):
    import uvicorn

    from esrl.scoring import score_model
    from esrl.scoring.service import main

    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.delenv(ENV_FILE, raising=False)
    events = []
    real = score_model.ScoreModel.__init__

    def load(self, *args, **kwargs):
        events.append(("loading", capsys.readouterr().err))
        real(self, *args, **kwargs)

    monkeypatch.setattr(score_model.ScoreModel, "__init__", load)
    monkeypatch.setattr(uvicorn, "run", lambda app, **k: events.append(("listen", capsys.readouterr().err)))
    main(["--reward-model", score_models[0], "--device", "cpu", "--port", str(free_port())])
    assert [e[0] for e in events] == ["loading", "listen"]
    assert "token" not in events[0][1] and events[1][1].count("esrl serve-scorer: token ") == 1


def test_a_port_in_use_is_one_line_before_the_models_load(monkeypatch, capsys):
    import uvicorn

    from esrl.cli import main
    from esrl.scoring import service

    monkeypatch.setattr(service, "scorer_from_args", lambda args: pytest.fail("loaded the models first"))
    monkeypatch.setattr(uvicorn, "run", lambda *a, **k: pytest.fail("it tried to listen"))
    with socket.socket() as taken:  # another server on the port
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(SystemExit) as exit_:
            main(["serve-scorer", "--judge", "smollm2-135m-instruct", "--no-token", "--port", str(port)])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"esrl serve-scorer: error: --port {port}: cannot listen on 127.0.0.1:{port}: already in use "
        "(another server? pick another --port)"]


def test_a_token_file_that_cannot_be_written_is_one_line_before_the_models_load(tmp_path, monkeypatch, capsys):
    """--token-file under a file: the mkdir failed with a traceback once the reward and cost models had loaded
    (minutes for 7B models). Checked with the other token options, before any model loads."""
    from esrl import cli

    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.delenv(ENV_FILE, raising=False)
    blocker = tmp_path / "afile"
    blocker.write_text("")
    monkeypatch.setattr(cli, "load_score_model", lambda *a, **k: pytest.fail("a model loaded first"), raising=False)
    with pytest.raises(SystemExit) as exit_:
        cli.main(["serve-scorer", "--reward-model", str(tmp_path / "no-model"), "--port", str(free_port()),
                  "--token-file", str(blocker / "tok")])
    assert exit_.value.code == 2
    (line,) = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    assert line == f"esrl serve-scorer: error: --token-file {blocker / 'tok'}: cannot write it ({blocker} is a file)"
