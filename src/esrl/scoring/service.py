"""`esrl serve-scorer`: a Scorer behind HTTP (FastAPI + uvicorn), so one copy of large reward/cost models serves
every training process.

    GET  /health       -> {"status": "ok", "scorer": ..., "max_items": ..., "max_chars": ...}
    POST /score_batch  {"prompts": [...], "responses": [...]} -> {"rewards": [...], "costs": [...]}

Answers to bad requests: 401 missing or wrong bearer token; 413 too many items or characters (the sum of the
lengths of all prompts and responses) or a body too large (checked while the body streams in, chunked or not);
422 not JSON, wrong types, or lists of unequal length. Each carries a JSON `detail` naming the problem. It binds
127.0.0.1 unless --host says otherwise, and requires a token unless --no-token (loopback only; esrl.scoring.token).
"""


import argparse
import errno
import json
import math
import secrets
import socket
import threading
from typing import Any

from esrl.errors import ConfigError
from esrl.needs import checked_device
from esrl.scoring.base import Scorer
from esrl.scoring.token import check_token_options, server_token

DEFAULT_MAX_ITEMS = 512
DEFAULT_MAX_CHARS = 2_000_000


def check_limits(max_items: int, max_chars: int) -> None:
    if max_items < 1 or max_chars < 1:
        raise ConfigError(f"serve-scorer: --max-items and --max-chars must be >= 1, got {max_items}, "
                          f"{max_chars}")


def create_app(scorer: Scorer, token: str | None = None, max_items: int = DEFAULT_MAX_ITEMS,
               max_chars: int = DEFAULT_MAX_CHARS):
    """The FastAPI app serving `scorer`; requests are scored one at a time (models are not shared across calls)."""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse
    from starlette.concurrency import run_in_threadpool

    check_limits(max_items, max_chars)
    app = FastAPI(title="esrl scorer", docs_url=None, redoc_url=None, openapi_url=None)
    lock = threading.Lock()
    # JSON escapes (\uXXXX) can make a character take 12 bytes; anything beyond that cannot be within the limit.
    max_body = 12 * max_chars + 64 * max_items + 4096

    def error(status: int, detail: str, **headers: str) -> JSONResponse:
        return JSONResponse({"detail": detail}, status_code=status, headers=headers or None)

    def unauthorized(request: Request) -> JSONResponse | None:
        if token is None:
            return None
        header = request.headers.get("authorization", "")
        scheme, _, given = header.partition(" ")
        if scheme.lower() != "bearer" or not given:
            return error(401, "missing bearer token (Authorization: Bearer <token>)",
                         **{"WWW-Authenticate": "Bearer"})
        if not secrets.compare_digest(given.strip().encode(), token.encode()):
            return error(401, "wrong bearer token", **{"WWW-Authenticate": "Bearer"})
        return None

    @app.get("/health")
    async def health(request: Request):
        if (denied := unauthorized(request)) is not None:
            return denied
        return {"status": "ok", "scorer": scorer.name, "max_items": max_items, "max_chars": max_chars}

    @app.post("/score_batch")
    async def score_batch(request: Request):
        if (denied := unauthorized(request)) is not None:
            return denied
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > max_body:
            return error(413, f"request body of {length} bytes is over the limit of {max_body} bytes")
        # Read in chunks and stop at the limit: a chunked body (no Content-Length) is never held whole.
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > max_body:
                return error(413, f"request body over the limit of {max_body} bytes (stopped reading at "
                                  f"{len(body)})", Connection="close")
        try:
            data = json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            return error(422, f"the body is not JSON ({e})")
        except RecursionError:  # [[[[...]]]] within max_body: a bad request, not a server error to retry
            return error(422, "the body is JSON nested too deeply")
        if not isinstance(data, dict):
            return error(422, "the body must be a JSON object {\"prompts\": [...], \"responses\": [...]}")
        for key in ("prompts", "responses"):
            value = data.get(key)
            if not isinstance(value, list) or not all(isinstance(x, str) for x in value):
                return error(422, f"'{key}' must be a list of strings")
        prompts, responses = data["prompts"], data["responses"]
        if len(prompts) != len(responses):
            return error(422, f"'prompts' has {len(prompts)} items but 'responses' has {len(responses)}")
        if len(prompts) > max_items:
            return error(413, f"{len(prompts)} items is over the limit of {max_items} per request")
        chars = sum(map(len, prompts)) + sum(map(len, responses))
        if chars > max_chars:
            return error(413, f"{chars} characters (prompts and responses) is over the limit of {max_chars} "
                              "per request")

        def run() -> tuple[list[float], list[float]]:
            with lock:
                return scorer.score(prompts, responses)

        try:
            rewards, costs = await run_in_threadpool(run)
        except Exception as e:  # noqa: BLE001 - answer the client, keep serving
            return error(500, f"scorer failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        if not all(math.isfinite(v) for v in (*rewards, *costs)):
            return error(500, "scorer produced a non-finite score")
        return {"rewards": rewards, "costs": costs}

    return app


def check_port(host: str, port: int) -> None:
    """Bind host:port once (SO_REUSEADDR, as uvicorn does) and let go, before the models load: a port in use
    is then one line now, not uvicorn's error (and exit 3) after minutes of loading."""
    try:
        for family, kind, proto, _, address in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                                  flags=socket.AI_PASSIVE):
            with socket.socket(family, kind, proto) as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind(address)
    except socket.gaierror as e:
        raise ConfigError(f"--host {host}: cannot resolve it ({e.strerror})") from None
    except OSError as e:
        if e.errno == errno.EADDRNOTAVAIL:
            raise ConfigError(f"--host {host}: not an address of this machine") from None
        in_use = e.errno == errno.EADDRINUSE
        why = "already in use (another server? pick another --port)" if in_use else e.strerror
        raise ConfigError(f"--port {port}: cannot listen on {host}:{port}: {why}") from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="esrl serve-scorer",
        description="Serve reward/cost models (or an LLM judge) over HTTP: GET /health, POST /score_batch.")
    p.add_argument("--reward-model", help="reward model: folder or hub id (Safe-RLHF score model or a one-label "
                                          "sequence classifier)")
    p.add_argument("--cost-model", help="cost model: folder or hub id (same layouts)")
    p.add_argument("--judge", help="an LLM judge instead of score models: causal LM folder, hub id or "
                                   "'smollm2-135m-instruct' (the embedded model)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--token", default=None, help="require 'Authorization: Bearer TOKEN' (default: from --token-file, "
                                                 "else ESRL_SCORER_TOKEN, else a new one, printed once)")
    p.add_argument("--token-file", default=None, help="read the token from this file, or write a new one there if "
                                                      "it does not exist (default: ESRL_SCORER_TOKEN_FILE)")
    p.add_argument("--no-token", action="store_true", help="serve without a token (loopback --host only)")
    p.add_argument("--max-items", type=int, default=DEFAULT_MAX_ITEMS, help="items per request at most")
    p.add_argument("--max-chars", type=int, default=DEFAULT_MAX_CHARS,
                   help="characters per request at most (all prompts and responses together)")
    p.add_argument("--max-length", type=int, default=512, help="tokens per scored text at most")
    p.add_argument("--batch-size", type=int, default=8, help="texts per forward pass")
    p.add_argument("--keep-eos", action="store_true",
                   help="cut a text longer than --max-length at max-length - 1 tokens and end it with the EOS "
                        "(default: append the EOS, then cut, so a long text loses it, as the ES fork's service)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    p.add_argument("--dtype", default="float32", help="float32, bfloat16 or float16")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    return p


def scorer_from_args(args: argparse.Namespace) -> Scorer:
    from esrl.scoring.judge_scorer import JudgeScorer
    from esrl.scoring.score_model import ScoreModelScorer

    if args.judge and (args.reward_model or args.cost_model):
        raise ConfigError("serve-scorer: give either --judge or --reward-model/--cost-model, not both")
    if args.judge:
        return JudgeScorer(args.judge, device=args.device, dtype=args.dtype, batch_size=args.batch_size)
    if not args.reward_model:
        raise ConfigError("serve-scorer: give --reward-model (and --cost-model), or --judge")
    return ScoreModelScorer(args.reward_model, args.cost_model, device=args.device, dtype=args.dtype,
                            max_length=args.max_length, batch_size=args.batch_size, keep_eos=args.keep_eos)


def main(argv: list[str] | None = None) -> None:
    """`esrl serve-scorer ...`: load the models, then serve until interrupted."""
    import uvicorn

    args = build_parser().parse_args(argv)
    if not 0 < args.port < 65536:
        raise ConfigError(f"serve-scorer: --port must be in 1..65535, got {args.port}")
    check_limits(args.max_items, args.max_chars)
    checked_device(args.device, "--device")  # a GPU this machine lacks: now, not at every request
    check_token_options(args.token, args.token_file, args.no_token, args.host)  # esrl.scoring.token
    check_port(args.host, args.port)
    scorer = scorer_from_args(args)
    # The token (a new one is printed) once the models have loaded: an error above is then the only line.
    token = server_token(args.token, args.token_file, args.no_token, args.host)
    app = create_app(scorer, token=token, max_items=args.max_items, max_chars=args.max_chars)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)


def serve_in_thread(app: Any, host: str = "127.0.0.1", port: int = 0, timeout: float = 30.0):
    """Start uvicorn on a background thread and wait until it listens; returns (server, thread, port).

    Stop it with `server.should_exit = True; thread.join()`. Port 0 picks a free port.
    """
    import time

    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, name="esrl-scorer", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            raise RuntimeError(f"scorer service on {host}:{port} did not start within {timeout} s")
        time.sleep(0.02)
    bound = server.servers[0].sockets[0].getsockname()[1]
    return server, thread, bound


if __name__ == "__main__":
    main()
