"""Prompt rendering and tokenisation off the event loop, bounded in time and size.

The model's own chat template is the operator's (trusted): it renders on a worker thread under a
time limit. A template sent by a client is untrusted code: it renders in a separate worker process
(Jinja's sandbox, plus an address-space cap) that is killed when it runs over its time budget, so a
template that loops or builds a huge string costs one worker, never the server.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from server.errors import bad_request

MAX_PROMPT_CHARS = 16 * 1024 * 1024
_WORKER_MEMORY_MB = 2048


@dataclass(frozen=True)
class RenderJob:
    """Everything ``apply_chat_template`` needs, as plain data (it crosses a process boundary)."""

    messages: list[dict[str, Any]]
    chat_template: str | None
    add_generation_prompt: bool
    continue_final_message: bool
    kwargs: dict[str, Any]
    add_special_tokens: bool = False  # vLLM's chat ``add_special_tokens``: BOS etc. on top of the template's
    fold_names: bool = field(default=True)  # message ``name`` into the content when the template ignores it


VERBOSITY_INSTRUCTIONS = {
    "low": "Be concise: answer in as few words as the question allows.",
    "medium": "Answer with a moderate amount of detail.",
    "high": "Answer thoroughly: give full detail, explanation and examples.",
}


def template_source(tokenizer, chat_template: str | None) -> str:
    """The chat template in use as one string (a request's own, else the tokenizer's)."""
    source = chat_template if chat_template is not None else getattr(tokenizer, "chat_template", None)
    if isinstance(source, dict):
        return "\n".join(str(v) for v in source.values())
    if isinstance(source, list):
        return "\n".join(str(item.get("template", "")) for item in source if isinstance(item, dict))
    return source or ""


def template_mentions(source: str, name: str) -> bool:
    return re.search(rf"\b{re.escape(name)}\b", source) is not None


def with_documents_and_verbosity(
    messages: list[dict[str, Any]], kwargs: dict[str, Any], source: str,
    documents: list[dict[str, Any]] | None, verbosity: str | None,
) -> list[dict[str, Any]]:
    """``documents`` and ``verbosity`` as template arguments when the template takes them, else
    as a system-prompt block (documents numbered, a one-line verbosity instruction)."""
    extra = []
    if documents is not None:
        if template_mentions(source, "documents"):
            kwargs["documents"] = documents
        else:
            extra.append(documents_prompt(documents))
    if verbosity is not None:
        if template_mentions(source, "verbosity"):
            kwargs["verbosity"] = verbosity
        else:
            extra.append(VERBOSITY_INSTRUCTIONS[verbosity])
    if not extra:
        return messages
    block = "\n\n".join(extra)
    if messages and messages[0].get("role") == "system":
        first = {**messages[0], "content": f"{messages[0].get('content') or ''}\n\n{block}".lstrip()}
        return [first, *messages[1:]]
    return [{"role": "system", "content": block}, *messages]


def documents_prompt(documents: list[dict[str, Any]]) -> str:
    """Documents for a template that does not take them: numbered, title then text (any other
    fields as JSON)."""
    lines = ["Use the following documents to answer. Cite them by number, like [1]."]
    for i, doc in enumerate(documents, 1):
        title = doc.get("title")
        text = doc.get("text", doc.get("content"))
        rest = {k: v for k, v in doc.items() if k not in ("title", "text", "content")}
        body = text if isinstance(text, str) else ("" if text is None else json.dumps(text, ensure_ascii=False))
        if rest:
            body = f"{body}\n{json.dumps(rest, ensure_ascii=False)}".strip()
        lines.append(f"[{i}] {title}\n{body}" if isinstance(title, str) and title else f"[{i}] {body}")
    return "\n\n".join(lines)


class TemplateError(Exception):
    """The template raised (``raise_exception``, a Jinja error, an undefined value …)."""


def render_and_tokenize(tokenizer, job: RenderJob) -> list[int]:
    """Apply the chat template and tokenize; raises TemplateError or ValueError (too large).

    Messages with a ``name`` render as they are when the template shows names; when it ignores
    them (the output is the same without), each name is written before its content (``name:``)."""
    text = _apply(tokenizer, job, job.messages)
    if job.fold_names and any(_named(m) for m in job.messages):
        bare = [{k: v for k, v in m.items() if k != "name"} if _named(m) else m for m in job.messages]
        if _apply(tokenizer, job, bare) == text:
            text = _apply(tokenizer, job, [_name_in_content(m) for m in job.messages])
    if len(text) > MAX_PROMPT_CHARS:
        raise ValueError(f"the rendered prompt has {len(text)} characters (limit {MAX_PROMPT_CHARS})")
    return list(tokenizer(text, add_special_tokens=job.add_special_tokens).input_ids)


def _apply(tokenizer, job: RenderJob, messages: list[dict[str, Any]]) -> str:
    try:
        return tokenizer.apply_chat_template(
            messages,
            chat_template=job.chat_template,
            add_generation_prompt=job.add_generation_prompt,
            continue_final_message=job.continue_final_message,
            tokenize=False,
            **job.kwargs,
        )
    except Exception as exc:  # jinja errors, template raise_exception(...), sandbox violations
        raise TemplateError(str(exc) or type(exc).__name__) from None


def _named(message: dict[str, Any]) -> bool:
    """A speaker's name (a tool result's ``name`` is its function, which tool templates handle)."""
    return bool(message.get("name")) and message.get("role") != "tool"


def _name_in_content(message: dict[str, Any]) -> dict[str, Any]:
    name = message.get("name")
    if not _named(message) or not isinstance(message.get("content"), str):
        return message
    out = {k: v for k, v in message.items() if k != "name"}
    out["content"] = f"{name}: {message['content']}"
    return out


class PromptRenderer:
    """Renders chat prompts for one tokenizer; thread-safe."""

    def __init__(self, tokenizer, tokenizer_dir: Path | str, *, timeout_s: float, allow_client_templates: bool) -> None:
        self.tokenizer = tokenizer
        self.timeout_s = timeout_s
        self.allow_client_templates = allow_client_templates
        self._tokenizer_dir = str(tokenizer_dir)
        self._pool = None
        self._lock = threading.Lock()

    async def render(self, job: RenderJob) -> list[int]:
        """Token ids of the rendered prompt; APIError (400) for a bad or runaway template."""
        param = "chat_template" if job.chat_template else "messages"
        if job.chat_template is not None and not self.allow_client_templates:
            raise bad_request("this server does not accept a request's own chat_template", param="chat_template",
                              code="unsupported_parameter")
        try:
            if job.chat_template is not None:  # the worker enforces the budget once it takes the job
                return await asyncio.to_thread(self._render_in_worker, job)
            return await asyncio.wait_for(asyncio.to_thread(render_and_tokenize, self.tokenizer, job), self.timeout_s)
        except TemplateError as exc:
            raise bad_request(f"the chat template could not render these messages: {exc}", param=param) from None
        except ValueError as exc:
            raise bad_request(str(exc), param=param, code="prompt_too_large") from None
        except (TimeoutError, _RenderTimeout):
            raise bad_request(f"rendering the chat template exceeded the {self.timeout_s:g} s budget",
                              param=param, code="template_timeout") from None

    def tokenize(self, text: str, add_special_tokens: bool) -> list[int]:
        """Tokenize raw text (call on a worker thread for long inputs)."""
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens).input_ids)

    def close(self) -> None:
        with self._lock:
            if self._pool is not None:
                self._pool.close()

    # -- the client-template worker process ---------------------------------------------------

    def _worker_pool(self):
        """One render worker, started on the first client template (it loads transformers)."""
        from constraints.compile.workers import WorkerPool

        with self._lock:
            if self._pool is None:
                self._pool = WorkerPool(1, "server.render:init_worker", (self._tokenizer_dir,),
                                        memory_mb=_WORKER_MEMORY_MB, name="trellis-render-worker")
            return self._pool

    def _render_in_worker(self, job: RenderJob) -> list[int]:
        from constraints.errors import ConstraintError, ConstraintTimeoutError

        try:
            ids, _ = self._worker_pool().run("server.render:render_in_worker", job, timeout=self.timeout_s)
            return ids
        except ConstraintTimeoutError:
            raise _RenderTimeout() from None
        except ConstraintError as exc:  # the worker died: over its memory cap, most likely
            raise ValueError(f"rendering the chat template failed: {exc.message}") from None


class _RenderTimeout(Exception):
    pass


# --------------------------------------------------------------------------- in the worker process

_worker_tokenizer = None


def init_worker(tokenizer_dir: str) -> None:
    """Runs once in a fresh render worker (the pool caps its memory afterwards)."""
    global _worker_tokenizer
    from server.model_loader import load_tokenizer

    _worker_tokenizer = load_tokenizer(Path(tokenizer_dir))


def render_in_worker(job: RenderJob) -> list[int]:
    return render_and_tokenize(_worker_tokenizer, job)
