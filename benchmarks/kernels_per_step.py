"""Kernels one decode step of the Llama runner launches on CUDA, per decoder layer, counted on the CPU.

The CUDA code path runs on CPU tensors: every kernel dispatcher's ``select_backend`` is made to
answer "triton" (as it does for a CUDA tensor), Triton kernels run in its interpreter
(``TRITON_INTERPRET=1``), and one decode ``ModelRunner.forward`` is run under a
``TorchDispatchMode`` that sorts every aten op it sees into real kernels (compute, copies,
fills), views and other metadata ops, allocations and host reads; Triton launches are counted
where the interpreter starts one (the aten ops the interpreter itself issues to move a launch's
arguments in and out are not counted). Two random-weight tiny Llamas that differ only in their
number of layers give the count per layer (the difference over the layer difference) and the
rest per step (embedding, rotary tables, final norm, lm_head). ``--baseline REV`` counts the
runner of git revision REV (a temporary worktree) in a subprocess, side by side.

    python benchmarks/kernels_per_step.py                     # this tree and 12ac1c5
    python benchmarks/kernels_per_step.py --baseline none --json /tmp/kernels.json
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import os
import pkgutil
import subprocess
import sys
import tempfile
import time
import types
from collections import Counter
from contextlib import contextmanager
from pathlib import Path
from typing import Self

import torch  # imports no Triton: TRITON_INTERPRET can still be set, in setup_environment
from torch.utils._python_dispatch import TorchDispatchMode

REPO = Path(__file__).resolve().parents[1]
# What importing Triton or a kernel module raises where it cannot run (no package, a broken backend).
IMPORT_FAILURES = (ImportError, RuntimeError, OSError, AttributeError)
DEFAULT_BASELINE = "12ac1c5"  # the revision before the fused forward
BLOCK_SIZE = 16
MAX_LEN = 64
TOP_OPS = 12

# Ops whose schema does not mark them as aliasing but which only make a tensor's metadata
# (or do nothing) on CUDA: no kernel.
METADATA_OPS = frozenset({
    "_unsafe_view", "_reshape_alias", "alias", "as_strided", "detach", "lift_fresh", "view", "view_as", "t",
    "transpose", "permute", "expand", "expand_as", "unsqueeze", "squeeze", "slice", "select", "split",
    "split_with_sizes", "unbind", "narrow", "diagonal", "unfold", "real", "imag", "view_as_real", "view_as_complex",
    "_nested_view_from_buffer", "unflatten", "flatten", "movedim", "indices", "values",
})
ALLOCATION_OPS = frozenset({
    "empty", "empty_like", "empty_strided", "empty_permuted", "new_empty", "new_empty_strided", "resize_", "set_",
    "_empty_affine_quantized", "_resize_output_",
})
HOST_READ_OPS = frozenset({"_local_scalar_dense", "item"})  # a device-to-host copy and a sync on CUDA


def classify(func) -> str:
    """'kernel', 'view', 'alloc', 'host_read' or 'other' (no tensor out: a size query and the like)."""
    name = func.overloadpacket.__name__
    if name in ALLOCATION_OPS:
        return "alloc"
    if name in HOST_READ_OPS:
        return "host_read"
    if name in METADATA_OPS or torch.Tag.inplace_view in func.tags:
        return "view"
    returns = func._schema.returns
    if any(r.alias_info is not None and not r.alias_info.is_write for r in returns):
        return "view"  # returns an alias of an input (view, transpose, split, ...)
    if not any("Tensor" in str(r.type) for r in returns):
        return "other"
    return "kernel"


def _storages(tree) -> set[int]:
    leaves = tree if isinstance(tree, (list, tuple)) else tree.values() if isinstance(tree, dict) else [tree]
    found: set[int] = set()
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            found.add(leaf.untyped_storage().data_ptr())
        elif isinstance(leaf, (list, tuple, dict)):
            found |= _storages(leaf)
    return found


def _aliases_an_input(out, args, kwargs) -> bool:
    """Every tensor ``out`` holds shares storage with a tensor argument (or there is none)."""
    inputs = _storages(args) | _storages(kwargs)
    return _storages(out) <= inputs


class KernelCounter(TorchDispatchMode):
    """Counts the aten ops of its scope by :func:`classify`, and Triton launches (fed by
    :func:`count_triton_launches`); ops issued inside a launch are the interpreter's own."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: dict[str, Counter] = {k: Counter() for k in ("kernel", "view", "alloc", "host_read", "other")}
        self.launches: Counter = Counter()
        self.interpreter_ops = 0
        self.in_launch = 0
        self.active = False
        self.dry = False

    def __torch_dispatch__(self, func, arg_types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.in_launch:
            self.interpreter_ops += 1
            return func(*args, **kwargs)
        if torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "CompositeImplicitAutograd"):
            # Under inference mode composite ops (linear, matmul, reshape, to, contiguous, ...)
            # reach the mode whole: count what they are made of instead.
            with self:
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        out = func(*args, **kwargs)
        if self.active:
            kind = classify(func)
            if kind == "view" and not _aliases_an_input(out, args, kwargs):
                kind = "kernel"  # a view-like op that copied
            self.ops[kind][func.overloadpacket.__name__] += 1
        return out

    def summary(self) -> dict:
        return {
            "aten_kernels": dict(self.ops["kernel"]),
            "triton_launches": dict(self.launches),
            "views": sum(self.ops["view"].values()),
            "allocations": sum(self.ops["alloc"].values()),
            "host_reads": sum(self.ops["host_read"].values()),
            "interpreter_ops_not_counted": self.interpreter_ops,
        }


@contextmanager
def count_triton_launches(counter: KernelCounter):
    """Every ``kernel[grid](...)`` ends in ``InterpretedFunction.run`` under the interpreter:
    count the outermost one per launch and keep the ops it issues out of the aten counts.
    While ``counter.dry``, a launch is counted and not run."""
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except IMPORT_FAILURES:
        yield False
        return
    original = InterpretedFunction.run

    def run(self, *args, **kwargs):
        if kwargs.get("warmup") or counter.in_launch:
            return original(self, *args, **kwargs)
        if counter.active:
            counter.launches[getattr(self, "__name__", "triton_kernel")] += 1
        if counter.dry:
            return None
        counter.in_launch += 1
        try:
            return original(self, *args, **kwargs)
        finally:
            counter.in_launch -= 1

    InterpretedFunction.run = run
    try:
        yield True
    finally:
        InterpretedFunction.run = original


def _triton_interpreted() -> bool:
    """The Triton kernels import, and run in the interpreter (so on CPU tensors)."""
    backend = importlib.import_module("kernels._backend")
    find = getattr(backend, "triton_kernels", None)
    try:
        mod = find() if find is not None else importlib.import_module("kernels._triton_kernels")
    except IMPORT_FAILURES:
        mod = None
    return bool(mod is not None and getattr(mod, "INTERPRETED", False))


def _import_kernel_modules() -> list[str]:
    """Every ``kernels.*`` module, so a dispatcher imported lazily mid-forward is patched too;
    returns those that failed to import."""
    import kernels

    failed = []
    for info in pkgutil.iter_modules(kernels.__path__):
        try:
            importlib.import_module(f"kernels.{info.name}")
        except IMPORT_FAILURES:
            failed.append(info.name)
    return failed


class BackendChoice:
    """``select_backend`` replaced in ``kernels._backend`` and in every ``kernels.*`` /
    ``server.*`` module that imported it by name. ``mode`` "triton": it answers as for a CUDA
    tensor ("triton" unless ``use_triton=False``); "reference": always the torch path (the
    prefill, which is not counted, runs fast); None: the original answers."""

    def __init__(self) -> None:
        self.backend = importlib.import_module("kernels._backend")
        self.original = self.backend.select_backend
        self.mode: str | None = None
        self.patched: list[types.ModuleType] = []

    def select_backend(self, t, use_triton=None, *args, **kwargs):
        if self.mode is None:
            return self.original(t, use_triton, *args, **kwargs)
        return "reference" if use_triton is False or self.mode == "reference" else "triton"

    def patch_new_modules(self) -> None:
        """Patch the modules imported since (a dispatcher imported lazily mid-forward)."""
        for name, module in list(sys.modules.items()):
            if module is None or not (name in ("kernels", "server") or name.startswith(("kernels.", "server."))):
                continue
            if vars(module).get("select_backend") is self.original:
                module.select_backend = self.select_backend
                self.patched.append(module)

    def __enter__(self) -> Self:
        _import_kernel_modules()
        self.patch_new_modules()
        return self

    def __exit__(self, *exc) -> None:
        for module in self.patched:
            module.select_backend = self.original
        self.patched.clear()


class _CudaLikeQuery:
    """What the split heuristic reads of a query (shape, device), as if it were on CUDA."""

    def __init__(self, query: torch.Tensor) -> None:
        self.shape, self.dtype = query.shape, query.dtype
        self.is_cuda, self.device = True, torch.device("cuda", 0)


@contextmanager
def cuda_kv_splits(sm_count: int, chosen: list[int]):
    """Paged attention's key-split choice (flash-decoding: a second, merging launch) as on a
    CUDA device of ``sm_count`` SMs; the interpreter's own choice is never to split. The
    heuristic itself runs (on a stand-in query); where it cannot, the interpreter's choice
    stands. ``chosen`` collects the choices."""
    try:
        mod = importlib.import_module("kernels._paged_attention_triton")
    except IMPORT_FAILURES:
        mod = None
    heuristic = getattr(mod, "auto_kv_splits", None)
    if sm_count <= 0 or heuristic is None or not hasattr(mod, "_sm_count"):
        yield
        return

    def auto_kv_splits(query, *args, **kwargs):
        saved = mod.INTERPRETED, mod._sm_count
        mod.INTERPRETED, mod._sm_count = False, lambda index: sm_count
        try:
            splits = heuristic(_CudaLikeQuery(query), *args, **kwargs)
        except (AttributeError, TypeError, ValueError, RuntimeError):  # the heuristic reads more than the stand-in has
            splits = None
        finally:
            mod.INTERPRETED, mod._sm_count = saved
        if splits is None:
            splits = heuristic(query, *args, **kwargs)
        chosen.append(splits)
        return splits

    mod.auto_kv_splits = auto_kv_splits
    try:
        yield
    finally:
        mod.auto_kv_splits = heuristic


def setup_environment(engine_root: Path) -> None:
    """Before the engine is imported: Triton kernels interpreted (they choose compiled or
    interpreted when their module is imported), offline Hugging Face, and ``engine_root`` (a
    baseline worktree, or this repo) first on ``sys.path``."""
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    if str(engine_root) not in sys.path[:1]:
        sys.path.insert(0, str(engine_root))


# ---------------------------------------------------------------------------------------- model


def tiny_llama(layers: int, vocab: int):
    """A random-weight float32 Llama (the test suite's tiny shape), ``layers`` decoder layers."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=True,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(torch.float32).eval()


def build_runner(hf_model, max_seqs: int):
    """``ModelRunner.for_sequences`` with ``use_triton=True`` where the runner takes it."""
    from server.engine.model import ModelRunner

    cls = ModelRunner
    if "use_triton" in inspect.signature(ModelRunner.for_sequences).parameters:
        return cls.for_sequences(hf_model, max_seqs, MAX_LEN, block_size=BLOCK_SIZE, use_triton=True)
    if "use_triton" in inspect.signature(ModelRunner.__init__).parameters:

        class TritonRunner(ModelRunner):
            def __init__(self, *args, **kwargs):
                kwargs.setdefault("use_triton", True)
                super().__init__(*args, **kwargs)

        cls = TritonRunner
    return cls.for_sequences(hf_model, max_seqs, MAX_LEN, block_size=BLOCK_SIZE)


def slot_table(runner, slot: int) -> list[int]:
    """Blocks ``1 + slot * n ...`` of a ``for_sequences`` cache (as tests/server/engine/paged_util.py)."""
    per_seq = -(-MAX_LEN // runner.block_size)
    return [1 + slot * per_seq + i for i in range(per_seq)]


def step_batch(runner, rows: list[tuple[int, list[int], int]]):
    """``rows`` as (slot, new tokens, start): the ``StepBatch`` of one step."""
    from server.engine.step_batch import StepBatch

    paged = [(slot_table(runner, slot), list(new), start) for slot, new, start in rows]
    return StepBatch.build(paged, runner.block_size, runner.device)


def count_model(layers: int, batches: list[int], vocab: int, sm_count: int, triton: bool, run_counted: bool) -> dict:
    """Kernels of one decode step at each batch size, for a model of ``layers`` layers.

    Rows of different prompt lengths are prefilled on the torch path (not counted). At each
    batch size a first decode step runs the CUDA path for real (Triton in the interpreter; its
    logits are checked, and it primes lazy work), then the next step is counted; its Triton
    launches are counted but not run (unless ``run_counted``), and it writes the position the
    next real step writes again."""
    runner = build_runner(tiny_llama(layers, vocab), max(batches))
    rows = max(batches)
    lengths = [3 + 2 * slot for slot in range(rows)]
    prompts = [[(7 * slot + 3 * i) % (vocab - 10) + 10 for i in range(n)] for slot, n in enumerate(lengths)]
    counter = KernelCounter()
    splits: list[int] = []
    result = {}
    with BackendChoice() as choice, count_triton_launches(counter):
        choice.mode = "reference"
        runner.forward(step_batch(runner, [(slot, prompts[slot], 0) for slot in range(rows)]))
        choice.mode = "triton" if triton else None
        for batch in batches:
            for counted in (False, True):
                decode = [(slot, [(11 * lengths[slot]) % (vocab - 10) + 10], lengths[slot]) for slot in range(batch)]
                batch_in = step_batch(runner, decode)
                choice.patch_new_modules()
                counter.ops = {k: Counter() for k in counter.ops}
                counter.launches, counter.interpreter_ops, splits[:] = Counter(), 0, []
                with cuda_kv_splits(sm_count if counted and triton else 0, splits), counter:
                    counter.active, counter.dry = counted, counted and not run_counted  # the forward only
                    logits = runner.forward(batch_in)
                    counter.active = counter.dry = False
                if not counted:
                    finite = bool(torch.isfinite(logits).all())
                    if tuple(logits.shape) != (batch, vocab) or not finite:
                        raise RuntimeError(f"decode logits of batch {batch}: {tuple(logits.shape)}, finite: {finite}")
                    for slot in range(batch):
                        lengths[slot] += 1
            result[str(batch)] = {**counter.summary(), "kv_splits": sorted(set(splits))}
    return result


def _per_layer(small: dict, big: dict, layer_diff: int, small_layers: int) -> dict:
    """Per-layer counts (difference over the layer difference) and the per-step rest."""

    def diff(a: dict, b: dict) -> dict:
        keys = set(a) | set(b)
        out = {k: (b.get(k, 0) - a.get(k, 0)) / layer_diff for k in keys}
        return {k: _num(v) for k, v in sorted(out.items(), key=lambda kv: (-kv[1], kv[0])) if v}

    def rest(total: dict, per: dict) -> dict:
        out = {k: _num(total.get(k, 0) - small_layers * per.get(k, 0)) for k in set(total) | set(per)}
        return {k: v for k, v in sorted(out.items(), key=lambda kv: (-kv[1], kv[0])) if v}

    aten = diff(small["aten_kernels"], big["aten_kernels"])
    launches = diff(small["triton_launches"], big["triton_launches"])
    per_layer = {
        "aten": _num(sum(aten.values())), "triton": _num(sum(launches.values())),
        "aten_ops": aten, "triton_kernels": launches,
        "views": _num((big["views"] - small["views"]) / layer_diff),
        "allocations": _num((big["allocations"] - small["allocations"]) / layer_diff),
        "host_reads": _num((big["host_reads"] - small["host_reads"]) / layer_diff),
    }
    per_layer["total"] = _num(per_layer["aten"] + per_layer["triton"])
    extra_aten = rest(small["aten_kernels"], aten)
    extra_launches = rest(small["triton_launches"], launches)
    per_step = {"aten": _num(sum(extra_aten.values())), "triton": _num(sum(extra_launches.values())),
                "aten_ops": extra_aten, "triton_kernels": extra_launches,
                "host_reads": _num(small["host_reads"] - small_layers * per_layer["host_reads"])}
    per_step["total"] = _num(per_step["aten"] + per_step["triton"])
    return {"per_layer": per_layer, "per_step_extra": per_step, "kv_splits": big["kv_splits"]}


def _num(value: float) -> float | int:
    return int(value) if float(value).is_integer() else round(value, 3)


def run_here(args: argparse.Namespace) -> dict:
    """Count this process's engine (the one ``sys.path`` imports first)."""
    torch.set_num_threads(max(1, args.threads))
    triton = _triton_interpreted()
    small_layers, big_layers = args.layers
    started = time.perf_counter()
    raw = {str(n): count_model(n, args.batch, args.vocab, args.sm_count, triton, args.run_counted)
           for n in (small_layers, big_layers)}
    batches = {str(b): _per_layer(raw[str(small_layers)][str(b)], raw[str(big_layers)][str(b)],
                                  big_layers - small_layers, small_layers) for b in args.batch}
    return {"engine_root": str(args.engine_root), "triton": "interpreted" if triton else "not interpreted",
            "layers": [small_layers, big_layers], "seconds": round(time.perf_counter() - started, 2),
            "batches": batches, "raw": raw}


def run_baseline(args: argparse.Namespace) -> tuple[dict | None, str | None]:
    """The same count over the engine of ``args.baseline``, in a subprocess importing a
    temporary worktree (removed afterwards): (result, None) or (None, why not)."""
    with tempfile.TemporaryDirectory(prefix="trellis-kernels-baseline-") as tmp:
        tree = Path(tmp) / "tree"
        try:
            subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(tree), args.baseline],
                           check=True, capture_output=True, text=True)
        except FileNotFoundError:
            return None, "git is not installed"
        except subprocess.CalledProcessError as err:
            return None, f"git worktree add {args.baseline} failed: {(err.stderr or err.stdout).strip()}"
        try:
            command = [sys.executable, str(Path(__file__).resolve()), "--engine-root", str(tree), "--emit-json",
                       "--batch", *map(str, args.batch), "--layers", *map(str, args.layers),
                       "--vocab", str(args.vocab), "--sm-count", str(args.sm_count), "--threads", str(args.threads),
                       *(["--run-counted"] if args.run_counted else [])]
            done = subprocess.run(command, check=False, capture_output=True, text=True, cwd=tmp)
            if done.returncode:
                return None, f"the count at {args.baseline} failed:\n{done.stderr.strip()[-2000:]}"
            return json.loads(done.stdout.strip().splitlines()[-1]), None
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)], check=False,
                           capture_output=True)


# ------------------------------------------------------------------------------------- printing


def header(args: argparse.Namespace) -> str:
    small, big = args.layers
    split = (f"chooses its key split as on a {args.sm_count}-SM GPU" if args.sm_count > 0
             else "does not split keys (the interpreter's choice)")
    return (
        "Kernels one decode forward of ModelRunner would launch on CUDA, counted on the CPU. The CUDA code path "
        "runs on CPU tensors: every kernel dispatcher's select_backend answers \"triton\" as for a CUDA tensor, "
        f"the Triton kernels run in Triton's interpreter, and paged attention {split}. Counted, in a "
        "TorchDispatchMode around runner.forward: every aten op that is a real kernel (compute, copies, fills, "
        "casts; a composite op such as linear, to or reshape counts as what it decomposes into), not views or "
        "other aliasing and metadata ops, not allocations (empty*), not host reads (.item()); and Triton launches, "
        "counted where a kernel[grid](...) starts (the copies the interpreter makes around a launch are not "
        f"counted). Two random-weight float32 Llamas (hidden 64, 4 heads, 2 kv heads, vocab {args.vocab}), "
        f"{small} and {big} layers: per layer = their difference / {big - small}; per-step extra = the rest "
        "(embedding, rotary, final norm, lm_head). Rows of different lengths are prefilled on the torch path; at "
        "each batch size one decode step runs the CUDA path for real (its logits are checked) and the next one is "
        "counted, its Triton launches counted but not run"
        f"{' (--run-counted: run too)' if not args.run_counted else ' (and run: --run-counted)'}."
    )


def _ops_text(ops: dict, limit: int = TOP_OPS) -> str:
    items = list(ops.items())
    text = ", ".join(f"{name} {count:g}" for name, count in items[:limit])
    return text + (f", ... ({len(items) - limit} more)" if len(items) > limit else "") if items else "-"


def print_tables(args: argparse.Namespace, results: list[tuple[str, dict]]) -> None:
    labels = [label for label, _ in results]
    ratio = len(results) == 2
    columns = ["batch", "kernels", *labels] + ([f"{labels[0]} / {labels[1]}"] if ratio else [])
    print("\n| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    rows = (("aten compute ops per layer", "per_layer", "aten"), ("Triton launches per layer", "per_layer", "triton"),
            ("total kernels per layer", "per_layer", "total"), ("per-step extra kernels", "per_step_extra", "total"),
            ("(not kernels) views per layer", "per_layer", "views"),
            ("(not kernels) allocations per layer", "per_layer", "allocations"))
    for batch in map(str, args.batch):
        for name, part, key in rows:
            values = [result["batches"][batch][part][key] for _, result in results]
            cells = [f"{v:g}" for v in values]
            if ratio:
                cells.append(f"{values[0] / values[1]:.2f}" if values[1] else "-")
            print(f"| {batch} | {name} | " + " | ".join(cells) + " |")
    for label, result in results:
        print(f"\n{label} ({result['engine_root']}; Triton {result['triton']}, {result['seconds']} s):")
        for batch in map(str, args.batch):
            counts = result["batches"][batch]
            per_layer, per_step = counts["per_layer"], counts["per_step_extra"]
            print(f"  batch {batch}, per layer: aten {_ops_text(per_layer['aten_ops'])}")
            print(f"  batch {batch}, per layer: Triton {_ops_text(per_layer['triton_kernels'])}"
                  f" (key splits {counts['kv_splits'] or '-'})")
            print(f"  batch {batch}, per step extra: aten {_ops_text(per_step['aten_ops'])}; "
                  f"Triton {_ops_text(per_step['triton_kernels'])}")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", default=DEFAULT_BASELINE, metavar="REV",
                        help=f"also count the runner at git revision REV (default {DEFAULT_BASELINE}; 'none': skip)")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8], help="decode batch sizes")
    parser.add_argument("--layers", type=int, nargs=2, default=[2, 4], metavar=("SMALL", "BIG"),
                        help="the two models' layer counts")
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--sm-count", type=int, default=132,
                        help="SMs of the GPU whose paged-attention key split is emulated (132: H100 SXM; 0: none)")
    parser.add_argument("--run-counted", action="store_true",
                        help="run the counted step's Triton launches too (slow in the interpreter; same counts)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON to PATH")
    parser.add_argument("--engine-root", help=argparse.SUPPRESS)
    parser.add_argument("--emit-json", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    small, big = args.layers
    if not 0 < small < big:
        parser.error("--layers SMALL BIG needs 0 < SMALL < BIG")
    args.engine_root = Path(args.engine_root).resolve() if args.engine_root else REPO
    setup_environment(args.engine_root)
    if args.emit_json:  # the baseline's subprocess: one JSON line
        result = run_here(args)
        print(json.dumps(result))
        return result
    print(header(args))
    baseline, why = (None, None)
    wanted = args.baseline.lower() != "none"
    if wanted:
        baseline, why = run_baseline(args)
        if why:
            print(f"\nno baseline: {why}")
    current = run_here(args)
    results = [("this tree", current)] + ([(args.baseline, baseline)] if baseline else [])
    print_tables(args, results)
    out = {"config": {k: v for k, v in vars(args).items() if k not in ("engine_root", "emit_json", "json")},
           "this_tree": current, "baseline": baseline, "baseline_revision": args.baseline if wanted else None,
           "baseline_error": why}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return out


if __name__ == "__main__":
    main()
