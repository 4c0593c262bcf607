"""The kernel warm-up: after it, served steps (a jump-forward continuation, a draft's verification,
prefill chunks beside decode rows, masked and penalised sampling) launch no Triton kernel variant
the warm-up did not launch, so none compiles inside a request's step.

On the CPU the kernels run in Triton's interpreter, every call site taking the Triton path as on
CUDA, and each launch's variant is recorded as Triton's compiler keys it: the constexprs, each
integer argument's "equal to 1" and "multiple of 16", each tensor's dtype and 16-byte alignment.
The engine runs over a :class:`GraphedRunner` whose stand-in graphs re-run what they captured,
so the decode graphs' capture launches what it launches on CUDA."""

from __future__ import annotations

import inspect
import sys

import pytest
import torch

import kernels
from constraints import ConstraintSpec
from sampler import SamplingParams
from server.engine import kernel_warmup
from server.engine.cuda_graphs import GraphedRunner
from server.engine.engine import Engine
from server.engine.model import ModelRunner, load_hf_model
from server.engine.sequence import GenerationRequest
from tests.server.engine.test_piecewise import Factory

MAX_LEN = 96
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                            "kind": {"enum": ["alpha", "beta"]}},
          "required": ["name", "kind"], "additionalProperties": False}

needs_interpreter = pytest.mark.skipif(not (kernels.interpreter_enabled() and kernels.triton_kernels() is not None),
                                       reason="the Triton interpreter is not enabled in this process")


def _specialization(value, constexpr: bool):
    if constexpr or isinstance(value, (bool, str)) or value is None:
        return value
    if isinstance(value, int):
        return ("int", value == 1, value % 16 == 0, abs(value) >= 2**31)
    if isinstance(value, float):
        return "float"
    if isinstance(value, torch.Tensor):
        return (str(value.dtype), value.data_ptr() % 16 == 0)
    return type(value).__name__


def variant(function, args: tuple, kwargs: dict) -> tuple:
    """A launch's compile key, as Triton forms it (constexprs exact, the rest specialised)."""
    parameters = inspect.signature(function.fn).parameters
    unspecialised = set(function.kwargs.get("do_not_specialize") or ())
    bound = dict(zip(function.arg_names, args))
    options = {}
    for name, value in kwargs.items():
        (bound if name in parameters else options)[name] = value
    key = tuple((name, "any" if name in unspecialised else
                 _specialization(value, "constexpr" in str(parameters[name].annotation)))
                for name, value in bound.items())
    return (function.fn.__name__, key, tuple(sorted(options.items())))


def describe(new: set[tuple], warmed: set[tuple]) -> str:
    """Each new variant as its differences from the nearest warmed variant of its kernel."""
    lines = []
    for name, key, options in sorted(new, key=repr):
        candidates = [dict(k) for n, k, _o in warmed if n == name] or [{}]
        nearest = min(candidates, key=lambda c: sum(c.get(a) != v for a, v in key))
        diff = {a: (nearest.get(a), v) for a, v in key if nearest.get(a) != v}
        lines.append(f"  {name} {dict(options)}: warmed -> served {diff}")
    return "\n".join(lines)


@pytest.fixture
def launches(monkeypatch):
    """Every interpreted kernel launch's variant, in a list the test can cut; every kernel call
    site on the Triton path (the interpreter) as CUDA tensors would take it."""
    from triton.runtime.interpreter import InterpretedFunction

    seen: list[tuple] = []
    original = InterpretedFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        seen.append(variant(self, args, kwargs))
        return original(self, *args, grid=grid, warmup=warmup, **kwargs)

    monkeypatch.setattr(InterpretedFunction, "run", run)
    backend = kernels.select_backend
    for module in list(sys.modules.values()):
        if getattr(module, "select_backend", None) is backend:
            monkeypatch.setattr(module, "select_backend",
                                lambda t, use_triton=None: "reference" if use_triton is False else "triton")
    return seen


@pytest.fixture(scope="module")
def tiny_hf(tiny_model_dir):
    return load_hf_model(tiny_model_dir, torch.float32, torch.device("cpu"))


def _engine(tiny_hf, tokenizer, **kwargs) -> Engine:
    runner = ModelRunner.for_sequences(tiny_hf, 4, MAX_LEN, block_size=4, use_triton=True)
    graphed = GraphedRunner(runner, max_batch_size=4, max_blocks_per_seq=MAX_LEN // 4, max_graph_tokens=32,
                            graph_factory=Factory())
    graphed.capture()
    return Engine(graphed, tokenizer, max_batch_size=4, max_model_len=MAX_LEN, warm_up=True, **kwargs)


def _serve(engine: Engine, requests: list[GenerationRequest]) -> dict[str, list]:
    deltas: dict[str, list] = {request.request_id: [] for request in requests}
    for request in requests:
        request.sink = deltas[request.request_id].append
    engine.submit_all(requests)
    for _ in range(300):
        if all(d and d[-1].finish_reason for d in deltas.values()):
            return deltas
        engine.step()
    raise AssertionError("engine did not finish")


@needs_interpreter
def test_served_steps_launch_no_variant_the_warm_up_did_not(tiny_hf, default_tokenizer, default_compiler,
                                                            launches):
    compiled = default_compiler.compile(ConstraintSpec("json_schema", SCHEMA))
    prompt = default_tokenizer.encode("Name a thing and its kind as JSON: ")
    for jump_forward in (True, False):  # continuations, then drafts of the grammar's forced text
        engine = _engine(tiny_hf, default_tokenizer, jump_forward=jump_forward)
        warmed = set(launches)
        assert not engine.runner.kv.k[:, 0].any()  # the scratch block is zeros again
        assert any(name == "_paged_attention_kernel" for name, _key, _options in warmed)
        del launches[:]
        requests = [GenerationRequest(request_id="json", sink=None, prompt_token_ids=prompt, max_tokens=24,
                                      params=SamplingParams(temperature=0.0), matcher=compiled.new_matcher()),
                    GenerationRequest(request_id="free", sink=None, prompt_token_ids=prompt[:5], max_tokens=6,
                                      params=SamplingParams(temperature=0.0), ignore_eos=True),
                    GenerationRequest(request_id="penalised", sink=None, prompt_token_ids=prompt[3:], max_tokens=4,
                                      params=SamplingParams(seed=3, temperature=0.7, repetition_penalty=1.2),
                                      ignore_eos=True)]
        deltas = _serve(engine, requests)
        assert all(d[-1].error is None for d in deltas.values())
        served = set(launches)
        assert (engine.stats.forced_tokens if jump_forward else engine.stats.draft_tokens) > 0
        assert not served - warmed, "variants first launched while serving:\n" + describe(served - warmed, warmed)
        engine.shutdown()


def test_a_failing_warm_up_is_logged_and_the_engine_serves(tiny_hf, default_tokenizer, monkeypatch, caplog):
    def broken(_engine):
        raise RuntimeError("no such kernel")

    monkeypatch.setattr(kernel_warmup, "_run_all", broken)
    runner = ModelRunner.for_sequences(tiny_hf, 2, MAX_LEN, block_size=4)
    with caplog.at_level("ERROR", logger="trellis.engine"):
        engine = Engine(runner, default_tokenizer, max_batch_size=2, max_model_len=MAX_LEN, warm_up=True)
    assert "kernel warm-up failed" in caplog.text
    request = GenerationRequest(request_id="r", sink=None, prompt_token_ids=[1, 2, 3], max_tokens=3,
                                params=SamplingParams(temperature=0.0), ignore_eos=True)
    deltas = _serve(engine, [request])
    assert deltas["r"][-1].finish_reason == "length" and deltas["r"][-1].error is None
    assert not runner.kv.k[:, 0].any()  # the scratch block is zeros again
    engine.shutdown()

