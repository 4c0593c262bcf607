"""Memory stays flat: a real ``trellis serve`` under a loop of hostile and varied requests.

    python benchmarks/memory.py                       # default model, 1,000 requests, a minute idle
    python benchmarks/memory.py --requests 300 --idle 30 --server-arg=--compile-timeout=2
    python benchmarks/memory.py --env MALLOC_ARENA_MAX=2  # the server under another allocator setting
    python benchmarks/memory.py --per-kind --requests 100   # 100 of each kind in turn, a reading after each
    python benchmarks/memory.py --smoke --base-url http://127.0.0.1:8000 --pid PID  # a running server, briefly

Starts ``trellis serve`` (``--server-arg`` passes it flags) as a child process on a free loopback
port (or measures the one at ``--base-url``), warms it up with the same
request mix (pages the KV cache, allocator pools and compile paths touch once are not a leak),
lets it idle ``--settle`` seconds, reads the server process's resident memory
(``/proc/<pid>/status``), then sends ``--requests``
requests, ``--concurrency`` at a time, cycling through the kinds in :data:`KINDS`: malformed
bodies, pathological constraints, a new json_schema / regex / grammar / tool set / chat template
on every request (each compiles anew), long prompts, ``n > 1`` with logprobs and stop strings,
completions over token ids and streams the client drops. It waits for the engine to go idle,
reads RSS again, idles ``--idle`` seconds, reads it a last time and prints the three readings
(plus the compile and template workers', which are separate processes) with the ratio to the
warmed-up one. The target: after idle <= 1.10 x after warm-up. A 429 is sent again after its
``Retry-After`` (at most 5 s, 3 tries), so the mix runs as written.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import socket
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx

try:  # the smoke-size helper, also when run as a script
    from benchmarks.smoke import parse_with_smoke
except ImportError:  # pragma: no cover - run as ``python benchmarks/memory.py``
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks.smoke import parse_with_smoke

REPO = Path(__file__).resolve().parents[1]
MiB = 1024 * 1024
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
TARGET = 1.10


@dataclass
class Call:
    """One request of the loop: a JSON body (or raw bytes), and for a stream how many lines to
    read before hanging up (None: read it all)."""

    path: str
    body: dict | bytes
    stream_lines: int | None = None


# --------------------------------------------------------------------------- the request kinds
# Payloads mirror tests/server/test_hostile.py; the ``i`` argument makes a kind's payload new on
# every request where newness matters (a constraint, a template or a tool set compiled anew).

EBNF_LOOP = 'root ::= "a" root'
LARK_LOOP = 'start: "a" start'
REF_CYCLE = {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}
DANGLING_REF = {"type": "object", "properties": {"x": {"$ref": "#/$defs/nope"}}, "required": ["x"]}
REMOTE_REF = {"type": "object", "properties": {"x": {"$ref": "https://example.com/x.json"}}, "required": ["x"]}
BAD_EBNF = 'root ::= "a" | | (( "b"'
HUGE_ENUM = {"enum": [f"value-{i}" for i in range(100_000)]}
LONG_TEXT = " ".join(f"word{i % 97}" for i in range(400))


def _deep_schema(depth: int) -> str:
    level = '{"type": "object", "required": ["a"], "properties": {"a": '
    return level * depth + '{"type": "string"}' + "}}" * depth


def _chat(model: str, max_tokens: int = 8, content: str = "Hello there", **fields) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, **fields}


def _rf(schema) -> dict:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": schema}}}


def malformed(model: str, i: int) -> Call:
    """Bodies the parser refuses: bad UTF-8, deep nesting, wrong types, huge numbers."""
    raw = [
        b'{"model": "m", "messages": [{"role": "user", "content": "\xff\xfe bad"}]}',
        b"[" * 100_000 + b"]" * 100_000,
        b'{"a":' * 50_000 + b"1" + b"}" * 50_000,
        b"{",
        b"",
    ]
    fields = [
        {"max_tokens": 10**30}, {"n": 10**20}, {"seed": 2**70}, {"logit_bias": {"-1": 1}},
        {"logprobs": True, "top_logprobs": 10**9}, {"stop": [f"s{k}" for k in range(33)]},
        {"logit_bias": {str(k): 1.0 for k in range(1025)}}, {"response_format": {"type": "nope"}},
        {"tool_choice": {"type": "function", "function": {"name": "nope"}}},
        {"chat_template_kwargs": {"messages": 1}},
    ]
    pick = i // len(KINDS)
    if pick % 2 == 0:
        return Call(CHAT, raw[(pick // 2) % len(raw)])
    return Call(CHAT, _chat(model, **fields[(pick // 2) % len(fields)]))


def pathological(model: str, i: int) -> Call:
    """Constraints that must be refused: grammars without a base case, $ref trouble, huge
    schemas; every fourth one new text (a compile that is not cached)."""
    choices = [
        {"guided_grammar": EBNF_LOOP}, {"guided_grammar": LARK_LOOP}, {"guided_json": REF_CYCLE},
        _rf(DANGLING_REF), {"structured_outputs": {"json": REMOTE_REF}}, {"guided_json": _deep_schema(2000)},
        {"guided_grammar": BAD_EBNF}, {"guided_regex": "a^b"}, {"guided_choice": []}, _rf(HUGE_ENUM),
        {"guided_regex": "("},
    ]
    pick = i // len(KINDS)
    if pick % 4 == 3:
        return Call(CHAT, _chat(model, guided_grammar=f'root ::= "{uuid.uuid4().hex}" root'))
    return Call(CHAT, _chat(model, max_tokens=16, **choices[pick % len(choices)]))


def new_schema(model: str, i: int) -> Call:
    """A json_schema never seen before (compiled anew, then cached)."""
    schema = {"type": "object", "properties": {f"f{i}": {"type": "integer"}, f"g{i}": {"enum": ["x", "y", str(i)]},
                                               "name": {"type": "string", "maxLength": 8}},
              "required": [f"f{i}", "name"], "additionalProperties": False}
    return Call(CHAT, _chat(model, max_tokens=12, **_rf(schema)))


def new_regex(model: str, i: int) -> Call:
    return Call(CHAT, _chat(model, max_tokens=8, guided_regex=f"z{i}-[a-c]{{2,5}}(x|y{i % 7})?"))


def new_grammar(model: str, i: int) -> Call:
    grammar = f'root ::= "v{i}" ("a" | "b" | "{i % 13}")+ ";"'
    return Call(COMPLETIONS, {"model": model, "prompt": "Say", "max_tokens": 8, "guided_grammar": grammar})


def new_tools(model: str, i: int) -> Call:
    """A tool set never seen before, its call forced (a tool grammar built and compiled anew)."""
    tool = {"type": "function", "function": {"name": f"lookup_{i}", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}, f"n{i}": {"type": "integer"}},
        "required": ["city"]}}}
    return Call(CHAT, _chat(model, max_tokens=16, tools=[tool], tool_choice="required"))


def new_template(model: str, i: int) -> Call:
    """A client chat template never seen before (rendered in the sandbox worker); every third a
    runaway one, refused."""
    if (i // len(KINDS)) % 3 == 2:
        return Call(CHAT, _chat(model, chat_template="{{ 'x' * 10**8 }}"))
    template = "{% for m in messages %}<" + str(i) + ">{{ m['content'] }}\n{% endfor %}assistant:"
    return Call(CHAT, _chat(model, max_tokens=4, chat_template=template))


def long_prompt(model: str, i: int) -> Call:
    """A long prompt with a new head (no prefix-cache hit), or one far over the context (400)."""
    if (i // len(KINDS)) % 4 == 3:
        return Call(CHAT, _chat(model, content="word " * 200_000))
    return Call(CHAT, _chat(model, max_tokens=4, content=f"{uuid.uuid4().hex} {LONG_TEXT}"))


def sampled(model: str, i: int) -> Call:
    """``n > 1`` with logprobs, top_logprobs and stop strings."""
    return Call(CHAT, _chat(model, max_tokens=16, n=3, temperature=0.9, seed=i, logprobs=True, top_logprobs=5,
                            stop=[f"zz{i}", "\n\n"]))


def completion_ids(model: str, i: int) -> Call:
    return Call(COMPLETIONS, {"model": model, "prompt": [[1, 2 + i % 500, 3, 4]], "max_tokens": 8,
                              "logprobs": 3, "echo": True})


def dropped_stream(model: str, i: int) -> Call:
    """A stream the client hangs up on after two lines, constrained every other time."""
    extra = new_schema(model, i).body if i % 2 else _chat(model)
    body = {**extra, "max_tokens": 64, "ignore_eos": True, "stream": True}  # type: ignore[dict-item]
    return Call(CHAT, body, stream_lines=2)


def too_large(model: str, i: int) -> Call:
    """A body over the default 8 MiB limit (413), every fifth time round; else a small chat."""
    if (i // len(KINDS)) % 5 == 4:
        return Call(CHAT, _chat(model, content="x" * (9 * MiB)))
    return Call(CHAT, _chat(model, max_tokens=4))


KINDS: list[Callable[[str, int], Call]] = [
    malformed, pathological, new_schema, new_regex, new_grammar, new_tools, new_template, long_prompt,
    sampled, completion_ids, dropped_stream, too_large,
]


KIND_NAMES = [k.__name__ for k in KINDS]


def call_for(model: str, i: int) -> Call:
    """The ``i``-th request of the loop (kinds in turn)."""
    return KINDS[i % len(KINDS)](model, i)


# --------------------------------------------------------------------------- sending


@dataclass
class Tally:
    statuses: Counter = field(default_factory=Counter)
    by_kind: Counter = field(default_factory=Counter)  # (kind, status) -> requests
    failures: list[str] = field(default_factory=list)

    def add(self, other: Tally) -> None:
        self.statuses.update(other.statuses)
        self.by_kind.update(other.by_kind)
        self.failures.extend(other.failures)

    def server_errors(self) -> int:
        return sum(n for status, n in self.statuses.items() if isinstance(status, int) and status >= 500)


RETRIES_429 = 3
RETRY_CAP_S = 5.0


def send(client: httpx.Client, call: Call) -> int | str:
    """Send one call (again after a 429's Retry-After, capped, up to :data:`RETRIES_429` times);
    its last status, or the transport error's name."""
    for _ in range(RETRIES_429):
        status, retry_after = _send_once(client, call)
        if status != 429:
            break
        time.sleep(min(RETRY_CAP_S, retry_after))
    return status


def _send_once(client: httpx.Client, call: Call) -> tuple[int | str, float]:
    headers = {"content-type": "application/json"}
    content = call.body if isinstance(call.body, bytes) else json.dumps(call.body).encode()
    try:
        if call.stream_lines is None:
            response = client.post(call.path, content=content, headers=headers)
        else:
            with client.stream("POST", call.path, content=content, headers=headers) as response:
                for n, _ in enumerate(response.iter_lines()):
                    if n + 1 >= call.stream_lines:
                        break
    except httpx.HTTPError as exc:
        return type(exc).__name__, 0.0
    try:
        retry_after = float(response.headers.get("retry-after", "1"))
    except ValueError:
        retry_after = 1.0
    return response.status_code, retry_after


def run_loop(base_url: str, model: str, indices: list[int], concurrency: int, timeout: float) -> Tally:
    """Send the loop's requests ``indices``, ``concurrency`` at a time."""
    tally = Tally()
    with httpx.Client(base_url=base_url, timeout=timeout) as client, \
            concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        futures = {pool.submit(send, client, call_for(model, i)): i for i in indices}
        for future in concurrent.futures.as_completed(futures):
            status, kind = future.result(), KINDS[futures[future] % len(KINDS)].__name__
            tally.statuses[status] += 1
            tally.by_kind[kind, status] += 1
            if not isinstance(status, int) or status >= 500:
                tally.failures.append(f"{kind}: {status}")
    return tally


def loop_indices(start: int, count: int, kinds: list[str]) -> list[int]:
    """``count`` request numbers from ``start`` on, of the named kinds only (all when empty)."""
    wanted = {KIND_NAMES.index(k) for k in kinds} if kinds else set(range(len(KINDS)))
    indices: list[int] = []
    i = start
    while len(indices) < count:
        if i % len(KINDS) in wanted:
            indices.append(i)
        i += 1
    return indices


def wait_idle(base_url: str, timeout: float = 120.0) -> None:
    """Until the engine has nothing running or waiting."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            health = httpx.get(base_url + "/health", timeout=10).json()
            if health.get("running") == 0 and health.get("waiting") == 0:
                return
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.2)


# --------------------------------------------------------------------------- the server and its memory


def rss_bytes(pid: int) -> int:
    """Resident memory of one process (``VmRSS``), 0 when it is gone."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def children_rss(pid: int) -> int:
    """Resident memory of every descendant process (compile and template workers)."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        parents[int(stat.parent.name)] = int(fields[1])
    family, grew = {pid}, True
    while grew:
        found = {child for child, parent in parents.items() if parent in family} - family
        family |= found
        grew = bool(found)
    return sum(rss_bytes(child) for child in family - {pid})


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def server_command(args: argparse.Namespace, port: int) -> tuple[list[str], dict[str, str]]:
    """The ``trellis serve`` command line and environment for ``args``."""
    command = [sys.executable, "-m", "server.cli", "serve", args.model, "--port", str(port),
               "--log-requests", "off", "--log-level", "warning", *args.server_arg]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", **dict(kv.split("=", 1) for kv in args.env)}
    return command, env


def start_server(args: argparse.Namespace, port: int) -> subprocess.Popen:
    """``trellis serve`` as a child process (niced like this run), its output to ``--server-log``."""
    command, env = server_command(args, port)
    with open(args.server_log, "wb") as log:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)


def wait_ready(base_url: str, server: subprocess.Popen, timeout: float) -> None:
    """Until the server answers /ready; raises if it exits or takes too long."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited with status {server.returncode} (see its log)")
        try:
            ready = httpx.get(base_url + "/ready", timeout=5)
            if ready.status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the server was not ready after {timeout:g} s")


def stop_server(server: subprocess.Popen) -> None:
    server.terminate()
    try:
        server.wait(timeout=30)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()


@dataclass
class Reading:
    label: str
    server: int
    workers: int
    requests: int


def read(label: str, pid: int, requests: int) -> Reading:
    return Reading(label, rss_bytes(pid), children_rss(pid), requests)


# --------------------------------------------------------------------------- the run


@contextmanager
def served(args: argparse.Namespace) -> Iterator[tuple[str, int, Callable[[], bool]]]:
    """(base URL, server pid, whether its process still runs): the server at ``--base-url``
    (``--pid``), else a new ``trellis serve``, stopped afterwards."""
    if args.base_url:
        yield args.base_url, args.pid, lambda: rss_bytes(args.pid) > 0
        return
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    server = start_server(args, port)
    try:
        wait_ready(base_url, server, args.start_timeout)
        yield base_url, server.pid, lambda: server.poll() is None
    finally:
        stop_server(server)


def measure(args: argparse.Namespace) -> dict:
    """Warm up, loop, idle; the readings, ratios and request statuses."""
    with served(args) as (base_url, pid, running):
        model = httpx.get(base_url + "/v1/models", timeout=30).json()["data"][0]["id"]
        started = time.monotonic()
        warm = run_loop(base_url, model, loop_indices(0, args.warmup, []), args.concurrency, args.request_timeout)
        wait_idle(base_url)
        time.sleep(args.settle)
        readings = [read("after warm-up", pid, args.warmup)]
        began = time.monotonic()
        tally = Tally()
        for kinds in ([[k] for k in args.kinds or KIND_NAMES] if args.per_kind else [args.kinds]):
            indices = loop_indices(args.warmup, args.requests, kinds)
            tally.add(run_loop(base_url, model, indices, args.concurrency, args.request_timeout))
            wait_idle(base_url)
            label = f"after {kinds[0]}" if args.per_kind else "after the loop"
            readings.append(read(label, pid, readings[-1].requests + args.requests))
        elapsed = time.monotonic() - began
        if args.idle > 0:
            time.sleep(args.idle)
            readings.append(read(f"after {args.idle:g} s idle", pid, readings[-1].requests))
        alive = running() and httpx.get(base_url + "/health", timeout=10).status_code == 200
    return {"readings": readings, "tally": tally, "warmup": warm, "elapsed": elapsed, "alive": alive,
            "warmup_s": began - started,
            "ratio": readings[-1].server / readings[0].server if readings[0].server else float("nan")}


def print_report(args: argparse.Namespace, result: dict) -> None:
    base = result["readings"][0]
    print(f"model={args.base_url or args.model} requests={args.requests} (+{args.warmup} warm-up) concurrency={args.concurrency} "
          f"warm-up {result['warmup_s']:.0f} s, loop {result['elapsed']:.0f} s, server alive after: {'yes' if result['alive'] else 'NO'}")
    statuses = sorted(result["tally"].statuses.items(), key=lambda kv: str(kv[0]))
    print("statuses: " + ", ".join(f"{status}: {n}" for status, n in statuses))
    kinds: dict[str, list[str]] = {}
    for (kind, status), n in sorted(result["tally"].by_kind.items(), key=str):
        kinds.setdefault(kind, []).append(f"{status} x{n}")
    print("by kind: " + "; ".join(f"{kind} {' '.join(seen)}" for kind, seen in kinds.items()))
    for failure in result["tally"].failures[:10]:
        print(f"  failed: {failure}")
    print("| reading | requests | server RSS MiB | vs warm-up | workers RSS MiB |")
    print("|---|---|---|---|---|")
    for r in result["readings"]:
        ratio = r.server / base.server if base.server else float("nan")
        print(f"| {r.label} | {r.requests} | {r.server / MiB:,.0f} | {ratio:.3f}x | {r.workers / MiB:,.0f} |")
    verdict = "yes" if result["ratio"] <= TARGET else "NO"
    print(f"flat (last reading <= {TARGET:.2f} x after warm-up): {verdict} ({result['ratio']:.3f}x)")


SMOKE = {"requests": 12, "warmup": 4, "idle": 0.0, "settle": 0.0, "concurrency": 2}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default", help="what `trellis serve` serves (default: the default model)")
    parser.add_argument("--base-url", default="", help="measure the server already running here instead (with --pid)")
    parser.add_argument("--pid", type=int, default=0, help="with --base-url: the server's process id")
    parser.add_argument("--requests", type=int, default=1000, help="requests in the measured loop")
    parser.add_argument("--warmup", type=int, default=120, help="requests of the same mix before the first reading")
    parser.add_argument("--idle", type=float, default=60.0, help="seconds idle after the loop before the last reading")
    parser.add_argument("--settle", type=float, default=15.0,
                        help="seconds idle after the warm-up before its reading (past --memory-trim-idle: both "
                             "readings idle ones)")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--request-timeout", type=float, default=120.0)
    parser.add_argument("--start-timeout", type=float, default=300.0)
    parser.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                        help="an argument for `trellis serve` (repeatable; --server-arg=--compile-timeout=2)")
    parser.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                        help="an environment variable for the server (repeatable; e.g. MALLOC_ARENA_MAX=2)")
    parser.add_argument("--kinds", nargs="+", default=[], choices=KIND_NAMES, metavar="KIND",
                        help="only these request kinds (default: all, in turn): " + ", ".join(KIND_NAMES))
    parser.add_argument("--per-kind", action="store_true",
                        help="--requests of each kind in turn (of --kinds, or all), a reading after each")
    parser.add_argument("--server-log", default=os.devnull, help="file for the server's output")
    args = parse_with_smoke(parser, argv, SMOKE, help="4 warm-up and 12 measured requests, no idle: checks it runs")
    if args.base_url and not args.pid:
        parser.error("--base-url needs --pid (the server's process, whose memory is read)")
    return args


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark and print its table; returns the measurement."""
    args = parse_args(argv)
    result = measure(args)
    print_report(args, result)
    return result


if __name__ == "__main__":
    main()
