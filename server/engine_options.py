"""Request fields that steer the engine itself: the LoRA adapter, the service tier, hidden states.

- LoRA (SGLang's and vLLM's contracts): ``model`` may be the served model, an adapter's name (vLLM,
  listed in ``/v1/models`` with its ``parent``) or ``base:adapter`` (SGLang); ``lora_path`` names a
  configured adapter (SGLang). An adapter that is not configured is a 404 (in ``model``) or a 400
  (in ``lora_path``) naming it. Responses name the adapter in ``model`` (:func:`response_model`).
- ``service_tier``: ``auto``/``default``/``flex``/``priority`` decide the order of admission to the
  batch (priority first, flex only when nothing else waits); anything else is a 400.
- ``speculation``: ``off`` keeps the engine's own drafts (prompt lookup) away from the request
  (its output is the same either way); ``auto`` follows the server's ``--speculation``.
- ``return_routed_experts`` is refused (or dropped on ``/v0`` / with ``drop_params``) with the other
  fields the loaded model cannot honour, in :func:`server.requests.reject_unimplemented`.
"""

from __future__ import annotations

import msgspec

from server.context import request_log
from server.dialect import split_model
from server.errors import APIError, bad_request

SERVICE_TIERS = ("auto", "default", "flex", "priority")
SPECULATION = ("auto", "off")


def adapter_names(state) -> dict[str, int]:
    """Configured adapter name → engine adapter id (1..n)."""
    lora = getattr(state, "lora", None)
    return dict(lora.ids) if lora is not None else {}


def adapter_in_model(state, model: str | None) -> str | None:
    """The adapter ``model`` selects (None: the base model); 404 naming what does not exist."""
    model, _ = split_model(model, state.provider_aliases)
    if model is None or model == state.model_name:
        return None
    names = adapter_names(state)
    if model in names:
        return model
    base, sep, adapter = model.rpartition(":")
    if sep and base == state.model_name:
        if adapter in names:
            return adapter
        raise APIError(f"The LoRA adapter `{adapter}` does not exist (loaded: {_listed(names)}).", status=404,
                       param="model", code="model_not_found")
    raise APIError(f"The model `{model}` does not exist.", status=404, param="model", code="model_not_found")


def apply_engine_options(state, req):
    """Validate the engine-steering fields of ``req``; returns it with ``lora_path`` set to the
    adapter it runs on (from ``model`` or ``lora_path``), or None for the base model."""
    if req.service_tier is not None and req.service_tier not in SERVICE_TIERS:
        raise bad_request(
            f"'service_tier' must be one of {', '.join(SERVICE_TIERS)}, got {req.service_tier!r}", param="service_tier"
        )
    if req.speculation is not None and req.speculation not in SPECULATION:
        raise bad_request(f"'speculation' must be one of {', '.join(SPECULATION)}, got {req.speculation!r}",
                          param="speculation")
    from_model = adapter_in_model(state, req.model)
    from_path = req.lora_path
    if from_path is not None:
        names = adapter_names(state)
        if from_path not in names:
            raise bad_request(f"'lora_path' names the LoRA adapter {from_path!r}, which is not loaded "
                              f"(loaded: {_listed(names)})", param="lora_path", code="lora_not_found")
        if from_model is not None and from_model != from_path:
            raise bad_request(f"'model' selects the adapter {from_model!r} but 'lora_path' names {from_path!r}",
                              param="lora_path")
    adapter = from_model or from_path
    if adapter is not None:
        request_log()["lora_adapter"] = adapter
    return msgspec.structs.replace(req, lora_path=adapter)


def response_model(state, req) -> str:
    """The ``model`` a response reports: the served name, or when an adapter ran, the adapter as the
    request named it (vLLM's ``adapter``, SGLang's ``base:adapter``, both echoed as sent like those
    servers do; ``@provider`` left off) or ``base:adapter`` when ``lora_path`` chose it."""
    adapter = getattr(req, "lora_path", None)
    if not adapter:
        return state.model_name
    named, _ = split_model(req.model, state.provider_aliases)
    sglang_style = f"{state.model_name}:{adapter}"
    return named if named in (adapter, sglang_style) else sglang_style


def adapter_id(state, req) -> int:
    """The engine's id of the adapter :func:`apply_engine_options` chose (0 = base model)."""
    name = getattr(req, "lora_path", None)
    return adapter_names(state)[name] if name else 0


def response_tier(req) -> str | msgspec.UnsetType:
    """The tier a response reports: the one the request ran under (``auto`` runs as ``default``)."""
    tier = req.service_tier
    if tier is None:
        return msgspec.UNSET
    return "default" if tier == "auto" else tier


def _listed(names: dict[str, int]) -> str:
    return ", ".join(sorted(names)) or "none; start the server with --lora-modules name=path"
