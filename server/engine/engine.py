"""The batched decoding loop (continuous batching) running in its own thread.

Every step: take new requests and aborts, admit waiting sequences into free KV slots, run one
forward over every sequence's pending tokens (one for decoding sequences, several for prefill
chunks and jump-forward continuations), fill constraint bitmasks on a worker thread while the
forward runs, sample all rows in one sampler pass, then append tokens,
detokenize, check stops and report one delta per sequence. Finished sequences leave the batch at
the end of the step; nothing ever waits for another request to finish.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from sampler import Sampler, TokenLogprobs
from server.engine.detokenizer import IncrementalDetokenizer, StopStringMatcher
from server.engine.model import ModelRunner, StepBatch
from server.engine.sequence import GenerationRequest, Sequence

log = logging.getLogger("trellis.engine")


@dataclass
class EngineStats:
    steps: int = 0
    decode_tokens: int = 0
    extend_tokens: int = 0
    forced_tokens: int = 0
    mask_fill_s: float = 0.0
    forward_s: float = 0.0
    sample_s: float = 0.0


class Engine:
    """Owns the model runner, the sampler and all sequences; thread-safe ``submit``/``abort``."""

    def __init__(
        self,
        runner: ModelRunner,
        tokenizer,
        *,
        max_batch_size: int,
        max_model_len: int,
        prefill_budget: int = 1024,
        jump_forward: bool = True,
    ) -> None:
        self.runner = runner
        self.tokenizer = tokenizer
        self.sampler = Sampler(runner.vocab_size, runner.device)
        self.max_batch_size = max_batch_size
        self.max_model_len = max_model_len
        self.prefill_budget = prefill_budget
        self.jump_forward = jump_forward
        self.stats = EngineStats()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._waiting: list[Sequence] = []
        self._running: list[Sequence] = []  # _running[i].slot == i
        self._mask_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trellis-mask")
        self._words = (runner.vocab_size + 31) // 32
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ public, any thread

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="trellis-engine", daemon=True)
        self._thread.start()

    def shutdown(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self._mask_pool.shutdown(wait=False)

    def submit(self, request: GenerationRequest) -> None:
        """Queue a sequence; its deltas arrive through ``request.sink`` (called on the engine thread)."""
        self._inbox.put(("add", request))
        self._wake.set()

    def abort(self, request_id: str) -> None:
        """Drop every sequence of ``request_id`` within one step (e.g. the client went away)."""
        self._inbox.put(("abort", request_id))
        self._wake.set()

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    # ------------------------------------------------------------------ engine thread

    def _loop(self) -> None:
        while not self._stop.is_set():
            if not self._running and not self._waiting and self._inbox.empty():
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            try:
                self.step()
            except Exception as exc:  # never let one bad step kill the engine
                log.exception("engine step failed")
                self._fail_all(f"engine step failed: {type(exc).__name__}: {exc}")

    @torch.inference_mode()
    def step(self) -> None:
        """Run one scheduling + forward + sampling step."""
        self._drain_inbox()
        self._admit()
        if not self._running:
            return
        self.stats.steps += 1
        decode_rows, extend_plan = self._schedule()
        sampled = decode_rows + [seq for seq, take in extend_plan if take == len(seq.pending)]
        masked = [i for i, seq in enumerate(sampled) if _needs_host_mask(seq)]
        fill = self._start_mask_fill([sampled[i] for i in masked])
        logits = self._forward(decode_rows, extend_plan)
        if logits is not None:
            bitmask, indices = self._finish_mask_fill(fill, masked)
            started = time.perf_counter()
            result = self.sampler.sample(logits, [s.row for s in sampled], bitmask, indices)
            self.stats.sample_s += time.perf_counter() - started
            for seq, token, logprob in zip(sampled, result.token_ids, result.logprobs):
                self._accept_sampled(seq, token, logprob)
        self._report_and_retire()

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, payload = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                self._waiting.append(self._new_sequence(payload))
            else:
                self._abort(payload)

    def _new_sequence(self, request: GenerationRequest) -> Sequence:
        row = self.sampler.new_row(request.params, request.prompt_token_ids)
        if request.token_dfa is not None:
            row.attach_dfa(request.token_dfa)
        return Sequence(
            request=request,
            row=row,
            detokenizer=IncrementalDetokenizer(self.tokenizer, request.skip_special_tokens),
            stops=StopStringMatcher(request.stop, request.include_stop_str_in_output),
            pending=list(request.prompt_token_ids),
        )

    def _abort(self, request_id: str) -> None:
        for seq in self._waiting + self._running:
            if seq.request.request_id == request_id:
                seq.aborted = True
                seq.finish("abort")
        self._waiting = [s for s in self._waiting if not s.aborted]

    def _admit(self) -> None:
        while self._waiting and len(self._running) < self.max_batch_size:
            seq = self._waiting.pop(0)
            seq.slot = len(self._running)
            self._running.append(seq)

    def _schedule(self) -> tuple[list[Sequence], list[tuple[Sequence, int]]]:
        """Split live sequences into one-token decode rows and (sequence, n_tokens) extensions."""
        decode_rows: list[Sequence] = []
        extend_plan: list[tuple[Sequence, int]] = []
        budget = self.prefill_budget
        for seq in self._running:
            if seq.finished:
                continue
            if len(seq.pending) == 1:
                decode_rows.append(seq)
            elif budget > 0 or not extend_plan:
                take = min(len(seq.pending), max(budget, 1))
                extend_plan.append((seq, take))
                budget -= take
        return decode_rows, extend_plan

    def _forward(self, decode_rows, extend_plan) -> torch.Tensor | None:
        """One model pass over every scheduled row; logits [R, V] for the rows that get a token
        this step (decode rows, then extensions whose pending tokens are all fed)."""
        rows = [(seq.slot, seq.pending[:1], seq.cached_len) for seq in decode_rows]
        rows += [(seq.slot, seq.pending[:take], seq.cached_len) for seq, take in extend_plan]
        if not rows:
            return None
        started = time.perf_counter()
        batch = StepBatch.build(rows, len(self._running), self.runner.device)
        logits = self.runner.forward(batch)
        self.stats.forward_s += time.perf_counter() - started
        for seq in decode_rows:
            seq.cached_len += 1
            seq.pending.clear()
        self.stats.decode_tokens += len(decode_rows)
        complete = list(range(len(decode_rows)))
        for i, (seq, take) in enumerate(extend_plan):
            seq.cached_len += take
            del seq.pending[:take]
            self.stats.extend_tokens += take
            if not seq.pending:
                complete.append(len(decode_rows) + i)
        if len(complete) == len(rows):
            return logits
        return logits[torch.tensor(complete, dtype=torch.long, device=logits.device)] if complete else None

    # ------------------------------------------------------------------ constraints

    def _start_mask_fill(self, masked: list[Sequence]) -> Future | None:
        if not masked:
            return None
        bitmask = torch.empty((len(masked), self._words), dtype=torch.int32)

        @torch.inference_mode()  # the buffer was made in the step's inference mode
        def fill() -> torch.Tensor:
            started = time.perf_counter()
            for i, seq in enumerate(masked):
                seq.request.matcher.fill_bitmask(bitmask, i)
            self.stats.mask_fill_s += time.perf_counter() - started
            return bitmask

        return self._mask_pool.submit(fill)

    def _finish_mask_fill(self, fill: Future | None, masked: list[int]):
        """Wait for the bitmask; returns (bitmask [R, W], row indices [R]) on the model's device."""
        if fill is None:
            return None, None
        device = self.runner.device
        bitmask = fill.result().to(device, non_blocking=True)
        return bitmask, torch.tensor(masked, dtype=torch.long, device=device)

    # ------------------------------------------------------------------ tokens

    def _accept_sampled(self, seq: Sequence, token: int, logprob: TokenLogprobs | None) -> None:
        if seq.finished:
            return
        matcher = seq.request.matcher
        if matcher is not None and not matcher.accept_token(token):
            seq.error = f"constraint rejected sampled token {token}"
            seq.finish("error")
            return
        if self._append(seq, token, logprob):
            return
        seq.pending = [token]
        if matcher is not None and self.jump_forward:
            self._jump_forward(seq)

    def _jump_forward(self, seq: Sequence) -> None:
        """Append the tokens the automaton forces; they are fed to the model in one extension."""
        matcher = seq.request.matcher
        room = seq.request.max_tokens - len(seq.output_ids)
        forced = matcher.forced_tokens()[: max(room - 1, 0)]
        for token in forced:
            if not matcher.accept_token(token):
                break
            self.stats.forced_tokens += 1
            forced_logprob = TokenLogprobs(token, 0.0, [(token, 0.0)] * bool(seq.request.params.top_logprobs))
            if self._append(seq, token, forced_logprob):
                return
            seq.pending.append(token)

    def _append(self, seq: Sequence, token: int, logprob: TokenLogprobs | None) -> bool:
        """Add one token to the output; returns True when it finished the sequence."""
        request = seq.request
        seq.output_ids.append(token)
        seq.row.append_token(token)
        seq.step_tokens.append(token)
        if logprob is not None:
            seq.step_logprobs.append(logprob)
        matcher = request.matcher
        if token in request.stop_token_ids:
            seq.finish("stop", token)
        elif token in request.eos_token_ids and not request.ignore_eos:
            seq.finish("stop")
        elif matcher is not None and matcher.is_terminated():
            seq.finish("stop")
        if seq.finished:
            seq.step_text.append(seq.stops.feed(seq.detokenizer.flush())[0])
            return True
        text, hit = seq.stops.feed(seq.detokenizer.push([token]))
        seq.step_text.append(text)
        if hit is not None:
            seq.finish("stop", hit)
        elif len(seq.output_ids) >= request.max_tokens or self._at_context_limit(seq):
            seq.step_text.append(seq.stops.feed(seq.detokenizer.flush())[0])
            seq.finish("length")
        return seq.finished

    def _at_context_limit(self, seq: Sequence) -> bool:
        return len(seq.request.prompt_token_ids) + len(seq.output_ids) >= self.max_model_len

    # ------------------------------------------------------------------ reporting

    def _report_and_retire(self) -> None:
        for seq in self._running:
            if seq.step_tokens or seq.finished:
                self._deliver(seq)
        for seq in [s for s in self._running if s.finished]:
            self._release(seq)

    def _deliver(self, seq: Sequence) -> None:
        try:
            seq.request.sink(seq.take_delta())
        except Exception:  # a broken sink must not break the batch
            log.exception("delivering output of %s failed", seq.request.request_id)
            seq.finish("abort")

    def _release(self, seq: Sequence) -> None:
        """Free ``seq``'s slot, moving the last live slot into the hole to keep slots dense."""
        slot = seq.slot
        last = self._running.pop()
        if last is not seq:
            self._running[slot] = last
            self.runner.move_slot(last.slot, slot, last.cached_len)
            last.slot = slot
        seq.slot = -1
        seq.row.release()

    def _fail_all(self, message: str) -> None:
        for seq in self._running + self._waiting:
            seq.error = message
            seq.finish("error")
            self._deliver(seq)
        self._running.clear()
        self._waiting.clear()


def _needs_host_mask(seq: Sequence) -> bool:
    """Constrained rows whose mask is not computed on the device by a resident DFA."""
    return seq.request.matcher is not None and seq.row.dfa is None
