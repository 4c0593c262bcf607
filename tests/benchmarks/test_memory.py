"""``benchmarks/memory.py --smoke``: a real server on the tiny model (the session's, in this
process: ``--pid`` is ours) takes a handful of the hostile mix, and the warm-up and after-loop
readings of its resident memory are printed."""

from __future__ import annotations

import os
import sys

from benchmarks import memory


def test_smoke_run_reads_memory_around_the_loop(tiny_server, capsys):
    result = memory.main(["--smoke", "--base-url", tiny_server.base_url, "--pid", str(os.getpid())])

    out = capsys.readouterr().out
    assert result["alive"], out
    assert result["tally"].server_errors() == 0 and not result["tally"].failures, out
    assert sum(result["tally"].statuses.values()) == memory.SMOKE["requests"], out
    assert [r.label for r in result["readings"]] == ["after warm-up", "after the loop"]
    assert all(r.server > 0 for r in result["readings"]) and result["ratio"] > 0
    assert "| after warm-up | 4 |" in out and "flat (last reading" in out


def test_every_kind_builds_a_request():
    calls = [memory.call_for("m", i) for i in range(3 * len(memory.KINDS))]

    assert {c.path for c in calls} == {memory.CHAT, memory.COMPLETIONS}
    assert any(c.stream_lines for c in calls) and any(isinstance(c.body, bytes) for c in calls)
    assert memory.loop_indices(5, 3, ["new_regex"]) == [15, 27, 39]


def test_the_server_it_starts_is_trellis_serve_with_the_flags_given():
    args = memory.parse_args(["--model", "/m", "--server-arg=--compile-timeout=2", "--env", "MALLOC_ARENA_MAX=2"])

    command, env = memory.server_command(args, 1234)
    assert command[:6] == [sys.executable, "-m", "server.cli", "serve", "/m", "--port"]
    assert command[-1] == "--compile-timeout=2" and env["MALLOC_ARENA_MAX"] == "2"
