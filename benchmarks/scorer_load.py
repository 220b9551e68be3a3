"""Load test of `esrl serve-scorer`: N concurrent clients against a real server on 127.0.0.1, bounded in count
and time, loopback only.

The server is the real CLI in its own process (`esrl serve-scorer --reward-model R --cost-model C`, tiny random
score models in Safe-RLHF's layout, a token file), so its memory is measured alone (VmRSS from /proc). Each of
the N clients is a thread with its own httpx.Client sending `--requests` POST /score_batch of `--items` items;
every `--oversize-every`-th request of each client is a chunked body over the size limit, which must get 413
without being read whole. Reported: answers by status, errors (anything but 200 / the expected 413),
requests per second, latency p50/p95, and the server's RSS after each round (growth after the warm-up round).
Prints one JSON line.

    .venv/bin/python benchmarks/scorer_load.py                          # 3 rounds x 16 clients x 20 requests x 8 items
    .venv/bin/python benchmarks/scorer_load.py --clients 64 --requests 10
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--requests", type=int, default=20, help="requests per client and round")
    p.add_argument("--rounds", type=int, default=3, help="rounds of N concurrent clients (the first warms up)")
    p.add_argument("--items", type=int, default=8, help="prompt/response pairs per request")
    p.add_argument("--oversize-every", type=int, default=5, help="every k-th request: a chunked body over the limit")
    p.add_argument("--max-chars", type=int, default=20_000, help="the server's --max-chars")
    p.add_argument("--time-limit", type=float, default=300.0, help="seconds at most for the whole load")
    args = p.parse_args()

    import httpx

    from esrl.models import load_tokenizer
    from esrl.models.tiny import tiny_score_model

    tmp = Path(tempfile.mkdtemp(prefix="esrl-scorer-load-"))
    tok = load_tokenizer("smollm2-135m-instruct")
    reward = tiny_score_model(tmp / "reward", seed=1, score_type="reward", tokenizer=tok)
    cost = tiny_score_model(tmp / "cost", seed=2, score_type="cost", tokenizer=tok)
    token_file = tmp / "token"
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "esrl", "serve-scorer", "--reward-model", reward,
                               "--cost-model", cost, "--port", str(port), "--token-file", str(token_file),
                               "--device", "cpu", "--max-chars", str(args.max_chars), "--log-level", "warning"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if token_file.exists():
                try:
                    token = token_file.read_text().strip()
                    if httpx.get(f"{url}/health", headers={"Authorization": f"Bearer {token}"},
                                 timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
            if server.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"server did not start: {server.stderr.read()[-2000:]}")
            time.sleep(0.2)
        headers = {"Authorization": f"Bearer {token}"}
        body = {"prompts": [f"Question {i}: how do I bake bread?" for i in range(args.items)],
                "responses": [f"Answer {i}: flour, water, salt, yeast, an oven and some patience." * 2
                              for i in range(args.items)]}

        def oversize():
            for _ in range(64):  # 64 x 64 KiB: far over a limit of ~12 bytes per allowed character
                yield b"x" * 65536

        statuses: dict[str, int] = {}
        errors: list[str] = []
        latencies: list[float] = []
        lock = threading.Lock()
        stop_at = time.monotonic() + args.time_limit

        def client(n_requests: int) -> None:
            with httpx.Client(headers=headers, timeout=60) as c:
                for k in range(n_requests):
                    if time.monotonic() > stop_at:
                        return
                    big = args.oversize_every and (k + 1) % args.oversize_every == 0
                    start = time.perf_counter()
                    try:
                        if big:
                            r = c.post(f"{url}/score_batch", content=oversize())
                        else:
                            r = c.post(f"{url}/score_batch", json=body)
                        status = str(r.status_code)
                        ok = r.status_code == (413 if big else 200)
                        if ok and not big:
                            ok = len(r.json()["rewards"]) == args.items
                    except httpx.HTTPError as e:  # the server may close a connection after its 413
                        status, ok = f"{type(e).__name__}", big
                    with lock:
                        statuses[status] = statuses.get(status, 0) + 1
                        if not big:
                            latencies.append(time.perf_counter() - start)
                        if not ok:
                            errors.append(f"{'oversize' if big else 'score'}: {status}")

        def round_() -> float:
            threads = [threading.Thread(target=client, args=(args.requests,)) for _ in range(args.clients)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            return rss_mb(server.pid)

        rss = [rss_mb(server.pid)]
        start = time.perf_counter()
        for _ in range(args.rounds):  # round 1 warms up (the concurrent forward passes' allocations)
            rss.append(round_())
        wall = time.perf_counter() - start
        alive = httpx.get(f"{url}/health", headers=headers, timeout=5).status_code == 200
        sent = sum(statuses.values())
        latencies.sort()
        print(json.dumps({
            "clients": args.clients, "requests_per_client": args.requests, "items": args.items,
            "answers": statuses, "errors": len(errors), "error_examples": errors[:3], "server_alive": alive,
            "wall_s": round(wall, 2), "requests_per_s": round(sent / wall, 1),
            "latency_p50_s": round(statistics.median(latencies), 3),
            "latency_p95_s": round(latencies[int(0.95 * (len(latencies) - 1))], 3),
            "server_rss_mb_start_then_after_each_round": [round(x, 1) for x in rss],
            "rss_growth_after_warmup_round_mb": round(rss[-1] - rss[1], 1),
            "machine": f"nproc {os.cpu_count()}, {platform.processor() or platform.machine()}, "
                       f"python {platform.python_version()}"}))
    finally:
        server.terminate()
        server.wait(timeout=30)


if __name__ == "__main__":
    main()
