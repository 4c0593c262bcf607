"""Trellis on Ray Serve: output tokens/s by replica count, and cache-aware vs round-robin routing.

Deploys the app (``server.scaleout``) once per row on a local Ray instance (or ``--ray-address``),
then sends a workload of shared prefixes and schemas: ``--groups`` groups, each a long system
prompt and its own JSON schema, ``--per-group`` requests each, shuffled, ``--concurrency`` in flight.
Every row uses fresh schemas and prefixes (nothing cached from an earlier row). Prints one table:
output tok/s, its ratio to the first row, and constraint compiles (cache misses summed over replicas).

    python benchmarks/scaleout.py --model /path/to/tiny-llama --replicas 1 2 4          # this machine
    python benchmarks/scaleout.py --ray-address auto --model /models/llama --gpus-per-replica 1 \\
        --replicas 1 2 4 8 --concurrency 64 --max-tokens 128                             # a GPU cluster
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
    from ray import serve

    from server.scaleout.launch import APP_NAME, REPLICA_DEPLOYMENT

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        app = serve.status().applications.get(APP_NAME)
        if app and app.status == "RUNNING" and app.deployments[REPLICA_DEPLOYMENT].replica_states.get("RUNNING", 0) == replicas:
            return
        time.sleep(0.5)
    raise RuntimeError(f"{replicas} replicas did not come up")


def main() -> None:
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
    args = parser.parse_args()

    from server.scaleout.launch import deploy, shutdown, start_ray

    start_ray(Settings(ray_address=args.ray_address, replicas=max(args.replicas), cpus_per_replica=args.cpus_per_replica))
    rows = [(n, routing) for n in args.replicas for routing in args.routings if n > 1 or routing == args.routings[0]]
    results = []
    try:
        for index, (replicas, routing) in enumerate(rows):
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
            results.append((replicas, routing, tokens / seconds, compiles(base_url) - before, len(requests)))
            print(f"  {replicas} replica(s), {routing}: {tokens / seconds:.1f} tok/s", file=sys.stderr, flush=True)
    finally:
        shutdown()

    base = results[0][2]
    print(f"\n{'replicas':>8}  {'routing':<12} {'requests':>8} {'output tok/s':>12} {'vs first':>8} {'compiles':>8}")
    for replicas, routing, rate, compiled, count in results:
        print(f"{replicas:>8}  {routing:<12} {count:>8} {rate:>12.1f} {rate / base:>7.2f}x {compiled:>8}")


if __name__ == "__main__":
    main()
