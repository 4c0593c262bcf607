"""Host cost of the engine loop, measured without a GPU: the real engine over a null runner.

The null runner does no model compute: its forward returns precomputed logits (the default
tokenizer's vocabulary) and an emulated device clock says when they would be ready: a forward
launched at time t on a device free at f completes at max(t, f) + D. The host waits only where
the engine waits for the device (the sampled ids' event); everything else the engine does is
host work, as it would be beside a real GPU. Engines that know no device events (before the
overlapped loop) get a forward that blocks for D, which is what a synchronous loop costs.

For each batch size and workload it prints host ms per step (wall minus the time spent waiting
for the device), wall ms per step, wall / max(host, D) (1.0 = the host's work hides entirely
behind the device's), and wall ms per output token. ``--baseline REV`` runs the same benchmark
on the engine of git revision REV (a temporary worktree) in the same run, for a before/after
measured side by side.

    python benchmarks/host.py                              # batch 1 64 256, D = 5 ms
    python benchmarks/host.py --batch 64 --device-ms 5 --baseline 4c32671
    python benchmarks/host.py --smoke                      # batch 1 and 4, D = 1 ms, 4 steps: checks it runs
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import os
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
REPO = Path(__file__).resolve().parents[1]


def _engine_root() -> Path:
    """Where the engine is imported from: ``--engine-root`` (a baseline worktree) or this repo."""
    if "--engine-root" in sys.argv:
        return Path(sys.argv[sys.argv.index("--engine-root") + 1]).resolve()
    return REPO


sys.path.insert(0, str(_engine_root()))

import torch  # noqa: E402

WORKLOADS = (("free", False), ("json_schema", False), ("json_schema", True))
PROMPT_LEN = 24
BANK_ROWS = 64


class EmulatedDevice:
    """A device clock: work queued on it runs back to back, each forward taking ``forward_s``.

    It runs on a virtual clock, real time minus the time spent :meth:`frozen`: tensor work a GPU
    would do but the CPU does here (making the logits, the sampler's masking, softmax and argmax
    over the vocabulary) stops the clock, as if it had cost the host nothing."""

    def __init__(self, forward_s: float) -> None:
        self.forward_s = forward_s
        self.free_at = 0.0  # virtual time at which the device finishes what is queued
        self.waited_s = 0.0  # host time spent waiting for the device
        self.frozen_s = 0.0  # host time spent on the device's work

    def now(self) -> float:
        return time.perf_counter() - self.frozen_s

    @contextmanager
    def frozen(self):
        started = time.perf_counter()
        try:
            yield
        finally:
            self.frozen_s += time.perf_counter() - started

    def launch(self) -> None:
        self.free_at = max(self.now(), self.free_at) + self.forward_s

    def wait_until(self, ready_at: float) -> None:
        delay = ready_at - self.now()
        if delay > 0:
            started = time.perf_counter()
            time.sleep(delay)
            self.waited_s += time.perf_counter() - started


class EmulatedEvent:
    """The engine's device event on the emulated clock (``record`` / ``query`` / ``synchronize``
    / ``elapsed_time``)."""

    def __init__(self, device: EmulatedDevice) -> None:
        self._device = device
        self._ready_at = 0.0

    def record(self, stream=None) -> None:
        self._ready_at = max(self._device.now(), self._device.free_at)  # when the device gets here

    def elapsed_time(self, end: "EmulatedEvent") -> float:
        return 1000 * (end._ready_at - self._ready_at)

    def query(self) -> bool:
        return self._device.now() >= self._ready_at

    def synchronize(self) -> None:
        self._device.wait_until(self._ready_at)


class _NoKV:
    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks


class NullRunner:
    """The model runner's interface with no model: logits from a precomputed bank.

    ``blocking``: the forward itself waits for the emulated device (for engines that record no
    device events). Otherwise the forward only advances the device clock and the engine's event
    (:meth:`new_event`) waits when it is synchronized."""

    def __init__(self, vocab_size: int, num_blocks: int, block_size: int, device_s: float, *, blocking: bool) -> None:
        self.device = torch.device("cpu")
        self.dtype = torch.float32
        self.block_size = block_size
        self.kv = _NoKV(num_blocks)
        self.lora = None
        self.last_hidden = None
        self.clock = EmulatedDevice(device_s)
        self.blocking = blocking
        self.forwards = 0
        generator = torch.Generator().manual_seed(0)
        self._bank = torch.randn(BANK_ROWS, vocab_size, generator=generator) * 4.0
        self._vocab_size = vocab_size

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def new_event(self) -> EmulatedEvent:
        return EmulatedEvent(self.clock)

    def forward(self, batch) -> torch.Tensor:
        with self.clock.frozen():
            rows = batch.last_index.numel()
            logits = self._bank.index_select(0, (torch.arange(rows) * 7 + self.forwards) % BANK_ROWS)
        self.forwards += 1
        self.clock.launch()
        if self.blocking:
            self.clock.wait_until(self.clock.free_at)
        return logits

    def copy_blocks(self, pairs) -> None:
        pass


@dataclass
class Measured:
    batch: int
    workload: str
    jump: bool
    host_ms: float
    wall_ms: float
    ms_per_token: float
    device_ms: float

    @property
    def overlap_ratio(self) -> float:
        return self.wall_ms / max(self.host_ms, self.device_ms)


def _decode_benchmark():
    """This tree's ``benchmarks/decode.py`` (its Workload), over whichever engine is imported
    (the path it puts first on ``sys.path`` is taken back out)."""
    module = sys.modules.get("trellis_decode_benchmark")
    if module is None:
        spec = importlib.util.spec_from_file_location("trellis_decode_benchmark", REPO / "benchmarks" / "decode.py")
        module = sys.modules["trellis_decode_benchmark"] = importlib.util.module_from_spec(spec)
        path = list(sys.path)
        try:
            spec.loader.exec_module(module)
        finally:
            sys.path[:] = path
    return module


def build_engine(runner, tokenizer, batch: int, jump: bool, overlap: bool | None, fill_threads: int):
    from server.engine.engine import Engine

    kwargs = {"max_batch_size": batch, "max_model_len": 512, "jump_forward": jump, "mask_fill_threads": fill_threads}
    if overlap is not None and "overlap" in inspect.signature(Engine.__init__).parameters:
        kwargs["overlap"] = overlap
    engine = Engine(runner, tokenizer, **kwargs)
    sampler = engine.sampler  # its tensor work is the device's (an engine before sample_async: sample)
    name = "sample_async" if hasattr(sampler, "sample_async") else "sample"
    setattr(sampler, name, _on_device(runner.clock, getattr(sampler, name)))
    if hasattr(engine, "_select_rows"):  # a gather of logits rows: one kernel on a GPU
        engine._select_rows = _on_device(runner.clock, engine._select_rows)
    return engine


def _on_device(clock: EmulatedDevice, fn):
    def run(*args, **kwargs):
        with clock.frozen():
            return fn(*args, **kwargs)

    return run


def engine_records_events() -> bool:
    """Whether this engine waits on device events (else the null runner's forward blocks)."""
    from server.engine.engine import Engine

    return "overlap" in inspect.signature(Engine.__init__).parameters


def measure(tokenizer, compiled, *, batch: int, jump: bool, device_s: float, steps: int, warmup: int,
            overlap: bool | None, fill_threads: int = 0) -> Measured:
    vocab = len(tokenizer)
    runner = NullRunner(vocab, num_blocks=batch * 32 + 8, block_size=16, device_s=device_s,
                        blocking=not engine_records_events())
    engine = build_engine(runner, tokenizer, batch, jump, overlap, fill_threads or os.cpu_count() or 1)
    prompt = [(17 * i + 5) % 1000 + 100 for i in range(PROMPT_LEN)]
    workload = _decode_benchmark().Workload(engine, prompt, compiled, max_tokens=200, seed=1000, temperature=0.0,
                                            eos=0)
    for _ in range(batch):
        workload.submit()
    with torch.inference_mode():
        for _ in range(warmup):
            engine.step()
        waited, frozen, tokens = runner.clock.waited_s, runner.clock.frozen_s, workload.output_tokens
        started = time.perf_counter()
        for _ in range(steps):
            engine.step()
        finish = getattr(engine, "flush", None)  # an overlapped engine's last step's tokens
        if finish is not None:
            finish()
        runner.clock.wait_until(runner.clock.free_at)
        wall = time.perf_counter() - started
    workload.stopped = True
    wall -= runner.clock.frozen_s - frozen
    host = wall - (runner.clock.waited_s - waited)
    produced = max(workload.output_tokens - tokens, 1)
    engine.shutdown()
    return Measured(batch, "json_schema" if compiled else "free", jump, 1000 * host / steps, 1000 * wall / steps,
                    1000 * wall / produced, 1000 * device_s)


def run_here(args: argparse.Namespace) -> list[Measured]:
    from constraints import ConstraintCompiler, ConstraintSpec
    from server.model_loader import default_model_dir, load_tokenizer

    torch.set_num_threads(args.threads)
    tokenizer = load_tokenizer(default_model_dir(show_progress=False))
    compiler = ConstraintCompiler(tokenizer, len(tokenizer), stop_token_ids=[0])
    compiled = compiler.compile(ConstraintSpec("json_schema", _decode_benchmark().PEOPLE))
    results = []
    overlap = None if args.overlap == "default" else args.overlap == "on"
    for batch in args.batch:
        for name, jump in WORKLOADS:
            results.append(measure(tokenizer, compiled if name != "free" else None, batch=batch, jump=jump,
                                   device_s=args.device_ms / 1000, steps=args.steps, warmup=args.warmup,
                                   overlap=overlap, fill_threads=args.mask_fill_threads))
    compiler.close()
    return results


def run_baseline(args: argparse.Namespace, revision: str) -> list[Measured]:
    """This benchmark over the engine of ``revision``, in a subprocess importing a worktree."""
    with tempfile.TemporaryDirectory(prefix="trellis-baseline-") as tmp:
        tree = Path(tmp) / "tree"
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(tree), revision],
                       check=True, capture_output=True)
        try:
            command = [sys.executable, __file__, "--engine-root", str(tree), "--json",
                       "--batch", *map(str, args.batch), "--device-ms", str(args.device_ms),
                       "--steps", str(args.steps), "--warmup", str(args.warmup), "--threads", str(args.threads),
                       "--mask-fill-threads", str(args.mask_fill_threads)]
            # from the worktree's root: its compile workers start as ``python -m constraints...``
            out = subprocess.run(command, check=True, capture_output=True, text=True, cwd=tree).stdout
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)], capture_output=True)
    return [Measured(**row) for row in json.loads(out.strip().splitlines()[-1])]


def print_table(label: str, rows: list[Measured]) -> None:
    print(f"\n{label}")
    print("| batch | workload | jump-forward | host ms/step | wall ms/step | wall / max(host, D) | wall ms/token |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        jf = "on" if r.jump else ("off" if r.workload != "free" else "-")
        print(f"| {r.batch} | {r.workload} | {jf} | {r.host_ms:.2f} | {r.wall_ms:.2f} | {r.overlap_ratio:.2f} | "
              f"{r.ms_per_token:.3f} |")


# --smoke: sizes for a run of seconds that checks the script works end to end (tests run it)
SMOKE = {"batch": [1, 4], "device_ms": 1.0, "steps": 4, "warmup": 2}


def main(argv: list[str] | None = None) -> list[Measured]:
    """Run the benchmark; returns this tree's rows (overlap as asked) as printed."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--device-ms", type=float, default=5.0, help="emulated device time per forward (D)")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (the host's own)")
    parser.add_argument("--mask-fill-threads", type=int, default=0,
                        help="the engine's mask fill threads (0: one per core, as the engine sets beside a GPU)")
    parser.add_argument("--overlap", choices=["default", "on", "off"], default="on",
                        help="this tree's engine loop: overlapped (on) or synchronous (off)")
    parser.add_argument("--baseline", metavar="REV", help="also measure the engine at git revision REV")
    parser.add_argument("--smoke", action="store_true", help="batch 1 and 4, D = 1 ms, 4 steps: checks it runs")
    parser.add_argument("--engine-root", help=argparse.SUPPRESS)
    parser.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.smoke:  # the smoke sizes are defaults: flags given still win
        parser.set_defaults(**SMOKE)
        args = parser.parse_args(argv)
    if args.json:
        rows = run_here(args)
        print(json.dumps([{**r.__dict__} for r in rows]))
        return rows
    print(f"null runner, D = {args.device_ms} ms per forward, {args.steps} steps after {args.warmup}, "
          f"torch threads {args.threads}, mask fill threads {args.mask_fill_threads or os.cpu_count()}, "
          f"greedy rows, prompt {PROMPT_LEN} tokens, max_tokens 200")
    baseline = run_baseline(args, args.baseline) if args.baseline else []
    if baseline:
        print_table(f"engine at {args.baseline}", baseline)
    rows = run_here(args)
    print_table(f"engine of this tree (overlap {args.overlap})", rows)
    if args.overlap == "on":
        args.overlap = "off"
        sync = run_here(args)
        print_table("engine of this tree (overlap off)", sync)
    return rows


if __name__ == "__main__":
    main()
