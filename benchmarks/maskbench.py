"""MaskBench: score JSON-schema enforcement on the default model's tokenizer.

For each schema: compile; for each test instance, serialize it with ``json.dumps``, tokenize,
and walk the tokens (each must be allowed by the mask and accepted), then EOS. A valid
instance must pass; an invalid one must fail somewhere. A schema passes when it compiles and
every instance is classified correctly. Each token is offered to accept even where the mask
forbids it: a schema where the two disagree on a token is counted. Every (engine, schema) runs in a killable worker
process with a per-schema timeout, so a hang or crash is counted, never fatal.

Most Handwritten schemas (and some others) carry no instances, so a backend that compiles them
by ignoring a keyword looks as good as one that enforces it. ``--sample K`` closes that gap: K
random walks through each compiled mask (seeded, a token drawn uniformly from the allowed ones,
half the time from those that close a string or a container), and every walk that ends in EOS
must be one JSON value that the schema validates (``jsonschema``, with its format checker; a
repeated key keeps its last value); one that is not makes the schema fail, in the "generated
invalid" column. A walk that reaches a state the backend cannot go on from (an error such as a
parser limit, or no token allowed: a request would fail there) fails the schema too, in the
"stuck" column.

    python benchmarks/maskbench.py --data ../shared/data/maskbench --limit 500 --backend all
    python benchmarks/maskbench.py --subset Handwritten --backend all --sample 8
    python benchmarks/maskbench.py --subset MCPspec --json mcp.json  # then, with more such parts:
    python benchmarks/maskbench.py --report mcp.json snowplow.json --failures
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import sys
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# trellis-any: Trellis with json_numbers "any" (the schema's language; "trellis" bounds how
# numbers are spelled under the default layout, as served); trellis-any-order: Trellis with
# json_property_order "any" (objects of 5 or more properties in any order too)
ENGINES = ("trellis", "xgrammar", "llguidance", "outlines", "trellis-any", "trellis-any-order")
VERSIONS = {"xgrammar": "xgrammar", "llguidance": "llguidance", "outlines": "outlines_core"}
MAX_MASK_SAMPLES = 400  # mask timings kept per schema (all are measured)

# ------------------------------------------------------------------------------------------------
# worker side (runs in `python -m constraints.compile.workers`)

_engine: Any = None


def init_worker(engine: str) -> None:
    """Load the tokenizer and build the engine once per worker process."""
    global _engine
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.path.insert(0, str(ROOT))
    from server.model_loader import default_model_dir, load_tokenizer

    tok = load_tokenizer(default_model_dir())
    _engine = {"trellis": _Trellis, "xgrammar": _XGrammar, "llguidance": _LLGuidance,
               "outlines": _Outlines, "trellis-any": _TrellisAnyNumbers,
               "trellis-any-order": _TrellisAnyOrder}[engine](tok)


class _Engine:
    vocab = 49152

    def __init__(self, tok: Any) -> None:
        import numpy as np
        import torch

        self.tok = tok
        self.eos = tok.eos_token_id
        self.bitmask = torch.zeros((1, (self.vocab + 31) // 32), dtype=torch.int32)
        pieces = tok.convert_ids_to_tokens(list(range(len(tok))))
        self.closers = np.zeros(self.vocab, dtype=bool)  # tokens that can end a string or container
        self.closers[:len(pieces)] = [any(c in (p or "") for c in '"]}') for p in pieces]

    def compile(self, schema: dict) -> Any:
        raise NotImplementedError

    def matcher(self, compiled: Any) -> Any:
        """(fill(bitmask, row), accept(token) -> bool, error() -> str | None): error names a
        state the backend cannot go on from (a parser limit, a dead end), else None."""
        raise NotImplementedError


class _Trellis(_Engine):
    def __init__(self, tok: Any, compiler: Any = None) -> None:
        super().__init__(tok)
        from constraints import ConstraintCompiler

        if compiler is None:
            compiler = ConstraintCompiler(tok, self.vocab, compile_timeout_s=5.0, max_workers=1)
            # its compile worker starts here, before any per-schema timeout runs (on a loaded
            # machine a start counted against the first schema timed it out)
            compiler.wait_ready()
        self.compiler = compiler

    options: dict[str, Any] = {}

    def compile(self, schema: dict) -> Any:
        from constraints import ConstraintSpec

        return self.compiler.compile(ConstraintSpec("json_schema", schema, self.options))

    def matcher(self, compiled: Any) -> Any:
        m = compiled.new_matcher()
        return m.fill_bitmask, m.accept_token, lambda: getattr(m, "error", None)  # llguidance's only


class _TrellisAnyNumbers(_Trellis):
    options = {"json_numbers": "any"}


class _TrellisAnyOrder(_Trellis):
    options = {"json_property_order": "any"}


class _XGrammar(_Engine):
    def __init__(self, tok: Any) -> None:
        super().__init__(tok)
        import xgrammar as xgr

        self.xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=self.vocab)
        self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def compile(self, schema: dict) -> Any:
        return self.compiler.compile_json_schema(json.dumps(schema))

    def matcher(self, compiled: Any) -> Any:
        m = self.xgr.GrammarMatcher(compiled)
        return m.fill_next_token_bitmask, m.accept_token, lambda: None


class _LLGuidance(_Engine):
    def __init__(self, tok: Any) -> None:
        super().__init__(tok)
        import llguidance
        import llguidance.hf

        self.llg = llguidance
        self.lltok = llguidance.hf.from_tokenizer(tok, n_vocab=self.vocab)

    def compile(self, schema: dict) -> Any:
        grammar = self.llg.LLMatcher.grammar_from_json_schema(json.dumps(schema))
        err = self.llg.LLMatcher.validate_grammar(grammar, self.lltok)
        if err:
            raise ValueError(err)
        return grammar

    def matcher(self, compiled: Any) -> Any:
        m = self.llg.LLMatcher(self.lltok, compiled, log_level=0)

        def fill(bm: Any, row: int) -> None:
            v = bm[row]
            m.unsafe_compute_mask_ptr(v.data_ptr(), v.numel() * v.element_size())

        def accept(t: int) -> bool:
            if t == self.eos and m.is_stopped():
                return True
            return m.try_consume_tokens([t]) == 1

        return fill, accept, lambda: (m.get_error() or "error") if m.is_error() else None


class _Outlines(_Engine):
    def __init__(self, tok: Any) -> None:
        super().__init__(tok)
        import outlines_core

        from constraints.backends.vocabulary import TokenizerContext, vocabulary_bytes

        ctx = TokenizerContext(tok, self.vocab, len(tok), (self.eos,), "bench")
        self.oc = outlines_core
        self.vocabulary = outlines_core.Vocabulary(self.eos, vocabulary_bytes(ctx))

    def compile(self, schema: dict) -> Any:
        regex = self.oc.json_schema.build_regex_from_schema(json.dumps(schema))
        return self.oc.Index(regex, self.vocabulary)

    def matcher(self, compiled: Any) -> Any:
        g = self.oc.Guide(compiled)
        eos_word, eos_bit = self.eos >> 5, 1 << (self.eos & 31)

        def fill(bm: Any, row: int) -> None:
            v = bm[row]
            g.write_mask_into(v.data_ptr(), v.numel(), v.element_size())
            if compiled.is_final_state(g.get_state()):  # the Guide leaves EOS out at some ends
                v[eos_word] |= eos_bit

        def accept(t: int) -> bool:
            if t == self.eos:
                return compiled.is_final_state(g.get_state())
            try:
                g.advance(t, return_tokens=False)
            except Exception:
                return False
            return True

        return fill, accept, lambda: None


def _walk(fill: Any, accept: Any, bitmask: Any, ids: list[int], times: list[int]) -> tuple[int, bool]:
    """(index of the first token not allowed or not accepted, -1 when all passed; mask and
    accept disagreed on a token). Each token is offered to accept even where the mask forbids
    it, so a disagreement either way shows."""
    clock = time.perf_counter_ns
    for i, t in enumerate(ids):
        start = clock()
        fill(bitmask, 0)
        times.append(clock() - start)
        allowed = bool((int(bitmask[0, t >> 5]) >> (t & 31)) & 1)
        accepted = bool(accept(t))
        if not (allowed and accepted):
            return i, allowed != accepted
    return -1, False


def _where(tok: Any, ids: list[int], at: int) -> str:
    """The instance text around the refused token: ``…before⟦token⟧``."""
    before = tok.decode(ids[max(0, at - 12):at])
    return f"{before[-60:]}⟦{tok.decode(ids[at:at + 1])}⟧"


def _allowed_ids(bitmask: Any, vocab: int) -> Any:
    """Token ids whose bit is set in row 0 of an int32 bitmask (bit = allowed)."""
    import numpy as np

    bits = np.unpackbits(bitmask[0].numpy().view(np.uint8), bitorder="little")
    return np.flatnonzero(bits[:vocab])


def _random_output(eng: Any, compiled: Any, rng: Any, max_tokens: int) -> tuple[str, list[int]]:
    """One random walk through the mask, as (outcome, tokens so far): "ok" when it ends in EOS,
    "unfinished" when the budget ends it first, "stuck" when the backend reports an error or
    allows no token at all (a request would fail there), "disagree" when accept refuses a
    token the mask allowed."""
    fill, accept, error = eng.matcher(compiled)
    ids: list[int] = []
    for _ in range(max_tokens):
        if error():
            return "stuck", ids
        eng.bitmask.zero_()
        fill(eng.bitmask, 0)
        allowed = _allowed_ids(eng.bitmask, eng.vocab)
        eos_allowed = bool((allowed == eng.eos).any())
        pool = allowed[allowed != eng.eos]
        if error() or (len(pool) == 0 and not eos_allowed):
            return "stuck", ids
        if eos_allowed and (len(pool) == 0 or rng.random() < 0.5):
            return ("ok", ids) if accept(eng.eos) else ("disagree", ids + [eng.eos])
        if rng.random() < 0.5 and eng.closers[pool].any():
            pool = pool[eng.closers[pool]]
        token = int(pool[rng.integers(len(pool))])
        if not accept(token):
            return "disagree", ids + [token]
        ids.append(token)
    return "unfinished", ids


def _exact_multiple_of(validator: Any, divisor: Any, instance: Any, schema: Any) -> Any:
    """``multipleOf`` on the decimal values the JSON text spells (jsonschema divides binary
    floats: 8.03 / 0.01 = 802.9999999999999, so it calls 8.03 no multiple of 0.01)."""
    from decimal import Decimal, InvalidOperation

    from jsonschema.exceptions import ValidationError

    if not validator.is_type(instance, "number") or isinstance(divisor, bool):
        return
    try:
        if Decimal(repr(instance)) % Decimal(repr(divisor)) != 0:
            yield ValidationError(f"{instance!r} is not a multiple of {divisor}")
    except InvalidOperation:  # a quotient beyond the decimal context: no verdict
        return


def _ecma_pattern(validator: Any, pattern: Any, instance: Any, schema: Any) -> Any:
    """``pattern`` as ECMA-262 reads it (JSON Schema's dialect): Python's ``re`` gives ``\\s``,
    ``\\d``, ``\\w`` and ``.`` other character sets (``\\s`` takes U+001C-U+001F and leaves out
    U+FEFF), so the shorthands are spelled out first (``constraints.regex.dialect``, checked
    against JavaScript in the tests)."""
    from jsonschema.exceptions import ValidationError

    if not validator.is_type(instance, "string") or not isinstance(pattern, str):
        return
    if not _ecma_search(pattern, instance):
        yield ValidationError(f"{instance!r} does not match {pattern!r}")


def _ecma_search(pattern: str, text: str) -> bool:
    import re

    from constraints.regex.dialect import ecma_regex

    try:
        return re.search(ecma_regex(pattern), text) is not None
    except re.error:
        return re.search(pattern, text) is not None


def _ecma_pattern_properties(validator: Any, patterns: Any, instance: Any, schema: Any) -> Any:
    """``patternProperties`` with its patterns read as ECMA-262 (``.`` matches no ``\r``)."""
    if not validator.is_type(instance, "object"):
        return
    for pattern, subschema in patterns.items():
        for key, value in instance.items():
            if _ecma_search(pattern, key):
                yield from validator.descend(value, subschema, path=key, schema_path=pattern)


def _ecma_additional_properties(validator: Any, extra: Any, instance: Any, schema: Any) -> Any:
    """``additionalProperties`` over the keys neither ``properties`` lists nor an ECMA-262 reading
    of a ``patternProperties`` pattern matches."""
    from jsonschema.exceptions import ValidationError

    if not validator.is_type(instance, "object"):
        return
    listed = schema.get("properties", {})
    patterns = schema.get("patternProperties", {})
    extras = [k for k in instance if k not in listed and not any(_ecma_search(p, k) for p in patterns)]
    if validator.is_type(extra, "object"):
        for key in extras:
            yield from validator.descend(instance[key], extra, path=key)
    elif extra is False and extras:
        yield ValidationError(f"additional properties are not allowed ({', '.join(map(repr, extras))})")


def _invalid_reason(schema: Any, text: str) -> str | None:
    """Why ``text`` is not an instance of ``schema`` (None when it is, or when the schema cannot be
    checked here, e.g. a remote ``$ref``)."""
    import jsonschema

    try:
        value = json.loads(text)  # a repeated key keeps its last value, as JSON.parse does
    except ValueError as exc:
        return f"not one JSON value ({exc})"
    try:
        cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
        cls = jsonschema.validators.extend(cls, {
            "multipleOf": _exact_multiple_of, "pattern": _ecma_pattern,
            "patternProperties": _ecma_pattern_properties, "additionalProperties": _ecma_additional_properties})
        error = jsonschema.exceptions.best_match(
            cls(schema, format_checker=cls.FORMAT_CHECKER).iter_errors(value))
    except Exception:  # unresolvable $ref, a pattern Python's re cannot compile, ...
        return None
    return None if error is None else f"{error.message[:120]} at {list(error.absolute_path)}"


def sample_outputs(eng: Any, compiled: Any, schema: Any, walks: int, seed: int = 0,
                   max_tokens: int = 256) -> dict:
    """Generate ``walks`` random outputs through the compiled mask and validate the finished
    ones: how many finished, whether one was invalid, got stuck, or split mask from accept."""
    import numpy as np

    rng = np.random.default_rng(seed)
    counts = {"ok": 0, "unfinished": 0, "stuck": 0, "disagree": 0}
    invalid, detail = False, ""
    for _ in range(walks):
        outcome, ids = _random_output(eng, compiled, rng, max_tokens)
        counts[outcome] += 1
        text = eng.tok.decode(ids)
        if outcome == "ok":
            reason = _invalid_reason(schema, text)
            if reason is not None and not invalid:
                invalid, detail = True, f"generated {text[:160]!r}: {reason}"
        elif outcome in ("stuck", "disagree") and not detail:
            detail = f"{outcome} after {text[-80:]!r}"
    return {"sampled": counts["ok"], "sampled_invalid": invalid, "sample_stuck": counts["stuck"] > 0,
            "sample_disagreed": counts["disagree"] > 0, "sample_detail": detail}


def score_schema(schema: Any, tests: list[dict], walks: int = 0) -> dict:
    """Compile and walk every test instance (and ``walks`` random outputs); runs in the worker."""
    eng = _engine
    start = time.perf_counter_ns()
    try:
        compiled = eng.compile(schema)
    except Exception as exc:
        return {"status": "compile_error", "error": f"{type(exc).__name__}: {str(exc)[:200]}"}
    compile_ns = time.perf_counter_ns() - start
    times: list[int] = []
    valid_rejected = invalid_accepted = disagreed = False
    detail = ""
    for n, test in enumerate(tests):
        text = test["text"] if "text" in test else json.dumps(test["data"])  # "text": the exact spelling
        ids = list(eng.tok.encode(text, add_special_tokens=False)) + [eng.eos]
        fill, accept, _ = eng.matcher(compiled)
        at, disagree = _walk(fill, accept, eng.bitmask, ids, times)
        ok = at < 0
        disagreed |= disagree
        if test["valid"] and not ok:
            if not valid_rejected:
                detail = f"valid #{n} refused at {_where(eng.tok, ids, at)}"
            valid_rejected = True
        elif not test["valid"] and ok:
            if not invalid_accepted and not detail:
                detail = f"invalid #{n} accepted"
            invalid_accepted = True
    if len(times) > MAX_MASK_SAMPLES:
        step = len(times) / MAX_MASK_SAMPLES
        times = [times[int(i * step)] for i in range(MAX_MASK_SAMPLES)]
    result = {
        "status": "ok",
        "compile_ns": compile_ns,
        "mask_ns": times,
        "valid_rejected": valid_rejected,
        "invalid_accepted": invalid_accepted,
        "disagreed": disagreed,
        "detail": detail,
    }
    if walks:
        sampled = sample_outputs(eng, compiled, schema, walks)
        result["disagreed"] |= sampled.pop("sample_disagreed")
        result.update(sampled)
        if not result["detail"]:
            result["detail"] = result["sample_detail"]
    return result


# ------------------------------------------------------------------------------------------------
# driver side


def load_rows(data: Path, limit: int | None, subsets: set[str] | None = None,
              ids: set[str] | None = None) -> list[tuple[str, dict]]:
    """(subset, row) for every schema of ``subsets`` (all when None) whose id is in ``ids``
    (all when None); an evenly spread sample of ``limit`` of those when given."""
    rows = []
    for path in sorted(data.glob("*.jsonl.gz")):
        subset = path.name.split(".")[0]
        if subsets is not None and subset not in subsets:
            continue
        with gzip.open(path, "rt") as f:
            rows.extend((subset, json.loads(line)) for line in f if line.strip())
    if ids is not None:
        rows = [(s, r) for s, r in rows if r["id"] in ids or f"{s}:{r['id']}" in ids]
    if limit and limit < len(rows):
        step = len(rows) / limit
        rows = [rows[int(i * step)] for i in range(limit)]
    return rows


def _new_pool(engine: str, jobs: int, memory_mb: int):
    """``jobs`` killable worker processes for one engine (they load the tokenizer before any
    timeout); each is capped at ``memory_mb`` MiB beyond its start-up size, so a schema that
    blows up a backend's memory is counted as a crash instead of starving the machine."""
    from constraints.compile.workers import WorkerPool

    pool = WorkerPool(jobs, "maskbench:init_worker", (engine,), memory_mb=memory_mb, name=f"maskbench-{engine}")
    pool.wait_ready()
    return pool


def _score(pool, schema: Any, tests: list[dict], timeout: float, walks: int = 0) -> dict:
    from constraints.errors import ConstraintError, ConstraintTimeoutError

    try:
        result, _ = pool.run("maskbench:score_schema", schema, tests, walks, timeout=timeout)
        return result
    except ConstraintTimeoutError:
        return {"status": "compile_error", "error": f"timeout after {timeout:g} s"}
    except ConstraintError as exc:  # the worker died (memory, crash)
        return {"status": "compile_error", "error": f"crash: {exc.message[:200]}"}


def run_engine(engine: str, rows: list, timeout: float, jobs: int, progress: bool,
               memory_mb: int = 4096, walks: int = 0) -> list[dict]:
    # one spare worker: a worker killed by the timeout is replaced in the background (loading a
    # tokenizer takes from seconds to minutes on a loaded machine) while the spare takes the
    # next schema; at most ``jobs`` schemas run at once, so timings are not shared with it
    pool = _new_pool(engine, jobs + 1, memory_mb)
    results: list[dict] = [{}] * len(rows)
    done = [0]
    began = time.monotonic()

    def one(i: int) -> None:
        subset, row = rows[i]
        start = time.monotonic()
        results[i] = _score(pool, row["schema"], row.get("tests", []), timeout, walks)
        done[0] += 1
        if not progress:
            return
        took = time.monotonic() - start
        if took > min(5.0, timeout / 2):  # name the slow ones: a long gap in the log is explained
            print(f"  {engine}: {row.get('file', row.get('id'))} took {took:.1f} s "
                  f"({results[i].get('error') or results[i]['status']})", file=sys.stderr, flush=True)
        if done[0] % 50 == 0:
            print(f"  {engine}: {done[0]}/{len(rows)} ({time.monotonic() - began:.0f} s)",
                  file=sys.stderr, flush=True)

    try:
        with ThreadPoolExecutor(jobs) as ex:
            list(ex.map(one, range(len(rows))))
    finally:
        pool.close()
    return results


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, max(0, math.ceil(q * len(values)) - 1))]


def summarize(rows: list, results: list[dict]) -> dict[str, dict]:
    """Per subset and "total": passing, compile errors, valid rejected, invalid accepted, timings."""
    acc: dict[str, dict] = defaultdict(lambda: {"n": 0, "pass": 0, "cerr": 0, "vrej": 0, "iacc": 0,
                                                 "disagree": 0, "ginv": 0, "stuck": 0, "mask": [], "compile": []})
    for (subset, _), res in zip(rows, results):
        for key in (subset, "total"):
            a = acc[key]
            a["n"] += 1
            if res.get("status") != "ok":
                a["cerr"] += 1
                continue
            a["vrej"] += res["valid_rejected"]
            a["iacc"] += res["invalid_accepted"]
            a["disagree"] += res.get("disagreed", False)
            a["ginv"] += res.get("sampled_invalid", False)
            a["stuck"] += res.get("sample_stuck", False)
            a["pass"] += not any(res.get(k) for k in ("valid_rejected", "invalid_accepted",
                                                         "sampled_invalid", "sample_stuck"))
            a["mask"].extend(res["mask_ns"])
            a["compile"].append(res["compile_ns"])
    return acc


def _version(engine: str) -> str:
    if engine == "trellis":
        return "Trellis"
    if engine == "trellis-any":
        return "Trellis, json_numbers any"
    if engine == "trellis-any-order":
        return "Trellis, json_property_order any"
    from importlib.metadata import version

    return f"{engine} {version(VERSIONS[engine].replace('_', '-'))}"


def render(engines: list[str], rows: list, all_results: dict[str, list[dict]],
           title: str = "MaskBench") -> str:
    """The results as Markdown tables: totals per engine, then per subset."""
    sampled = any("sampled" in r for res in all_results.values() for r in res)
    gen_col, gen_sep = (" generated invalid | stuck |", "---|---|") if sampled else ("", "")
    lines = [f"{title}: {len(rows)} schemas, SmolLM2-135M-Instruct tokenizer", "",
             "| engine | passing | compile err | valid rejected | invalid accepted |" + gen_col
             + " mask/accept disagree | mask p50/p99 µs | compile p50 µs |",
             "|---|---|---|---|---|" + gen_sep + "---|---|---|"]
    sums = {e: summarize(rows, all_results[e]) for e in engines}
    for e in engines:
        t = sums[e]["total"]
        gen = f" {t['ginv']:,} | {t['stuck']:,} |" if sampled else ""
        lines.append(
            f"| {_version(e)} | {t['pass']:,} | {t['cerr']:,} | {t['vrej']:,} | {t['iacc']:,} |{gen} {t['disagree']:,} | "
            f"{_pct(t['mask'], .5) / 1e3:.1f} / {_pct(t['mask'], .99) / 1e3:.0f} | "
            f"{_pct(t['compile'], .5) / 1e3:,.0f} |"
        )
    lines += ["", "Per subset (passing / compile err / valid rejected / invalid accepted"
              + (" / generated invalid / stuck" if sampled else "") + "):", "",
              "| subset | schemas | " + " | ".join(engines) + " |",
              "|---|---|" + "---|" * len(engines)]
    subsets = sorted({s for s, _ in rows})
    for s in subsets:
        cells = []
        for e in engines:
            a = sums[e][s]
            cells.append(f"{a['pass']} / {a['cerr']} / {a['vrej']} / {a['iacc']}"
                         + (f" / {a['ginv']} / {a['stuck']}" if sampled else ""))
        lines.append(f"| {s} | {sums[engines[0]][s]['n']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "data" / "maskbench")
    ap.add_argument("--limit", type=int, default=None, help="evenly spread sample of N schemas")
    ap.add_argument("--backend", default="all",
                    help="trellis|xgrammar|llguidance|outlines|all, or a comma-separated list")
    ap.add_argument("--timeout", type=float, default=30.0, help="per-schema limit in seconds")
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--memory-mb", type=int, default=4096,
                    help="per-worker memory cap beyond start-up (0: none); over it counts as a crash")
    ap.add_argument("--subset", default=None, help="only these subsets (comma-separated)")
    ap.add_argument("--ids", default=None,
                    help="only these schema ids (comma-separated; SUBSET:ID where ids repeat)")
    ap.add_argument("--failures", action="store_true",
                    help="after the table, one line per failing (engine, schema): the refusal or the "
                         "instance text at the refused token")
    ap.add_argument("--sample", type=int, default=0, metavar="K",
                    help="also generate K random outputs per compiled schema and validate them")
    ap.add_argument("--json", type=Path, default=None, help="also write raw per-schema results")
    ap.add_argument("--quiet", action="store_true")
    ap.add_argument("--report", type=Path, nargs="+", default=None, metavar="JSON",
                    help="score nothing: render the table from --json files of earlier runs (one "
                         "run split by --subset, say), merged in the order given")
    args = ap.parse_args(argv)
    if args.report:
        engines, rows, all_results = load_results(args.report)
        print(render(engines, rows, all_results))
        if args.failures:
            print("\n" + render_failures(engines, rows, all_results))
        return 0

    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(Path(__file__).resolve().parent), str(ROOT), os.environ.get("PYTHONPATH", "")]
    )
    rows = load_rows(args.data, args.limit,
                     set(args.subset.split(",")) if args.subset else None,
                     set(args.ids.split(",")) if args.ids else None)
    if not rows:
        ap.error(f"no schemas in {args.data} for subset(s) {args.subset} and id(s) {args.ids}")
    engines = list(ENGINES) if args.backend == "all" else args.backend.split(",")
    unknown = [e for e in engines if e not in ENGINES]
    if unknown:
        ap.error(f"unknown backend(s): {', '.join(unknown)}")
    all_results = {}
    for engine in engines:
        start = time.monotonic()
        all_results[engine] = run_engine(engine, rows, args.timeout, args.jobs, not args.quiet,
                                         args.memory_mb, args.sample)
        if not args.quiet:
            print(f"{engine}: {time.monotonic() - start:.0f} s", file=sys.stderr, flush=True)
            if engine != engines[-1]:  # partial table: a long run is useful before it ends
                print(render(list(all_results), rows, all_results) + "\n", file=sys.stderr, flush=True)
    if args.json:
        args.json.write_text(json.dumps(results_json(rows, all_results)))
    print(render(engines, rows, all_results))
    if args.failures:
        print("\n" + render_failures(engines, rows, all_results))
    return 0


def results_json(rows: list, all_results: dict[str, list[dict]]) -> dict:
    """The per-schema results as JSON: each engine's list of results, each with the schema's
    ``subset`` and ``id`` beside what the worker returned (mask timings included)."""
    return {e: [r | {"subset": subset, "id": row["id"]} for (subset, row), r in zip(rows, res)]
            for e, res in all_results.items()}


def load_results(paths: list[Path]) -> tuple[list[str], list, dict[str, list[dict]]]:
    """Merge ``results_json`` files into (engines, rows, results) for ``render``. Every file must
    hold the same engines, each over the same schemas, so the runs stay side by side."""
    engines: list[str] = []
    rows: list = []
    all_results: dict[str, list[dict]] = {}
    for path in paths:
        data = json.loads(Path(path).read_text())
        if not engines:
            engines = list(data)
            all_results = {e: [] for e in engines}
        if list(data) != engines:
            raise ValueError(f"{path}: engines {list(data)}, expected {engines}")
        keys = [(r["subset"], r["id"]) for r in data[engines[0]]]
        for e in engines:
            if [(r["subset"], r["id"]) for r in data[e]] != keys:
                raise ValueError(f"{path}: {e} scored other schemas than {engines[0]}")
            all_results[e].extend(data[e])
        rows.extend((subset, {"id": id_}) for subset, id_ in keys)
    return engines, rows, all_results


FAILURE_KINDS = ("valid_rejected", "invalid_accepted", "sampled_invalid", "sample_stuck", "disagreed")


def render_failures(engines: list[str], rows: list, all_results: dict[str, list[dict]]) -> str:
    """One line per failing (engine, schema): subset:id, then the compile error or the detail."""
    lines = []
    for e in engines:
        for (subset, row), res in zip(rows, all_results[e]):
            if res.get("status") != "ok":
                lines.append(f"{e} {subset}:{row['id']} COMPILE {res.get('error', '')}")
            elif any(res.get(k) for k in FAILURE_KINDS):
                kind = "+".join(k for k in FAILURE_KINDS if res.get(k))
                lines.append(f"{e} {subset}:{row['id']} {kind} {res.get('detail', '')!r}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
