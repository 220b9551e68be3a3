"""The scorer service (FastAPI on 127.0.0.1) and its HTTP client, against a real server; the score models:
test_scoring.py."""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from conftest import free_port
from esrl.errors import ScorerError
from test_scoring import PROMPTS, RESPONSES

TOKEN = "s3cret-token"


@pytest.fixture(scope="module")
def service(scorer):
    from esrl.scoring.service import create_app, serve_in_thread

    server, thread, port = serve_in_thread(create_app(scorer, token=TOKEN, max_items=4, max_chars=400))
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=10)
    assert not thread.is_alive()


def _post(url, body, token=TOKEN, **kwargs):
    import httpx

    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.post(url + "/score_batch", headers=headers, timeout=30, **kwargs, **({"json": body} if body is not
                                                                                      None else {}))


def test_service_health(service):
    import httpx

    answer = httpx.get(service + "/health", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10)
    assert answer.status_code == 200
    assert answer.json()["status"] == "ok" and answer.json()["max_items"] == 4
    assert httpx.get(service + "/health", timeout=10).status_code == 401


def test_service_scores_a_batch(service, scorer):
    answer = _post(service, {"prompts": PROMPTS, "responses": RESPONSES})
    assert answer.status_code == 200, answer.text
    expected = scorer.score(PROMPTS, RESPONSES)
    assert answer.json()["rewards"] == pytest.approx(expected[0], abs=1e-6)
    assert answer.json()["costs"] == pytest.approx(expected[1], abs=1e-6)


@pytest.mark.parametrize("body,token,status,detail", [
    ({"prompts": ["p"] * 5, "responses": ["r"] * 5}, TOKEN, 413, "5 items is over the limit of 4"),
    ({"prompts": ["p" * 300], "responses": ["r" * 101]}, TOKEN, 413, "401 characters"),
    ({"prompts": ["p"], "responses": ["r"]}, "wrong", 401, "wrong bearer token"),
    ({"prompts": ["p"], "responses": ["r"]}, None, 401, "missing bearer token"),
    ({"prompts": ["p", "q"], "responses": ["r"]}, TOKEN, 422, "'prompts' has 2 items but 'responses' has 1"),
    ({"prompts": "p", "responses": ["r"]}, TOKEN, 422, "'prompts' must be a list of strings"),
])
def test_service_rejects_bad_requests(service, body, token, status, detail):
    answer = _post(service, body, token=token)
    assert answer.status_code == status
    assert detail in answer.json()["detail"]


def test_service_rejects_non_json(service):
    answer = _post(service, None, content=b"not json", token=TOKEN)
    assert answer.status_code == 422 and "not JSON" in answer.json()["detail"]
    deep = _post(service, None, content=b"[" * 3000 + b"]" * 3000, token=TOKEN)  # was a 500 the client retried
    assert deep.status_code == 422 and "nested too deeply" in deep.json()["detail"]


# ---------------------------------------------------------------------------------------------------------
# Client


def test_client_against_service(service, scorer):
    from esrl.scoring.client import HTTPScorer

    client = HTTPScorer(service, token=TOKEN, timeout=30, max_items=3, max_chars=400)  # 4 items: 2 requests
    try:
        assert client.health()["status"] == "ok"
        rewards, costs = client.score(PROMPTS, RESPONSES)
        expected = scorer.score(PROMPTS, RESPONSES)
        assert rewards == pytest.approx(expected[0], abs=1e-6) and costs == pytest.approx(expected[1], abs=1e-6)
        assert client.last_costs == costs
    finally:
        client.close()
    wrong = HTTPScorer(service, token="wrong", timeout=30, retries=3, backoff=5)
    start = time.monotonic()
    with pytest.raises(ScorerError, match=r"HTTP 401 wrong bearer token"):
        wrong.score(["p"], ["r"])
    assert time.monotonic() - start < 5  # a 4xx answer is not retried


def test_client_retries_then_fails_cleanly(monkeypatch):
    from esrl.scoring.client import HTTPScorer

    port = free_port()  # nothing listens there
    sleeps = []
    monkeypatch.setattr("esrl.scoring.client.time.sleep", lambda s: sleeps.append(s))
    client = HTTPScorer(f"http://127.0.0.1:{port}", timeout=2, retries=3, backoff=0.01)
    with pytest.raises(ScorerError) as info:
        client.score(["p"], ["r"])
    message = str(info.value)
    assert f"http://127.0.0.1:{port}/score_batch" in message and "unreachable after 4 attempts" in message
    assert "\n" not in message
    assert sleeps == [0.01, 0.02, 0.04]  # exponential backoff


class _Fixed(BaseHTTPRequestHandler):
    status = 200
    body = b"{}"
    hits = 0

    def do_POST(self):  # noqa: N802
        type(self).hits += 1
        self.rfile.read(int(self.headers.get("content-length", 0)))
        self.send_response(self.status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args):
        pass


@pytest.fixture
def fixed_server():
    """A server answering every POST with the handler's fixed status and body."""
    handler = type("Handler", (_Fixed,), {})
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield handler, f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()
    thread.join(timeout=10)


@pytest.mark.parametrize("body,match", [
    (b'{"rewards": [1.0], "costs": [1.0]}', "1 rewards for 2 responses"),
    (b'{"rewards": [1.0, "x"], "costs": [1.0, 2.0]}', r"rewards\[1\] is not a number"),
    (b'{"rewards": [1.0, 2.0], "costs": [NaN, 2.0]}', r"costs\[0\] is not finite"),
    (b'{"rewards": [1.0, 2.0], "costs": [1' + b"0" * 400 + b', 2.0]}', r"costs\[0\] is not finite"),  # no float
    (b'{"rewards": [1.0, 2.0]}', "expected a JSON object with 'rewards' and 'costs'"),
    (b"<html>oops</html>", "the answer is not JSON"),
])
def test_client_rejects_malformed_answers(fixed_server, body, match):
    from esrl.scoring.client import HTTPScorer

    handler, url = fixed_server
    handler.body = body
    with pytest.raises(ScorerError, match=match) as info:
        HTTPScorer(url, timeout=5, retries=0).score(["a", "b"], ["c", "d"])
    assert url in str(info.value)


def test_client_retries_server_errors(fixed_server):
    from esrl.scoring.client import HTTPScorer

    handler, url = fixed_server
    handler.status, handler.body = 503, b'{"detail": "loading models"}'
    with pytest.raises(ScorerError, match=r"failing after 3 attempts \(HTTP 503 loading models\)"):
        HTTPScorer(url, timeout=5, retries=2, backoff=0.01).score(["a"], ["b"])
    assert handler.hits == 3
