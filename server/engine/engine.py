"""The batched decoding loop (continuous batching) running in its own thread.

Every step: take new requests and aborts, admit waiting sequences while the KV cache has blocks for them (a cached prefix is shared), run one
forward over every sequence's pending tokens (one for decoding sequences, several for prefill
chunks and jump-forward continuations), fill constraint bitmasks on a worker thread while the
forward runs, sample all rows in one sampler pass, then append tokens,
detokenize, check stops and report one delta per sequence. Finished sequences leave the batch at
the end of the step; nothing ever waits for another request to finish.

Host and device work overlap. A step's integer inputs go to the device in one non-blocking copy
from a reused pinned buffer, and so do the bitmasks (:mod:`server.engine.host_buffers`); the
forward is then only queued. With ``overlap`` (default: wherever the forward runs asynchronously,
i.e. not on the CPU) the loop does not wait for a step's sampled ids before launching the next
step (:mod:`server.engine.inflight`):

    schedule → launch forward N+1 (rows sampled at N take their token from the device)
             → read step N's ids (one event) → matchers, detokenizer, stops, forced tokens
             → fill the masks of the rows sampled at N+1 → queue sampling N+1 → deliver, retire

so everything the host does per token runs while the device computes the next forward. A row
that finished at N, or whose token at N was followed by forced tokens (jump-forward, reasoning
markers) or replaced (close_on_length), is not sampled at N+1: its logits are at a position it no
longer samples from, and at most that one forward row is wasted. Sampling sees the same rows,
masks and RNG draws as in the synchronous loop (``overlap=False``: read the ids right after
sampling, before the next launch), so the output is the same. Steps whose inputs need the tokens
on the host first (draft proposals) read them before scheduling.

The step reads the device back once: the sampler's ids together with any logprobs (one more
transfer only for rows asking for hidden states, and per scored choice). Rows with a device DFA
read its state when a token is accepted.

Two hooks use per-position logits of an extension: a sequence with a predicted output feeds its
next draft tokens after its last token and keeps the prefix that sampling agrees with
(:meth:`Engine._verify_drafts`); a sequence scoring choices feeds every choice after the prompt
from a copy of the prompt's cache, all in one pass (:meth:`Engine._plan_scoring`).

Failures stay as small as they can: whatever fails for one sequence (its matcher, detokenizer,
stop strings or sink) ends only that sequence with finish_reason "error"; a failed forward or
sampler pass ends only the sequences of that step. The waiting queue is bounded
(:class:`AdmissionControl`), and if the thread dies anyway every pending sequence gets a final
error delta and :attr:`Engine.alive` turns False.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from constraints.batch_fill import fill_bitmasks
from sampler import Sampler, TokenLogprobs
from sampler.params import PendingSample
from sampler.pool import to_device
from server.engine.admission import AdmissionControl
from server.engine.detokenizer import IncrementalDetokenizer, StopStringMatcher
from server.engine.drafts import Draft
from server.engine.host_buffers import HostStaging
from server.engine.inflight import SAMPLED, InFlight, device_event, resolve, unfeed
from server.engine.errors import EngineDead, EngineOverloaded, EngineUnavailable
from server.engine.block_manager import BlockManager, BlockTable
from server.engine.model import ModelRunner
from server.engine.scheduler import Scheduler
from server.engine.sequence import GenerationRequest, ReasoningPhase, Sequence, SequenceDelta, error_delta
from server.engine.step_batch import StepBatch

__all__ = ["Engine", "EngineDead", "EngineOverloaded", "EngineStats", "EngineUnavailable"]

log = logging.getLogger("trellis.engine")

DEFAULT_MAX_WAITING_SEQS = 256
DEFAULT_MAX_WAITING_TOKENS = 262144
DEFAULT_MAX_DRAFT_TOKENS = 32  # predicted-output tokens verified per sequence per step


@dataclass
class EngineStats:
    steps: int = 0
    decode_tokens: int = 0
    extend_tokens: int = 0
    forced_tokens: int = 0
    draft_tokens: int = 0  # predicted-output tokens fed for verification
    accepted_draft_tokens: int = 0  # of those, kept in the output
    scored_choices: int = 0  # choices scored as a whole sequence (choice logprobs)
    closing_steered: int = 0  # tokens close_on_length chose instead of the sampled one
    mask_fill_s: float = 0.0
    forward_s: float = 0.0
    sample_s: float = 0.0
    sampled_in_graph: int = 0  # sampler passes replayed from the runner's sampling graphs
    sampled_eagerly: int = 0  # sampler passes run by the eager sampler
    failed_sequences: int = 0  # finished with "error"
    failed_batches: int = 0  # forward or sampler passes that raised
    failed_steps: int = 0  # steps that raised out of Engine.step (a bug): the running batch failed


# how a sequence whose constraint hit a parser limit mid-generation fails (the client's constraint
# is too complex to follow at this point: a 400 naming it, not a server fault)
CONSTRAINT_LIMIT = "the constraint hit a parser limit mid-generation"


class SequenceFailed(Exception):
    """One sequence's own work failed; the message is what its client is told."""


class Engine:
    """Owns the model runner, the sampler and all sequences; thread-safe ``submit_all``/``abort``."""

    def __init__(
        self,
        runner: ModelRunner,
        tokenizer,
        *,
        max_batch_size: int,
        max_model_len: int,
        prefill_budget: int = 1024,
        jump_forward: bool = True,
        max_waiting_seqs: int = DEFAULT_MAX_WAITING_SEQS,
        max_waiting_tokens: int = DEFAULT_MAX_WAITING_TOKENS,
        max_draft_tokens: int = DEFAULT_MAX_DRAFT_TOKENS,
        enable_prefix_caching: bool = True,
        mask_fill_threads: int = 0,
        overlap: bool | None = None,
    ) -> None:
        self.runner = runner
        self.tokenizer = tokenizer
        self.sampler = Sampler(runner.vocab_size, runner.device)
        self._graph_sampler = getattr(runner, "graph_sampler", None)  # a GraphedRunner's in-graph sampling pass
        self.max_batch_size = max_batch_size
        self.max_model_len = max_model_len
        self.prefill_budget = prefill_budget
        self.jump_forward = jump_forward
        self.max_draft_tokens = max_draft_tokens
        # 0: one fill thread per masked row up to one per core beside a GPU; on the CPU the
        # forward's torch threads already use every core, so the fill keeps to one thread
        self.mask_fill_threads = mask_fill_threads if mask_fill_threads > 0 else int(runner.device.type != "cuda")
        self.stats = EngineStats()
        self.last_step_at = time.monotonic()
        self._admission = AdmissionControl(max_waiting_seqs, max_waiting_tokens)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self.blocks = BlockManager(runner.kv.num_blocks, runner.block_size, enable_prefix_caching)
        if self.blocks.capacity_tokens < max_model_len:
            raise ValueError(f"the KV cache holds {self.blocks.capacity_tokens} tokens, less than one "
                             f"sequence of max_model_len {max_model_len}")
        self.scheduler = Scheduler(self.blocks, max_batch_size, prefill_budget)
        self._mask_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trellis-mask")
        self._words = (runner.vocab_size + 31) // 32
        self._valid_bits = _valid_bits(runner.vocab_size, self._words)
        self._step_staging = HostStaging(runner.device)  # the step's integer arrays (StepBatch.build)
        self._mask_staging = HostStaging(runner.device)  # bitmasks and their row indices
        self._step_hidden: torch.Tensor | None = None  # [C, D] for this step's sampling candidates
        # None: where the forward runs asynchronously, i.e. not on the CPU (see the module docstring)
        self.overlap = runner.device.type != "cpu" or hasattr(runner, "new_event") if overlap is None else overlap
        self._inflight: InFlight | None = None  # the last sampler pass, not yet read by the host
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    # ------------------------------------------------------------------ public, any thread

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="trellis-engine", daemon=True)
        self._thread.start()

    def shutdown(self) -> None:
        """Stop the thread; sequences still pending get a final error delta."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self._mask_pool.shutdown(wait=False)

    def submit(self, request: GenerationRequest) -> None:
        """Queue one sequence (see :meth:`submit_all`)."""
        self.submit_all([request])

    def check_admission(self, num_seqs: int, num_tokens: int) -> None:
        """Raise EngineOverloaded/EngineDead as :meth:`submit_all` would, without queueing anything."""
        self._admission.check(num_seqs, num_tokens)

    def submit_all(self, requests: list[GenerationRequest]) -> None:
        """Queue all sequences of one API request, or none of them.

        Deltas arrive through each ``request.sink`` (called on the engine thread).

        Raises:
            EngineOverloaded: the waiting queue has no room for all of them (``retry_after`` s).
            EngineDead: the engine thread has stopped.
        """
        if not requests:
            return

        def enqueue() -> None:
            for request in requests:
                self._inbox.put(("add", request))

        self._admission.reserve([len(r.prompt_token_ids) for r in requests], enqueue)
        self._wake.set()

    def abort(self, request_id: str) -> None:
        """Drop every sequence of ``request_id`` within one step (e.g. the client went away)."""
        self._inbox.put(("abort", request_id))
        self._wake.set()

    @property
    def alive(self) -> bool:
        """The engine thread is running and has not crashed."""
        thread = self._thread
        return thread is not None and thread.is_alive() and self._error is None and not self._stop.is_set()

    @property
    def error(self) -> BaseException | None:
        """What killed the engine thread (None while it lives or after a clean shutdown)."""
        return self._error

    @property
    def num_running(self) -> int:
        """Sequences in the running batch."""
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        """Sequences submitted but not yet running (including those not yet seen by the thread)."""
        return self._admission.waiting_seqs

    @property
    def waiting_tokens(self) -> int:
        """Prompt tokens of the waiting sequences."""
        return self._admission.waiting_tokens

    @property
    def kv_usage(self) -> float:
        """Fraction of the KV cache's blocks held by running sequences."""
        return self.blocks.usage

    # ------------------------------------------------------------------ engine thread

    def _loop(self) -> None:
        try:
            self._run()
        except BaseException as exc:  # anything that ends the thread must be visible
            self._error = exc
            log.critical("engine thread died", exc_info=exc)
        finally:
            self._close()

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self.scheduler.running and not self.scheduler.waiting and self._inbox.empty():
                self._wake.wait(timeout=0.5)
                self._wake.clear()
            else:
                try:
                    self.step()
                except Exception as exc:  # a bug in the step itself: only the running batch pays
                    log.exception("engine step failed")
                    self.stats.failed_steps += 1
                    self._fail_running(f"engine step failed: {_describe(exc)}")
            self.last_step_at = time.monotonic()

    def _close(self) -> None:
        """The thread ends: refuse new work, give every pending sequence a final error delta."""
        reason = f"engine stopped: {_describe(self._error)}" if self._error else "engine shut down"
        try:
            self._admission.close(reason)
            self._fail_running(reason)
            waiting, self.scheduler.waiting = self.scheduler.waiting, []
            for seq in waiting:
                self._fail(seq, reason)
                self._deliver(seq)
                seq.row.release()
            for request in self._pending_adds():
                _send_quietly(request, error_delta(request, reason))
        except BaseException:
            log.exception("closing the engine failed")

    def _pending_adds(self) -> list[GenerationRequest]:
        requests = []
        while True:
            try:
                kind, payload = self._inbox.get_nowait()
            except queue.Empty:
                return requests
            if kind == "add":
                requests.append(payload)

    @torch.inference_mode()
    def step(self) -> None:
        """One step: schedule, launch the forward, read the previous step's tokens while the
        device computes (overlapped loop; the synchronous loop has read them already), fill the
        masks, sample (the ids stay on the device), then report and retire."""
        self._drain_inbox()
        self._admit()
        if self._inflight is not None and self._needs_tokens_first():
            self._process_inflight()
        if not self.scheduler.running:
            self._process_inflight()
            self._report_and_retire()
            return
        self.stats.steps += 1
        decode_rows, extend_plan = self._plan_drafts(*self.scheduler.schedule())
        scoring = self._plan_scoring()
        candidates = decode_rows + [seq for seq, take in extend_plan if take == len(seq.pending) and not seq.scoring]
        # matchers are current unless a pass is in flight: then the fill waits for its tokens
        fill = None if self._inflight is not None else self._start_mask_fill(candidates)
        try:
            try:
                logits = self._forward(decode_rows, extend_plan, scoring)
            finally:
                self._free_branches(scoring)
        except Exception as exc:
            _wait_quietly(fill[0] if fill else None)  # its matchers must be idle before anyone touches them again
            self._process_inflight()  # the previous step's tokens are good
            failed = decode_rows + [seq for seq, _ in extend_plan] + [seq for seq, _ in scoring]
            self._fail_batch(failed, f"model forward failed: {_describe(exc)}")
            self._report_and_retire()
            return
        sampled = candidates
        if self._inflight is not None:
            self._process_inflight()  # overlapped: the device runs this step's forward meanwhile
            # a row whose last token ended it, or was followed by forced or replaced tokens, has
            # logits at a position it no longer samples from
            sampled = [seq for seq in candidates if not seq.finished and not seq.pending]
            fill = self._start_mask_fill(sampled)
        bitmask, indices = self._finish_mask_fill(fill, sampled)
        if logits is not None and sampled:
            if len(sampled) < len(candidates):
                logits = self._select_rows(logits, candidates, sampled)
            self._sample(logits, sampled, bitmask, indices)
        drafting = [(seq, len(seq.output_ids)) for seq in sampled if seq.verify]
        if not self.overlap or drafting:
            self._process_inflight()
        self._verify_drafts(drafting)
        self._finish_scoring([seq for seq, _ in scoring])
        self._report_and_retire()

    def flush(self) -> None:
        """Read the tokens of a pass still in flight and report them (benchmarks, shutdown)."""
        with torch.inference_mode():
            self._process_inflight()
            self._report_and_retire()

    def _needs_tokens_first(self) -> bool:
        """Whether this step's inputs depend on the in-flight tokens on the host: draft
        proposals continue from them (the synchronous loop always reads them first)."""
        return not self.overlap or any(seq.draft is not None for seq in self.scheduler.running)

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, payload = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                self._add(payload)
            else:
                self._abort(payload)

    def _add(self, request: GenerationRequest) -> None:
        try:
            seq = self._new_sequence(request)
        except Exception as exc:
            log.warning("sequence of %s could not start: %s", request.request_id, _describe(exc))
            self.stats.failed_sequences += 1
            self._admission.dropped(len(request.prompt_token_ids))
            _send_quietly(request, error_delta(request, f"sequence could not start: {_describe(exc)}"))
            return
        self.scheduler.waiting.append(seq)

    def _new_sequence(self, request: GenerationRequest) -> Sequence:
        lora = self.runner.lora
        if request.adapter and (lora is None or not 0 < request.adapter <= len(lora.adapters)):
            raise ValueError(f"LoRA adapter id {request.adapter} is not loaded")
        row = self.sampler.new_row(request.params, request.prompt_token_ids)
        if request.token_dfa is not None and request.reasoning is None:
            row.attach_dfa(request.token_dfa)
        seq = Sequence(
            request=request,
            row=row,
            detokenizer=IncrementalDetokenizer(
                self.tokenizer, request.skip_special_tokens, request.spaces_between_special_tokens
            ),
            stops=StopStringMatcher(request.stop, request.include_stop_str_in_output, request.stop_regex),
            pending=list(request.prompt_token_ids),
            matcher=request.matcher if request.reasoning is None else None,
            reasoning=request.reasoning,
            table=BlockTable(salt=request.adapter),
        )
        if seq.reasoning is not None:
            self._enter_reasoning(seq)
        if request.prediction_token_ids:
            seq.draft = Draft(request.prediction_token_ids)
        if request.score_choices:
            self._start_scoring(seq)
        return seq

    def _abort(self, request_id: str) -> None:
        for seq in self.scheduler.waiting + self.scheduler.running:
            if seq.request.request_id == request_id:
                seq.aborted = True
                seq.finish("abort")
        waiting = self.scheduler.waiting
        self.scheduler.waiting = [s for s in waiting if not s.aborted]
        for seq in waiting:
            if seq.aborted:  # running ones are reported and freed at the end of the step
                self._admission.dropped(len(seq.request.prompt_token_ids))
                self._deliver(seq)
                seq.row.release()

    def _admit(self) -> None:
        admitted, too_long = self.scheduler.admit()
        self._admission.admitted(admitted)
        for seq in too_long:
            self._admission.dropped(len(seq.request.prompt_token_ids))
            self._fail(seq, f"the sequence needs {len(seq.pending)} tokens of KV cache, more than the "
                            f"whole cache holds ({self.blocks.capacity_tokens})")
            self._deliver(seq)
            seq.row.release()

    def _forward(self, decode_rows, extend_plan, scoring=()) -> torch.Tensor | None:
        """One model pass over every scheduled row; logits [R, V] for the rows that get a token
        this step (decode rows, then extensions whose pending tokens are all fed). Rows that
        verify a draft keep their per-position logits in ``seq.verify_logits``; choice-scoring
        rows are scored on the spot."""
        rows = [(seq.table.blocks, seq.pending[:1], seq.cached_len) for seq in decode_rows]
        rows += [(seq.table.blocks, seq.pending[:take] + seq.verify, seq.cached_len) for seq, take in extend_plan]
        rows += self._scoring_rows(scoring)
        if not rows:
            return None
        counts = [1] * len(decode_rows) + [1 + len(seq.verify) for seq, _ in extend_plan]
        counts += [len(new) for _, new, _ in rows[len(counts) :]]
        started = time.perf_counter()
        adapters = [seq.request.adapter for seq in decode_rows] + [seq.request.adapter for seq, _ in extend_plan]
        adapters += [seq.request.adapter for seq, choices in scoring for _ in choices]
        batch = StepBatch.build(rows, self.runner.block_size, self.runner.device,
                                logit_counts=counts if max(counts) > 1 else None, row_adapters=adapters,
                                staging=self._step_staging)
        self._gather_sampled(decode_rows, extend_plan, batch)
        logits = self.runner.forward(batch)
        self.stats.forward_s += time.perf_counter() - started
        first_rows = None  # with per-position logits: each row's first position
        if batch.logit_counts is not None:
            logits, first_rows = self._split_logits(logits, counts, extend_plan, scoring, len(decode_rows))
        for seq in decode_rows:
            seq.table.commit(seq.pending[:1])
            seq.pending.clear()
        self.stats.decode_tokens += len(decode_rows)
        complete = list(range(len(decode_rows)))
        for i, (seq, take) in enumerate(extend_plan):
            seq.table.commit(seq.pending[:take] + seq.verify)
            del seq.pending[:take]
            self.stats.extend_tokens += take
            if not seq.pending and not seq.scoring:
                complete.append(len(decode_rows) + i)
        self._step_hidden = None
        if len(complete) == len(decode_rows) + len(extend_plan) == logits.shape[0]:
            self._keep_hidden(decode_rows, extend_plan, first_rows, None)
            return logits
        if not complete:
            return None
        keep = to_device(complete, torch.long, logits.device)
        self._keep_hidden(decode_rows, extend_plan, first_rows, keep)
        return logits[keep]

    def _gather_sampled(self, decode_rows, extend_plan, batch: StepBatch) -> None:
        """Rows fed the token sampled last step take it from the device (overlapped loop):
        they are decode rows, so row i's token is token i of the batch."""
        inflight = self._inflight
        if inflight is None:
            return
        positions, rows = [], []
        for i, seq in enumerate(decode_rows):
            if seq.pending[0] == SAMPLED:
                positions.append(i)
                rows.append(inflight.row_of(seq))
        if any(SAMPLED in seq.pending[:take] for seq, take in extend_plan):
            raise RuntimeError("a sampled token still on the device was scheduled in an extension")
        if positions:
            inflight.gather_into(batch.tokens, positions, rows)

    def _keep_hidden(self, decode_rows, extend_plan, first_rows, keep: torch.Tensor | None) -> None:
        """The sampled rows' last-layer hidden states of this forward, when a sequence asks for them."""
        if any(s.request.return_hidden_states for s in decode_rows) or any(
            s.request.return_hidden_states for s, _ in extend_plan
        ):
            hidden = self.runner.last_hidden
            hidden = hidden if first_rows is None else hidden[first_rows]
            self._step_hidden = hidden if keep is None else hidden[keep]

    def _select_rows(self, logits: torch.Tensor, candidates: list[Sequence], sampled: list[Sequence]) -> torch.Tensor:
        """The logits (and hidden states) of ``sampled``, a subsequence of ``candidates``."""
        position = {id(seq): i for i, seq in enumerate(candidates)}
        index = to_device([position[id(seq)] for seq in sampled], torch.long, logits.device)
        if self._step_hidden is not None:
            self._step_hidden = self._step_hidden.index_select(0, index)
        return logits.index_select(0, index)

    def _sample(self, logits: torch.Tensor, sampled: list[Sequence], bitmask, indices) -> None:
        """Queue the sampler pass over ``sampled``: each row's next token stays on the device
        (:data:`SAMPLED` in its pending tokens) until :meth:`_process_inflight` reads it."""
        started = time.perf_counter()
        try:
            pending = self._run_sampler(logits, [s.row for s in sampled], bitmask, indices)
        except Exception as exc:
            self._fail_batch(sampled, f"sampler failed: {_describe(exc)}")
            return
        event = device_event(self.runner)
        event.record()
        hidden_rows = [i for i, seq in enumerate(sampled) if seq.request.return_hidden_states]
        hidden = self._step_hidden
        if hidden is not None and hidden_rows:  # a copy: a graph's buffer is overwritten next step
            hidden = hidden.index_select(0, to_device(hidden_rows, torch.long, hidden.device))
        for seq in sampled:
            seq.pending = [SAMPLED]
        self._inflight = InFlight(sampled, pending, event, hidden if hidden_rows else None, hidden_rows)
        self.stats.sample_s += time.perf_counter() - started

    def _process_inflight(self) -> None:
        """Read the in-flight pass's tokens and take each into its sequence (matcher, stops,
        detokenizer, forced tokens); nothing when no pass is in flight."""
        inflight, self._inflight = self._inflight, None
        if inflight is None:
            return
        try:
            result = inflight.wait()
            hidden = inflight.hidden_lists()
        except Exception as exc:
            for seq in inflight.seqs:
                resolve(seq, 0)  # the placeholder must not stay in the cache's token record
            self._fail_batch(inflight.seqs, f"sampler failed: {_describe(exc)}")
            return
        for i, message in result.failures.items():  # a row's own processing failed (client code)
            self._fail(inflight.seqs[i], message)
        for i, (seq, token, logprob) in enumerate(zip(inflight.seqs, result.token_ids, result.logprobs)):
            fed = resolve(seq, token)
            if i in hidden and not seq.finished:
                seq.step_hidden.append(hidden[i])
            self._accept_sampled(seq, token, logprob, fed)

    def _run_sampler(self, logits: torch.Tensor, rows, bitmask, indices) -> PendingSample:
        """The in-graph sampling pass when the runner has one and every row qualifies, else the
        eager sampler (same tokens for greedy rows, same distributions for the others)."""
        pending = None
        if self._graph_sampler is not None:
            pending = self._graph_sampler.sample_async(logits, rows, bitmask, indices)
        if pending is not None:
            self.stats.sampled_in_graph += 1
            return pending
        self.stats.sampled_eagerly += 1
        return self.sampler.sample_async(logits, rows, bitmask, indices)

    # ------------------------------------------------------------------ predicted outputs

    def _plan_drafts(self, decode_rows, extend_plan):
        """Give rows that follow a prediction their next draft tokens (``seq.verify``), fed after
        their pending tokens; a decoding row with a draft becomes a one-token extension.
        Draft tokens share the step's prefill budget."""
        budget = self.prefill_budget - sum(take for _, take in extend_plan)
        for seq, take in [(seq, 1) for seq in decode_rows] + extend_plan:
            if seq.draft is None or take != len(seq.pending) or seq.scoring or budget <= 0:
                continue
            seq.verify = seq.draft.proposal(self._draft_room(seq, budget))
            if seq.verify and not self.scheduler.grow(seq, seq.cached_len + take + len(seq.verify)):
                seq.verify = []  # no free block for the draft: plain decoding this step
            budget -= len(seq.verify)
        if not any(seq.verify for seq in decode_rows):
            return decode_rows, extend_plan
        drafting = [(seq, 1) for seq in decode_rows if seq.verify]
        return [seq for seq in decode_rows if not seq.verify], extend_plan + drafting

    def _draft_room(self, seq: Sequence, budget: int) -> int:
        """How many draft tokens ``seq`` may verify now: the per-step cap, the budget, the
        tokens it may still emit (one is the token sampled after the draft) and the cache."""
        emitted = len(seq.request.prompt_token_ids) + len(seq.output_ids)
        return min(
            self.max_draft_tokens,
            budget,
            seq.request.max_tokens - len(seq.output_ids) - 1,
            self.max_model_len - emitted - 1,
        )

    def _verify_drafts(self, drafting: list[tuple[Sequence, int]]) -> None:
        """Sample the positions after each fed draft token in rounds (one batched sampler pass per
        position, over the rows still agreeing), then roll the cache back past the first
        disagreement. ``drafting``: (sequence, its output length before this step's sampling).

        Each position is sampled exactly as without a draft (same processing, same RNG stream),
        and a draft token counts only if the sampled token equals it, so the output is the one
        the row would produce without a prediction."""
        if not drafting:
            return
        used = {id(seq): 0 for seq, _ in drafting}
        active, position = drafting, 0
        while active:
            agreeing = []
            for seq, mark in active:
                if not _sampled_draft_token(seq, mark, position):
                    continue
                used[id(seq)] = position + 1
                if seq.finished:
                    continue
                seq.pending.pop(0)  # the draft token's keys/values are already cached
                if not seq.pending:  # nothing forced after it: sample the next position
                    agreeing.append((seq, mark))
            if agreeing:
                self._sample_draft_position([seq for seq, _ in agreeing], position)
            active, position = agreeing, position + 1
        for seq, _ in drafting:
            kept = used[id(seq)]
            seq.table.truncate(seq.cached_len - (len(seq.verify) - kept))
            seq.draft.settle(len(seq.verify), kept)
            self.stats.draft_tokens += len(seq.verify)
            self.stats.accepted_draft_tokens += kept
            seq.verify, seq.verify_logits = [], None

    def _sample_draft_position(self, seqs: list[Sequence], position: int) -> None:
        """One sampler pass over the logits after draft token ``position`` of each row."""
        logits = torch.stack([seq.verify_logits[position] for seq in seqs])
        bitmask, indices = self._finish_mask_fill(self._start_mask_fill(seqs), seqs)
        hidden, self._step_hidden = self._step_hidden, None  # no forward of its own: no hidden states
        try:
            self._sample(logits, seqs, bitmask, indices)
            self._process_inflight()
        finally:
            self._step_hidden = hidden

    def _split_logits(self, logits, counts, extend_plan, scoring, n_decode) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-position logits [sum(counts), V] → one row per decode/extension row (its first
        position); the rest go to ``seq.verify_logits`` and to choice scoring."""
        starts = [0]
        for count in counts[:-1]:
            starts.append(starts[-1] + count)
        for i, (seq, _) in enumerate(extend_plan):
            if seq.verify:
                start = starts[n_decode + i]
                seq.verify_logits = logits[start + 1 : start + 1 + len(seq.verify)]
        row = n_decode + len(extend_plan)
        for seq, choices in scoring:
            for choice, _slot in choices:
                self._score_choice(seq, choice, logits[starts[row] : starts[row] + counts[row]])
                row += 1
        first = to_device(starts[: n_decode + len(extend_plan)], torch.long, logits.device)
        return logits[first], first

    # ------------------------------------------------------------------ choice scoring

    def _start_scoring(self, seq: Sequence) -> None:
        """Hold back the prompt's last token: each choice is fed after it from a copy of the
        prompt's cache, so its logits score the choice's first token."""
        if not seq.request.prompt_token_ids:
            raise ValueError("scoring choices needs a non-empty prompt")
        seq.scoring = True
        seq.pending = seq.pending[:-1]
        seq.choice_scores = [None] * len(seq.request.score_choices)
        seq.choice_token_logprobs = [None] * len(seq.request.score_choices)

    def _plan_scoring(self) -> list[tuple[Sequence, list[tuple[int, BlockTable]]]]:
        """(sequence, [(choice, branch)]) for sequences whose prompt is cached: each unscored
        choice runs in a branch of the sequence's blocks (full blocks shared, the last one
        copied); choices that find no free blocks wait for the next step."""
        plan = []
        for seq in self.scheduler.running:
            if not seq.scoring or seq.pending or seq.finished:
                continue
            branches = []
            for choice, score in enumerate(seq.choice_scores):
                if score is not None:
                    continue
                fork = self.blocks.fork(seq.table, 1 + len(seq.request.score_choices[choice]))
                if fork is None:
                    break
                branch, copy = fork
                if copy is not None:
                    self.runner.copy_blocks([copy])
                branches.append((choice, branch))
            if branches:
                plan.append((seq, branches))
            elif len(self.scheduler.running) == 1:
                self._fail(seq, "a choice does not fit in the KV cache")
        return plan

    def _scoring_rows(self, scoring) -> list[tuple[list[int], list[int], int]]:
        rows = []
        for seq, choices in scoring:
            last_prompt_token = seq.request.prompt_token_ids[-1]
            for choice, branch in choices:
                rows.append((branch.blocks, [last_prompt_token, *seq.request.score_choices[choice]], seq.cached_len))
        return rows

    def _free_branches(self, scoring) -> None:
        for _, choices in scoring:
            for _, branch in choices:
                self.blocks.free(branch)

    def _score_choice(self, seq: Sequence, choice: int, logits: torch.Tensor) -> None:
        """Sum of the choice's token logprobs (raw model distribution), from the logits at the
        prompt's last token and after each of the choice's tokens but the last."""
        tokens = seq.request.score_choices[choice]
        logprobs = logits[: len(tokens), : self.sampler.vocab_size].float().log_softmax(dim=-1)
        ids = to_device(tokens, torch.long, logprobs.device)
        chosen = logprobs.gather(1, ids.view(-1, 1)).view(-1)
        top_n = min(seq.request.params.top_logprobs, logprobs.shape[1])
        pieces = [chosen.sum().view(1), chosen]
        if top_n:
            values, indices = logprobs.topk(top_n, dim=-1)
            pieces += [values.flatten(), indices.flatten()]
        # one read-back: float64 holds every float32 value and token id exactly
        host = torch.cat([piece.double() for piece in pieces]).cpu()
        n = len(tokens)
        seq.choice_scores[choice] = float(host[0])
        self.stats.scored_choices += 1
        top = [[]] * n
        if top_n:
            values_host = host[1 + n : 1 + n + n * top_n].view(n, top_n).tolist()
            indices_host = host[1 + n + n * top_n :].view(n, top_n).long().tolist()
            top = [list(zip(i, v)) for i, v in zip(indices_host, values_host)]
        seq.choice_token_logprobs[choice] = [
            TokenLogprobs(token, value, alternatives)
            for token, value, alternatives in zip(tokens, host[1 : 1 + n].tolist(), top)
        ]

    def _finish_scoring(self, seqs: list[Sequence]) -> None:
        """Sequences with every choice scored: normalise, pick one, emit its tokens."""
        for seq in seqs:
            if seq.finished or any(score is None for score in seq.choice_scores):
                continue
            seq.scoring = False
            scores = torch.tensor(seq.choice_scores, dtype=torch.float64)
            seq.choice_logprobs = scores.log_softmax(dim=0).tolist()
            try:
                self._emit_choice(seq, self._pick_choice(seq, scores))
            except SequenceFailed as exc:
                self._fail(seq, str(exc), replace_finish=True)

    @staticmethod
    def _pick_choice(seq: Sequence, scores: torch.Tensor) -> int:
        """Greedy: the most probable choice; sampling: a draw from the choices' distribution at the
        row's temperature, with one uniform from the row's seeded RNG."""
        params = seq.request.params
        if params.greedy:
            return int(scores.argmax())
        probs = (scores / params.temperature).softmax(dim=0)
        cumulative = probs.cumsum(dim=0)
        return min(int((cumulative < seq.row.rng.random()).sum()), len(probs) - 1)

    def _emit_choice(self, seq: Sequence, choice: int) -> None:
        """Append the choice's tokens (through the constraint matcher) and finish."""
        matcher = seq.matcher
        want_logprobs = seq.request.params.logprobs
        for entry in seq.choice_token_logprobs[choice]:
            if matcher is not None and not _guarded("constraint matcher", matcher.accept_token, entry.token_id):
                raise SequenceFailed(f"constraint rejected choice token {entry.token_id}")
            if self._append(seq, entry.token_id, entry if want_logprobs else None):
                return
        seq.step_text.append(self._feed_stops(seq, _guarded("detokenizer", seq.detokenizer.flush))[0])
        seq.finish("stop")

    # ------------------------------------------------------------------ constraints

    def _start_mask_fill(self, sampled: list[Sequence]) -> tuple[Future, list[int]] | None:
        """Fill the bitmasks of the rows of ``sampled`` whose mask the host computes, on the
        mask thread, into a staging buffer (pinned and reused on CUDA): the row indices [M]
        int64, then the bitmask [M, W] int32. Returns the fill and those rows."""
        rows = [i for i, seq in enumerate(sampled) if _needs_host_mask(seq)]
        if not rows:
            return None
        masked = [sampled[i] for i in rows]
        host = self._mask_staging.buffer(8 * len(rows) + 4 * len(rows) * self._words)
        host[: 8 * len(rows)].view(torch.int64).copy_(torch.tensor(rows, dtype=torch.int64))
        bitmask = host[8 * len(rows) :].view(torch.int32).view(len(rows), self._words)
        matchers = [seq.matcher for seq in masked]

        @torch.inference_mode()  # the buffer was made in the step's inference mode
        def fill() -> tuple[torch.Tensor, dict[int, str]]:
            started = time.perf_counter()
            # batched and parallel per backend; the empty-mask check is here, so it overlaps the forward
            failures = fill_bitmasks(
                matchers, bitmask, max_threads=self.mask_fill_threads, valid_bits=self._valid_bits
            )
            self.stats.mask_fill_s += time.perf_counter() - started
            return host, failures

        return self._mask_pool.submit(fill), rows

    def _finish_mask_fill(self, fill: tuple[Future, list[int]] | None, sampled: list[Sequence]):
        """Wait for the bitmask and fail the rows whose matcher raised or allows nothing;
        returns (bitmask [M, W] int32, row indices [M] int64) on the model's device, both views
        of one non-blocking copy from the staging buffer (none on the CPU)."""
        if fill is None:
            return None, None
        future, masked = fill
        host, failures = future.result()
        for i, message in failures.items():
            self._fail(sampled[masked[i]], message)
        staged = self._mask_staging.upload(host)
        rows = len(masked)
        return staged[8 * rows :].view(torch.int32).view(rows, self._words), staged[: 8 * rows].view(torch.int64)

    # ------------------------------------------------------------------ tokens

    def _accept_sampled(self, seq: Sequence, token: int, logprob: TokenLogprobs | None, fed: bool) -> None:
        """Take a sampled token into ``seq``; ``fed``: the overlapped loop already fed it."""
        if seq.finished:
            return
        try:
            self._take_sampled(seq, token, logprob, fed)
        except SequenceFailed as exc:  # its output of this step is incomplete, whatever it finished with
            self._fail(seq, str(exc), replace_finish=True)
        except Exception as exc:
            log.exception("sequence of %s failed", seq.request.request_id)
            self._fail(seq, f"internal error: {_describe(exc)}", replace_finish=True)

    def _take_sampled(self, seq: Sequence, token: int, logprob: TokenLogprobs | None, fed: bool) -> None:
        if seq.reasoning is not None:
            self._take_reasoning(seq, token, logprob, fed)
            return
        matcher = seq.matcher
        sampled = token
        if getattr(matcher, "close_on_length", False):
            token, logprob = self._accept_closing(seq, token, logprob)
        elif matcher is not None and not _guarded("constraint matcher", matcher.accept_token, token):
            token = -1
        if token < 0:
            self._fail(seq, f"constraint rejected sampled token {sampled}")
            return
        if matcher is not None and getattr(matcher, "error", None):  # a parser limit: not a real stop
            raise SequenceFailed(f"{CONSTRAINT_LIMIT}: {matcher.error}")
        if self._append(seq, token, logprob):
            return
        if token != sampled:  # steered (close_on_length): the model is fed what was taken
            unfeed(seq, sampled, fed)
            seq.pending.insert(0, token)
        # Forced tokens come from no forward, so they would have no hidden state of their own.
        if matcher is not None and self.jump_forward and not seq.request.return_hidden_states:
            self._jump_forward(seq)

    def _jump_forward(self, seq: Sequence) -> None:
        """Append the tokens the automaton forces; they are fed to the model in one extension."""
        matcher = seq.matcher
        room = seq.request.max_tokens - len(seq.output_ids)
        forced = _guarded("constraint matcher", matcher.forced_tokens)[: max(room - 1, 0)]
        for token in forced:
            if getattr(matcher, "close_on_length", False):
                taken, forced_logprob = self._accept_closing(seq, token, _forced_logprob(seq, token))
            else:
                taken = token if _guarded("constraint matcher", matcher.accept_token, token) else -1
                forced_logprob = _forced_logprob(seq, token)
            if taken < 0:
                break
            self.stats.forced_tokens += 1
            if self._append(seq, taken, forced_logprob):
                return
            seq.pending.append(taken)
            if taken != token:  # steered off the forced text: the rest no longer follows
                return

    def _accept_closing(self, seq: Sequence, token: int, logprob: TokenLogprobs | None) -> tuple[int, TokenLogprobs | None]:
        """Accept ``token`` when the output can still close within the budget after it, else
        the next token of the completion planned before it (close_on_length); returns the token
        taken (-1: rejected) and its logprob. ``seq.closing`` keeps a completion from the
        current state that fits the budget left."""
        matcher = seq.matcher
        room = self._room(seq)
        plan = seq.closing if seq.closing is not None else _guarded("constraint matcher", matcher.shortest_completion, room)
        if plan is not None and plan[:1] == [token]:
            seq.closing = plan[1:] if _guarded("constraint matcher", matcher.accept_token, token) else None
            return (token if seq.closing is not None else -1), logprob
        if not _guarded("constraint matcher", matcher.accept_token, token):
            return -1, logprob
        after = [] if matcher.is_terminated() else _guarded("constraint matcher", matcher.shortest_completion, room - 1)
        if after is not None or plan is None:
            seq.closing = after
            return token, logprob
        matcher.rollback(1)  # no way to close after it within the budget: steer into the plan
        self.stats.closing_steered += 1
        planned = plan[0] if plan else matcher.ctx.stop_token_ids[0]
        if not _guarded("constraint matcher", matcher.accept_token, planned):
            return -1, logprob
        seq.closing = plan[1:]
        return planned, _forced_logprob(seq, planned)

    def _room(self, seq: Sequence) -> int:
        """Tokens the sequence may still add before its budget or the context ends it."""
        used = len(seq.output_ids)
        return min(seq.request.max_tokens - used, self.max_model_len - len(seq.request.prompt_token_ids) - used)

    # ------------------------------------------------------------------ reasoning

    def _enter_reasoning(self, seq: Sequence) -> None:
        """A new sequence starts inside its reasoning segment: open it where the prompt did not."""
        phase = seq.reasoning
        seq.reasoning = None  # forced markers are not reasoning tokens
        if self._force(seq, phase.start_ids):
            return
        seq.reasoning = phase
        if phase.budget == 0:
            self._end_reasoning(seq, force_end=True)

    def _take_reasoning(self, seq: Sequence, token: int, logprob: TokenLogprobs | None, fed: bool) -> None:
        """A token sampled inside the reasoning segment: the constraint is not consulted."""
        request = seq.request
        if request.matcher is not None and token in request.eos_token_ids and not request.ignore_eos:
            unfeed(seq, token, fed)  # the answer is still owed: end the reasoning instead of the sequence
            self._end_reasoning(seq, force_end=True)
            return
        if self._append(seq, token, logprob):
            return
        phase = seq.reasoning
        if seq.output_ids[-len(phase.end_ids):] == list(phase.end_ids) or self._wrote_end_text(seq, phase):
            self._end_reasoning(seq, force_end=False)
            return
        seq.reasoning_tokens += 1
        if phase.budget is not None and seq.reasoning_tokens >= phase.budget:
            self._end_reasoning(seq, force_end=True)

    def _wrote_end_text(self, seq: Sequence, phase: ReasoningPhase) -> bool:
        """Whether the last token completed the end marker's text (a marker split over tokens,
        whichever tokens the model wrote it in). Every token decodes to at least one character,
        so the marker lies within the last ``len(end_text)`` tokens."""
        if not phase.end_text:
            return False
        window = seq.output_ids[-len(phase.end_text) - 1 :]

        def text(ids: list[int]) -> str:
            return _guarded("detokenizer", lambda: self.tokenizer.decode(ids, skip_special_tokens=False)) or ""

        return phase.end_text in text(window) and phase.end_text not in text(window[:-1])

    def _end_reasoning(self, seq: Sequence, *, force_end: bool) -> None:
        """Leave the segment (forcing its end marker when the model did not write it), force the
        answer's prefix, then hand the sequence to its constraint, fresh from its first state."""
        phase, seq.reasoning = seq.reasoning, None
        forced = (phase.end_ids if force_end else ()) + phase.answer_prefix_ids
        if self._force(seq, forced):
            return
        request = seq.request
        seq.matcher = request.matcher
        if request.token_dfa is not None:
            seq.row.attach_dfa(request.token_dfa)
        if seq.matcher is not None and self.jump_forward:
            self._jump_forward(seq)

    def _force(self, seq: Sequence, tokens: tuple[int, ...]) -> bool:
        """Append ``tokens`` unsampled (fed to the model with the next extension); True when the
        sequence finished on one of them."""
        for token in tokens:
            self.stats.forced_tokens += 1
            if self._append(seq, token, _forced_logprob(seq, token)):
                return True
            seq.pending.append(token)
        return False

    def _append(self, seq: Sequence, token: int, logprob: TokenLogprobs | None) -> bool:
        """Add one token to the output; returns True when it finished the sequence."""
        request = seq.request
        if seq.draft is not None:
            seq.draft.observe(token)
        seq.output_ids.append(token)
        seq.row.append_token(token)
        seq.step_tokens.append(token)
        if logprob is not None:
            seq.step_logprobs.append(logprob)
        matcher = seq.matcher
        if token in request.stop_token_ids:
            seq.finish("stop", token)
        elif token in request.eos_token_ids and not request.ignore_eos:
            seq.finish("stop")
            seq.eos_hit = token
        elif matcher is not None and _guarded("constraint matcher", matcher.is_terminated):
            seq.finish("stop")
            seq.eos_hit = token if token in request.eos_token_ids else None
        if seq.finished:
            seq.step_text.append(self._feed_stops(seq, _guarded("detokenizer", seq.detokenizer.flush))[0])
            return True
        text, hit = self._feed_stops(seq, _guarded("detokenizer", seq.detokenizer.push, [token]))
        seq.step_text.append(text)
        if hit is not None:
            seq.finish("stop", hit)
        elif len(seq.output_ids) >= request.max_tokens or self._at_context_limit(seq):
            seq.step_text.append(self._feed_stops(seq, _guarded("detokenizer", seq.detokenizer.flush))[0])
            seq.finish("length")
        return seq.finished

    @staticmethod
    def _feed_stops(seq: Sequence, text: str) -> tuple[str, str | None]:
        return _guarded("stop-string matching", seq.stops.feed, text)

    def _at_context_limit(self, seq: Sequence) -> bool:
        return len(seq.request.prompt_token_ids) + len(seq.output_ids) >= self.max_model_len

    # ------------------------------------------------------------------ failures

    def _fail(self, seq: Sequence, message: str, *, replace_finish: bool = False) -> None:
        """End ``seq`` with finish_reason "error" (reported and freed at the end of the step).

        A sequence already finished keeps its finish unless ``replace_finish`` (and it was
        neither aborted nor reported yet)."""
        if seq.closed or seq.aborted or seq.finish_reason == "error":
            return
        if seq.finished and not replace_finish:
            return
        log.warning("sequence of %s failed: %s", seq.request.request_id, message)
        self.stats.failed_sequences += 1
        seq.fail(message)

    def _fail_batch(self, seqs: list[Sequence], message: str) -> None:
        log.error("batch of %d sequences failed: %s", len(seqs), message)
        self.stats.failed_batches += 1
        for seq in seqs:
            self._fail(seq, message)

    def _fail_running(self, message: str) -> None:
        """Fail and free every running sequence without touching the KV cache (it may be what broke)."""
        self._inflight = None
        for seq in self.scheduler.release_all():
            self._fail(seq, message)
            self._deliver(seq)
            seq.row.release()

    # ------------------------------------------------------------------ reporting

    def _report_and_retire(self) -> None:
        """Report the step's deltas and free the finished sequences (in the overlapped loop this
        runs while the device computes the step just launched)."""
        for seq in self.scheduler.running:
            if seq.step_tokens or seq.finished:
                self._deliver(seq)
            self.blocks.register_full_blocks(seq.table)
        for seq in [s for s in self.scheduler.running if s.finished]:
            self._release(seq)
        if self.overlap and self.scheduler.waiting:
            self._report_preempted()

    def _report_preempted(self) -> None:
        """Sequences preempted while their last token was in flight took it afterwards."""
        for seq in self.scheduler.waiting:
            if seq.admitted and (seq.step_tokens or seq.finished):
                self._deliver(seq)
        done = [seq for seq in self.scheduler.waiting if seq.finished and seq.admitted]
        for seq in done:
            self.scheduler.waiting.remove(seq)
            seq.row.release()

    def _deliver(self, seq: Sequence) -> None:
        """Send the step's delta; a sink that raises fails only its own sequence."""
        if seq.closed:
            return
        seq.closed = seq.finished
        try:
            seq.request.sink(seq.take_delta())
        except Exception as exc:
            log.warning("delivering output of %s failed: %s", seq.request.request_id, _describe(exc))
            if not seq.finished:
                self._fail(seq, f"output sink failed: {_describe(exc)}")
                seq.closed = True
                _send_quietly(seq.request, seq.take_delta())  # one last try: it may have been transient

    def _release(self, seq: Sequence) -> None:
        """Free ``seq``'s blocks (its full ones stay in the prefix cache) and sampler row."""
        self.scheduler.release(seq)
        seq.row.release()


def _sampled_draft_token(seq: Sequence, mark: int, position: int) -> bool:
    """This step's output token ``position`` (counted from output length ``mark``) exists and is
    the draft token fed at that position."""
    out = seq.output_ids
    index = mark + position
    return position < len(seq.verify) and len(out) > index and out[index] == seq.verify[position]


def _needs_host_mask(seq: Sequence) -> bool:
    """Constrained rows whose mask is not computed on the device by a resident DFA."""
    return seq.matcher is not None and seq.row.dfa is None


def _forced_logprob(seq: Sequence, token: int) -> TokenLogprobs:
    """The logprob entry of a token appended without sampling (certain: 0.0)."""
    return TokenLogprobs(token, 0.0, [(token, 0.0)] * bool(seq.request.params.top_logprobs))


def _valid_bits(vocab_size: int, words: int) -> torch.Tensor:
    """int32 [words]: the bitmask bits that stand for real tokens."""
    valid = torch.full((words,), -1, dtype=torch.int32)
    if vocab_size % 32:
        valid[-1] = (1 << (vocab_size % 32)) - 1
    return valid


def _describe(exc: BaseException | None) -> str:
    return f"{type(exc).__name__}: {exc}"


def _guarded(what: str, fn, *args):
    """``fn(*args)``, with any exception turned into a :class:`SequenceFailed` naming ``what``."""
    try:
        return fn(*args)
    except Exception as exc:
        raise SequenceFailed(f"{what} failed: {_describe(exc)}") from exc


def _wait_quietly(fill: Future | None) -> None:
    if fill is not None:
        try:
            fill.result()
        except Exception:
            log.exception("constraint mask fill failed")


def _send_quietly(request: GenerationRequest, delta: SequenceDelta) -> None:
    try:
        request.sink(delta)
    except Exception:
        log.exception("delivering output of %s failed", request.request_id)
