"""Client-supplied logit processors (SGLang's ``custom_logit_processor`` contract).

The wire format, as SGLang documents it: a JSON object ``{"callable": "<hex>"}`` whose value is the
hex encoding of a ``dill``-pickled *class* (``CustomLogitProcessor.to_str()``); the server
instantiates the class with no arguments and calls it as
``processor(logits, custom_param_list) -> logits`` with ``logits`` the [R, V] rows that use it and
``custom_param_list`` one dict per row: the request's ``custom_params`` plus ``"__req__"``, a view
with the row's ``origin_input_ids`` and ``output_ids``.

This runs client code inside the server: the server only accepts it behind an explicit flag.
A processor that raises, returns something other than a tensor of the input's shape, or leaves a
row NaN/+inf or with no possible token fails only the rows it did that to (see :func:`apply_group`).
The caller may run each call under a time bound (a :data:`Runner`, the engine's): a call that
does not return in time fails like one that raised, and is abandoned, never waited for.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch

ERROR_PREFIX = "custom_logit_processor"  # every failure message starts with it (servers map it to a 400)
MAX_ENCODED_CHARS = 4_000_000  # a pickled class is a few KiB; refuse absurd payloads before decoding


T = TypeVar("T")
Runner = Callable[[Callable[[], T]], T]
"""How a processor call is made: ``run(fn)`` returns ``fn()``, or raises :class:`TimeoutError`
when the call did not return within the caller's bound (the call is then abandoned)."""


def run_directly(fn: Callable[[], T]) -> T:
    """The :data:`Runner` without a bound."""
    return fn()


class CustomProcessorError(ValueError):
    """The serialized processor cannot be loaded (the message says why)."""


def load_custom_processor(text: str) -> Callable[..., torch.Tensor]:
    """The processor instance serialized in ``text`` (cached: the same text gives the same instance,
    so rows of one processor are called together). Raises :class:`CustomProcessorError`."""
    if len(text) > MAX_ENCODED_CHARS:
        raise CustomProcessorError(f"it is longer than {MAX_ENCODED_CHARS} characters")
    return _load(text)


@functools.lru_cache(maxsize=64)
def _load(text: str) -> Callable[..., torch.Tensor]:
    try:
        payload = json.loads(text)
    except ValueError as exc:
        raise CustomProcessorError(f"it is not JSON ({exc})") from None
    if not isinstance(payload, dict) or not isinstance(payload.get("callable"), str):
        raise CustomProcessorError('it must be a JSON object {"callable": "<hex of a dill-pickled class>"}')
    try:
        raw = bytes.fromhex(payload["callable"])
    except ValueError:
        raise CustomProcessorError("'callable' is not a hex string") from None
    import dill  # imported here: only servers that accept processors need it

    try:
        obj = dill.loads(raw)
    except Exception as exc:  # noqa: BLE001 - any unpickling failure is the client's payload
        raise CustomProcessorError(f"unpickling failed: {type(exc).__name__}: {exc}") from None
    if isinstance(obj, type):
        try:
            obj = obj()
        except Exception as exc:  # noqa: BLE001
            raise CustomProcessorError(f"instantiating {obj.__name__} failed: {type(exc).__name__}: {exc}") from None
    if not callable(obj):
        raise CustomProcessorError(f"it decodes to a {type(obj).__name__}, which is not callable")
    return obj


class RequestView:
    """What a processor sees of its row as ``custom_params["__req__"]`` (SGLang's ``Req`` fields)."""

    __slots__ = ("origin_input_ids", "output_ids")

    def __init__(self, origin_input_ids: Sequence[int], output_ids: Sequence[int]) -> None:
        self.origin_input_ids = origin_input_ids
        self.output_ids = output_ids


def apply_group(
    processor: Callable[..., torch.Tensor],
    x: torch.Tensor,
    positions: list[int],
    idx: torch.Tensor,
    params: list[dict],
    run: Runner = run_directly,
) -> dict[int, str]:
    """Run ``processor`` on rows ``positions`` (device index ``idx``) of ``x`` and write its result
    back; returns {position: error} for the rows it failed. One batched call first; if that call
    raises, returns a bad shape or times out (``run``), each row is retried alone so one bad row
    fails only itself (a single row that timed out is not tried again)."""
    try:
        out = _checked_call(processor, x.index_select(0, idx), params, run)
    except _CallFailed as exc:
        if exc.timed_out and len(positions) == 1:
            return _fail_row(x, positions[0], str(exc))
        return _apply_rows(processor, x, positions, params, run)
    return _write_back(x, positions, idx, out)


def _apply_rows(processor, x: torch.Tensor, positions: list[int], params: list[dict], run: Runner) -> dict[int, str]:
    failures: dict[int, str] = {}
    for position, row_params in zip(positions, params):
        one = torch.tensor([position], dtype=torch.long, device=x.device)
        try:
            out = _checked_call(processor, x.index_select(0, one), [row_params], run)
        except _CallFailed as exc:
            failures.update(_fail_row(x, position, str(exc)))
            continue
        failures.update(_write_back(x, [position], one, out))
    return failures


def _fail_row(x: torch.Tensor, position: int, message: str) -> dict[int, str]:
    x[position] = 0.0  # harmless to sample from; the row's token is discarded
    return {position: message}


class _CallFailed(Exception):
    def __init__(self, message: str, timed_out: bool = False) -> None:
        super().__init__(message)
        self.timed_out = timed_out


def _checked_call(processor, logits: torch.Tensor, params: list[dict], run: Runner) -> torch.Tensor:
    expected = tuple(logits.shape)
    try:
        out, error = run(functools.partial(_call, processor, logits, params))
    except TimeoutError as exc:  # the runner's: the call's own exceptions come back as ``error``
        raise _CallFailed(f"custom_logit_processor timed out: {exc}", timed_out=True) from None
    if error is not None:
        raise _CallFailed(f"custom_logit_processor raised {type(error).__name__}: {error}")
    if not isinstance(out, torch.Tensor):
        raise _CallFailed(f"custom_logit_processor returned a {type(out).__name__}, not a tensor of logits")
    if tuple(out.shape) != expected:
        raise _CallFailed(f"custom_logit_processor returned logits of shape {tuple(out.shape)}, expected {expected}")
    return out


def _call(processor, logits: torch.Tensor, params: list[dict]) -> tuple[Any, Exception | None]:
    """The processor's result, or the exception it raised (client code: any failure is the row's)."""
    try:
        return processor(logits.float(), params), None
    except Exception as exc:  # noqa: BLE001
        return None, exc


def _write_back(x: torch.Tensor, positions: list[int], idx: torch.Tensor, out: torch.Tensor) -> dict[int, str]:
    """Copy valid rows of ``out`` into ``x``; rows with NaN, +inf or nothing finite fail."""
    out = out.to(device=x.device, dtype=torch.float32)
    nan = torch.isnan(out).any(dim=1) | torch.isposinf(out).any(dim=1)
    empty = ~torch.isfinite(out).any(dim=1)
    failures: dict[int, str] = {}
    flags = torch.stack([nan, empty]).tolist()  # one read-back for both checks
    for j, (is_nan, is_empty) in enumerate(zip(*flags)):
        if is_nan:
            failures[positions[j]] = "custom_logit_processor returned NaN or +inf logits"
        elif is_empty:
            failures[positions[j]] = "custom_logit_processor left no token possible (every logit is -inf)"
    if failures:
        bad = torch.tensor([j for j, p in enumerate(positions) if p in failures], dtype=torch.long, device=x.device)
        out[bad] = 0.0
    x.index_copy_(0, idx, out.to(x.dtype))
    return failures
