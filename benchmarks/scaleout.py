"""Trellis on Ray Serve: output tokens/s by replica count, and cache-aware vs round-robin routing.

Deploys the app (``server.scaleout``) once per row on a local Ray instance (or ``--ray-address``),
then sends a workload of shared prefixes and schemas: ``--groups`` groups, each a long system
prompt and its own JSON schema, ``--per-group`` requests each, shuffled, ``--concurrency`` in flight.
Every row uses fresh schemas and prefixes (nothing cached from an earlier row). Prints one table:
output tok/s, its ratio to the first row, and constraint compiles (cache misses summed over replicas).

    python benchmarks/scaleout.py --model /path/to/tiny-llama --replicas 1 2 4          # this machine
    python benchmarks/scaleout.py --ray-address auto --model /models/llama --gpus-per-replica 1 \\
        --replicas 1 2 4 8 --concurrency 64 --max-tokens 128                             # a GPU cluster
    python benchmarks/scaleout.py --model /path/to/tiny-llama --smoke   # 1 replica, 2 requests: checks it runs
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402

from benchmarks.smoke import parse_with_smoke  # noqa: E402
from server.config import Settings  # noqa: E402


def workload(row: int, groups: int, per_group: int, seed: int) -> list[dict]:
    """Chat requests sharing a long prefix and a schema per group; ``row`` makes them new per row."""
    requests = []
    for group in range(groups):
        system = f"[row {row} group {group}] You extract records from shipping manifests. " * 20
        field = f"item_{row}_{group}"
        schema = {"type": "object", "properties": {field: {"type": "string", "maxLength": 24},
                                                   "count": {"type": "integer"}},
                  "required": [field, "count"], "additionalProperties": False}
        for i in range(per_group):
            requests.append({
                "messages": [{"role": "system", "content": system},
                             {"role": "user", "content": f"Manifest line {i}: {random.random():.6f}"}],
                "response_format": {"type": "json_schema", "json_schema": {"name": field, "schema": schema}},
            })
    random.Random(seed).shuffle(requests)
    return requests


async def run_workload(base_url: str, model: str, requests: list[dict], concurrency: int, max_tokens: int) -> tuple[int, float]:
    """(completion tokens, seconds) for the whole workload."""
    queue = list(requests)
    tokens = 0

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal tokens
        while queue:
            body = {**queue.pop(), "model": model, "max_tokens": max_tokens, "temperature": 0.7}
            response = await client.post("/v1/chat/completions", json=body)
            response.raise_for_status()
            tokens += response.json()["usage"]["completion_tokens"]

    async with httpx.AsyncClient(base_url=base_url, timeout=600) as client:
        started = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        return tokens, time.perf_counter() - started


def compiles(base_url: str) -> int:
    """Compiled-constraint cache misses summed over every replica (from the entry's /metrics)."""
    total = 0.0
    for line in httpx.get(base_url + "/metrics", timeout=60).text.splitlines():
        if line.startswith("trellis_constraint_cache_misses{"):
            total += float(line.rsplit(" ", 1)[1])
    return int(total)


def wait_running(replicas: int, timeout: float = 600) -> None:
    """Until the app runs with ``replicas`` running engine replicas (RuntimeError after ``timeout`` s)."""
    from ray import serve

    from server.scaleout.launch import APP_NAME, REPLICA_DEPLOYMENT

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        app = serve.status().applications.get(APP_NAME)
        if app and app.status == "RUNNING" and app.deployments[REPLICA_DEPLOYMENT].replica_states.get("RUNNING", 0) == replicas:
            return
        time.sleep(0.5)
    raise RuntimeError(f"{replicas} replicas did not come up")


# --smoke: sizes for a run of seconds that checks the script works end to end (tests run it)
SMOKE = {"replicas": [1], "routings": ["cache"], "groups": 1, "per_group": 2, "concurrency": 2,
         "max_tokens": 4}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line; ``--smoke`` takes one replica, one routing and 2 requests of 4 tokens."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a local Hugging Face model directory (or 'default')")
    parser.add_argument("--replicas", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--routings", nargs="+", default=["cache", "round-robin"], choices=["cache", "round-robin", "pow2"])
    parser.add_argument("--ray-address", default="", help="join this Ray cluster ('' = start a local one)")
    parser.add_argument("--gpus-per-replica", type=float, default=0.0)
    parser.add_argument("--cpus-per-replica", type=float, default=1.0)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--per-group", type=int, default=6)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--max-batch-size", type=int, default=8)
    parser.add_argument("--port", type=int, default=8765)
    args = parse_with_smoke(parser, argv, SMOKE, "1 replica, 1 routing, 2 requests of 4 tokens: checks it runs")
    return args


def measure_row(args: argparse.Namespace, index: int, replicas: int, routing: str) -> dict:
    """Deploy ``replicas`` replicas with ``routing`` and run a fresh workload through them."""
    from server.scaleout.launch import deploy

    settings = Settings(
        model=args.model, served_model_name="bench", max_batch_size=args.max_batch_size,
        compile_workers=1, log_requests=False, port=args.port, ray=True, replicas=replicas,
        ray_routing=routing, ray_address=args.ray_address, gpus_per_replica=args.gpus_per_replica,
        cpus_per_replica=args.cpus_per_replica, drain_timeout=5,
    )
    base_url = deploy(settings)
    wait_running(replicas)
    before = compiles(base_url)
    requests = workload(index, args.groups, args.per_group, seed=index)
    tokens, seconds = asyncio.run(run_workload(base_url, "bench", requests, args.concurrency, args.max_tokens))
    print(f"  {replicas} replica(s), {routing}: {tokens / seconds:.1f} tok/s", file=sys.stderr, flush=True)
    return {"replicas": replicas, "routing": routing, "requests": len(requests), "tokens": tokens,
            "tok_s": tokens / seconds, "compiles": compiles(base_url) - before}


def main(argv: list[str] | None = None) -> list[dict]:
    """Measure every (replicas, routing) row; returns the rows as printed."""
    args = parse_args(argv)
    from server.scaleout.launch import shutdown, start_ray

    start_ray(Settings(ray_address=args.ray_address, replicas=max(args.replicas), cpus_per_replica=args.cpus_per_replica))
    rows = [(n, routing) for n in args.replicas for routing in args.routings if n > 1 or routing == args.routings[0]]
    try:
        results = [measure_row(args, index, replicas, routing) for index, (replicas, routing) in enumerate(rows)]
    finally:
        shutdown()

    base = results[0]["tok_s"]
    print(f"\n{'replicas':>8}  {'routing':<12} {'requests':>8} {'output tok/s':>12} {'vs first':>8} {'compiles':>8}")
    for r in results:
        r["vs_first"] = r["tok_s"] / base
        print(f"{r['replicas']:>8}  {r['routing']:<12} {r['requests']:>8} {r['tok_s']:>12.1f} "
              f"{r['vs_first']:>7.2f}x {r['compiles']:>8}")
    return results


if __name__ == "__main__":
    main()
