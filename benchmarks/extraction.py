"""Extraction benchmark: documents in, JSON out, with the engine's speculation auto vs off.

The workload of extraction pipelines: a document of 300-1,500 tokens (an invoice, a support
ticket, a product page; generated here from a seed, no data download) and a JSON schema whose
string values appear in the document, answered under ``json_schema`` with jump-forward on (the
server's defaults, with close_on_length so a long answer still closes as valid JSON); plus a function-calling workload (a message in, the arguments of a
``create_ticket`` call out, as JSON). Each client sends its requests one after another (greedy,
so both runs must give the same tokens), with 1, 8 and 16 clients: the engine batches them.

Prints per client count and workload: output tok/s (prefill included) and time per output token
after the first (TPOT: the decode alone) with speculation auto and off, their ratios, where the output tokens came from (sampled one per step, forced by the
grammar, drafts kept from the prompt), the prompt-lookup acceptance, whether the outputs are
identical and every output is valid JSON of its schema.

The prompts are the same in both columns, so they bound the ratio: a third run answers the same
documents with the same clients and ``max_tokens=1`` (the prefill alone; unconstrained, a
prompt's work does not depend on the constraint), and "ceiling" is the "off" run's seconds over
it, the speed-up speculation would give if every output token after the first were free.

    python benchmarks/extraction.py                        # default model, 1 8 16 clients
    python benchmarks/extraction.py --clients 1 --docs 2   # quicker
    python benchmarks/extraction.py --shape 1b --tokenizer DIR   # a GPU: random weights, the step cost

After each row the speculation policy's fit is printed: a forward's fixed and per-token ms, and
the host ms verification spends per draft token, from which the policy prices drafts at that
batch (where the per-token part dominates, as on this CPU at 8 clients, a kept draft token saves
little more than its share of the fixed part).

``--shape 1b|8b`` builds a random-init Llama of that shape (bf16 on CUDA, ``benchmarks/gpu.py``'s
models; the tokenizer from ``--tokenizer``) with the server's CUDA graphs: its answers are not a
real model's, so its acceptance says nothing; what it measures is the step-cost side.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from constraints import ConstraintCompiler, ConstraintSpec  # noqa: E402
from sampler import SamplingParams  # noqa: E402
from server.engine.engine import Engine  # noqa: E402
from server.engine.model import ModelRunner, load_hf_model, resolve_dtype  # noqa: E402
from server.engine.sequence import GenerationRequest  # noqa: E402
from server.model_loader import default_model_dir, load_tokenizer  # noqa: E402
from server.state import resolve_quantization  # noqa: E402

FIRST = ["Maria", "James", "Aiko", "Lucas", "Fatima", "Oliver", "Chen", "Sofia", "Ivan", "Amara", "Diego", "Hannah"]
LAST = ["Okafor", "Lindqvist", "Tanaka", "Moreau", "Haddad", "Kowalski", "Ferreira", "Novak", "Brennan", "Sato"]
COMPANIES = ["Northwind Traders", "Blue Harbor Logistics", "Copperleaf Systems", "Alder & Finch Supply",
             "Meridian Office Goods", "Quartz Valley Foods", "Helix Print Works", "Silverline Tools"]
PRODUCTS = ["wireless keyboard", "standing desk frame", "noise cancelling headset", "ergonomic chair",
            "USB-C docking station", "27 inch monitor", "laser printer toner", "portable projector"]
ISSUES = ["the device stops charging after a few minutes", "the invoice was charged twice to my card",
          "the delivery arrived with a cracked screen", "the login page keeps rejecting my password",
          "the replacement part does not fit the model I own", "the subscription renewed without notice"]
FILLER = ("Please keep this message for your records. Our team reviews every request in the order it "
          "arrives and answers within two business days. Shipping times depend on the carrier and the "
          "destination, and tracking numbers are sent by email once a parcel leaves the warehouse. "
          "Returns are accepted within thirty days when the item is unused and in its original packaging. "
          "For questions about warranty coverage, see the terms printed on the back of the order form. ")

STRING = {"type": "string", "maxLength": 60}
INVOICE = {"type": "object", "properties": {
    "vendor": STRING, "customer": STRING, "invoice_number": STRING, "date": STRING,
    "items": {"type": "array", "maxItems": 4, "items": {"type": "object", "properties": {
        "description": STRING, "quantity": {"type": "integer", "minimum": 0, "maximum": 1000}},
        "required": ["description", "quantity"], "additionalProperties": False}},
    "total": STRING}, "required": ["vendor", "customer", "invoice_number", "date", "items", "total"],
    "additionalProperties": False}
TICKET = {"type": "object", "properties": {
    "customer_name": STRING, "email": STRING, "product": STRING, "order_id": STRING, "issue": STRING,
    "priority": {"enum": ["low", "medium", "high"]}},
    "required": ["customer_name", "email", "product", "order_id", "issue", "priority"], "additionalProperties": False}
PRODUCT = {"type": "object", "properties": {
    "name": STRING, "brand": STRING, "price": STRING, "sku": STRING,
    "features": {"type": "array", "maxItems": 3, "items": STRING}},
    "required": ["name", "brand", "price", "sku", "features"], "additionalProperties": False}
TOOL_CALL = {"type": "object", "properties": {
    "name": {"const": "create_ticket"},
    "arguments": {"type": "object", "properties": {
        "customer": STRING, "email": STRING, "order_id": STRING, "summary": STRING},
        "required": ["customer", "email", "order_id", "summary"], "additionalProperties": False}},
    "required": ["name", "arguments"], "additionalProperties": False}


@dataclass
class Document:
    kind: str
    text: str
    schema: dict
    instruction: str


def person(rng: random.Random) -> str:
    return f"{rng.choice(FIRST)} {rng.choice(LAST)}"


def invoice(rng: random.Random, filler: int) -> Document:
    vendor, customer = rng.choice(COMPANIES), person(rng)
    number = f"INV-{rng.randint(10000, 99999)}"
    lines = [(rng.choice(PRODUCTS), rng.randint(1, 12), rng.randint(5, 900)) for _ in range(rng.randint(2, 4))]
    body = "\n".join(f"- {desc}: {qty} units at ${price}.00 each" for desc, qty, price in lines)
    total = sum(qty * price for _, qty, price in lines)
    text = (f"INVOICE {number}\nFrom: {vendor}\nBill to: {customer}\nDate: 2026-{rng.randint(1, 12):02d}-"
            f"{rng.randint(1, 28):02d}\n\n{body}\n\nTotal due: ${total}.00\n\n" + FILLER * filler)
    return Document("invoice", text, INVOICE, "Extract the invoice's vendor, customer, number, date, items and total.")


def ticket(rng: random.Random, filler: int) -> Document:
    name = person(rng)
    email = f"{name.split()[0].lower()}.{name.split()[1].lower()}@example.com"
    order = f"ORD-{rng.randint(100000, 999999)}"
    product, issue = rng.choice(PRODUCTS), rng.choice(ISSUES)
    text = (f"Subject: Problem with my {product}\nFrom: {name} <{email}>\n\nHello, I bought a {product} "
            f"(order {order}) last month and {issue}. I need this fixed as soon as possible.\n\nThanks,\n{name}\n\n"
            + FILLER * filler)
    return Document("ticket", text, TICKET, "Extract the support ticket's fields.")


def product_page(rng: random.Random, filler: int) -> Document:
    name, brand = rng.choice(PRODUCTS).title(), rng.choice(COMPANIES)
    sku = f"SKU-{rng.randint(1000, 9999)}-{rng.choice('ABCDEF')}"
    features = rng.sample(["two year warranty", "free shipping", "recycled materials", "quiet operation",
                           "adjustable height", "wireless pairing", "energy saving mode"], 3)
    text = (f"{name} by {brand}\nPrice: ${rng.randint(20, 900)}.99\nSKU: {sku}\n\nFeatures:\n"
            + "\n".join(f"* {f}" for f in features) + "\n\n" + FILLER * filler)
    return Document("product", text, PRODUCT, "Extract the product's name, brand, price, SKU and features.")


def tool_message(rng: random.Random, filler: int) -> Document:
    doc = ticket(rng, filler)
    return Document("tool_call", doc.text, TOOL_CALL,
                    "Call the function create_ticket with the customer, email, order id and a short summary.")


MAKERS = {"invoice": invoice, "ticket": ticket, "product": product_page, "tool_call": tool_message}


def documents(workload: str, count: int, seed: int) -> list[Document]:
    """``count`` documents of 300-1,500 tokens: extraction cycles through the three kinds."""
    rng = random.Random(seed)
    kinds = ["invoice", "ticket", "product"] if workload == "extraction" else ["tool_call"]
    return [MAKERS[kinds[i % len(kinds)]](rng, filler=rng.randint(3, 17)) for i in range(count)]


def render(tokenizer, doc: Document) -> list[int]:
    messages = [{"role": "system", "content": f"{doc.instruction} Answer with JSON only."},
                {"role": "user", "content": doc.text}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False).input_ids


@dataclass
class Run:
    outputs: list[list[int]] = field(default_factory=list)
    seconds: float = 0.0
    stats: dict = field(default_factory=dict)
    first_at: dict[int, float] = field(default_factory=dict)  # request -> when its first token came
    done_at: dict[int, float] = field(default_factory=dict)
    step_cost: str = ""  # the speculation policy's fit after the run (see step_cost)

    @property
    def tpot_ms(self) -> float:
        """Mean time per output token after the first (the prefill left out), ms."""
        per = [(self.done_at[i] - self.first_at[i]) / (len(out) - 1)
               for i, out in enumerate(self.outputs) if len(out) > 1 and i in self.first_at]
        return 1000 * sum(per) / max(len(per), 1)

    @property
    def tokens(self) -> int:
        return sum(len(o) for o in self.outputs)


STAT_FIELDS = ("steps", "forced_tokens", "lookup_draft_tokens", "accepted_lookup_draft_tokens")


def run(runner, tokenizer, compiled: dict, prompts: list[list[int]], docs: list[Document], *, clients: int,
        speculation: bool, max_tokens: int, max_len: int) -> Run:
    """Every prompt answered, ``clients`` at a time (a client sends its next one when its last is done);
    ``compiled`` None: unconstrained (the prefill-only run)."""
    engine = Engine(runner, tokenizer, max_batch_size=clients, max_model_len=max_len, speculation=speculation)
    result = Run(outputs=[[] for _ in prompts])
    queue = list(range(len(prompts)))
    open_requests = [0]

    def submit() -> None:
        i = queue.pop(0)
        open_requests[0] += 1

        def sink(delta, i=i) -> None:
            if delta.token_ids and i not in result.first_at:
                result.first_at[i] = time.perf_counter()
            result.outputs[i] += delta.token_ids
            if delta.finish_reason is not None:
                result.done_at[i] = time.perf_counter()
                open_requests[0] -= 1
                if queue:
                    submit()

        engine.submit(GenerationRequest(
            request_id=f"x{i}", prompt_token_ids=prompts[i], params=SamplingParams(temperature=0.0),
            max_tokens=max_tokens, sink=sink, eos_token_ids=frozenset({tokenizer.eos_token_id}),
            matcher=None if compiled is None else closing(compiled[docs[i].kind].new_matcher())))

    before = {name: getattr(engine.stats, name) for name in STAT_FIELDS}
    started = time.perf_counter()
    for _ in range(min(clients, len(queue))):
        submit()
    while open_requests[0] or queue:
        engine.step()
    engine.flush()
    result.seconds = time.perf_counter() - started
    result.stats = {name: getattr(engine.stats, name) - before[name] for name in STAT_FIELDS}
    result.step_cost = step_cost(engine)
    engine.shutdown()
    return result


def closing(matcher):
    """The matcher with close_on_length: the answer closes as valid JSON within max_tokens."""
    matcher.close_on_length = True
    return matcher


def valid_outputs(tokenizer, outputs: list[list[int]], docs: list[Document]) -> bool:
    """Every output parses as JSON with the schema's required keys (the grammar enforced the rest)."""
    for tokens, doc in zip(outputs, docs, strict=True):
        try:
            value = json.loads(tokenizer.decode(tokens, skip_special_tokens=True))
        except ValueError:
            return False
        if not isinstance(value, dict) or not set(doc.schema["required"]) <= set(value):
            return False
    return True


def load(device: torch.device, dtype: str, shape: str | None = None, tokenizer_dir: Path | None = None):
    """The default model, or a random-init one of ``shape`` (``benchmarks/gpu.py``'s shapes)."""
    if shape is None:
        directory = default_model_dir(show_progress=True)
        return load_hf_model(directory, resolve_dtype(dtype, device), device), load_tokenizer(directory)
    from benchmarks.gpu import build_model

    tokenizer = load_tokenizer(tokenizer_dir or default_model_dir())
    return build_model(shape, len(tokenizer), tokenizer.eos_token_id, resolve_dtype(dtype, device), device), tokenizer


def make_runner(model, clients: int, max_len: int, quantization: str, batch_invariant: bool = False):
    """A runner for ``clients`` sequences; on CUDA with the server's decode and piecewise graphs."""
    runner = ModelRunner.for_sequences(model, clients, max_len, quantization=quantization,
                                       batch_invariant=batch_invariant)
    if runner.device.type != "cuda":
        return runner
    from server.engine.cuda_graphs import graph_decode_steps

    return graph_decode_steps(runner, max_batch_size=clients, max_model_len=max_len)


def step_cost(engine: Engine) -> str:
    """The speculation policy's fitted forward cost and verification cost, as a line."""
    policy = engine.drafts.policy
    cost = policy.cost()
    fit = "not fitted (one step size)" if cost is None else f"{1000 * cost[0]:.3f} ms + {1000 * cost[1]:.4f} ms/token"
    return f"forward {fit}; verification {1000 * policy.verify_s_per_token:.3f} host ms per draft token"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 8, 16])
    parser.add_argument("--docs", type=int, default=0, help="documents per run (default: 2 x clients, at least 4)")
    parser.add_argument("--workloads", nargs="+", default=["extraction", "tool_call"],
                        choices=["extraction", "tool_call"])
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quantization", default="none", choices=["none", "int4", "int8", "bf16"],
                        help="the linear layers' weights (--quantization of the server)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    parser.add_argument("--show", action="store_true", help="print every answer (speculation auto)")
    parser.add_argument("--shape", default=None, choices=["1b", "8b", "tiny"],
                        help="a random-init model of this shape instead of the default model (the step cost)")
    parser.add_argument("--tokenizer", type=Path, default=None, help="with --shape: the tokenizer's folder")
    parser.add_argument("--property-order", default="auto", choices=["auto", "any", "declared"],
                        help="json_property_order of the schemas (auto, the default: objects of 5 or more "
                             "properties in the declared order)")
    parser.add_argument("--batch-invariant", action="store_true",
                        help="CUDA: the runner's batch-invariant kernels (serve --batch-invariant on)")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if args.device == "auto" else args.device))
    hf, tokenizer = load(device, args.dtype, args.shape, args.tokenizer)
    compiler = ConstraintCompiler(tokenizer, hf.config.vocab_size, stop_token_ids=[tokenizer.eos_token_id])
    order = {"json_property_order": args.property_order}
    compiled = {kind: compiler.compile(ConstraintSpec("json_schema", schema, order))
                for kind, schema in (("invoice", INVOICE), ("ticket", TICKET), ("product", PRODUCT),
                                     ("tool_call", TOOL_CALL))}
    quantization = resolve_quantization(args.quantization, device, hand_written=True)
    print(f"device={device} threads={torch.get_num_threads()} quantization={quantization} greedy, json_schema + "
          f"jump-forward, property order {args.property_order}, max_tokens={args.max_tokens}, "
          f"batch_invariant={args.batch_invariant}")
    print("| workload | clients | docs | prompt tokens (mean) | tok/s off | tok/s auto | speed-up | TPOT ms off | "
          "TPOT ms auto | TPOT speed-up | prefill s (of off) | ceiling | steps off / auto | forced | drafts kept (of fed) | "
          "identical | valid JSON |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    rows = []
    try:
        for workload in args.workloads:
            for clients in args.clients:
                count = args.docs or max(4, 2 * clients)
                docs = documents(workload, count, args.seed + clients)
                prompts = [render(tokenizer, doc) for doc in docs]
                max_len = max(len(p) for p in prompts) + args.max_tokens + 8
                model = copy.deepcopy(hf) if quantization != "none" else hf  # quantizing re-points its modules
                runner = make_runner(model, clients, max_len, quantization, args.batch_invariant)
                off, auto = (run(runner, tokenizer, compiled, prompts, docs, clients=clients, speculation=flag,
                                 max_tokens=args.max_tokens, max_len=max_len) for flag in (False, True))
                prefill = run(runner, tokenizer, None, prompts, docs, clients=clients, speculation=False,
                              max_tokens=1, max_len=max_len)
                row = summarise(workload, clients, prompts, off, auto, valid_outputs(tokenizer, auto.outputs, docs)
                                and valid_outputs(tokenizer, off.outputs, docs), prefill.seconds)
                rows.append(row)
                print(format_row(row), flush=True)
                print(f"    step cost, speculation auto: {auto.step_cost}", flush=True)
                if args.show:
                    for tokens in auto.outputs:
                        print("   ", tokenizer.decode(tokens, skip_special_tokens=True))
                del runner
    finally:
        compiler.close()
    result = {"device": str(device), "rows": rows}
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return result


def summarise(workload: str, clients: int, prompts, off: Run, auto: Run, valid: bool, prefill_s: float) -> dict:
    fed, kept = auto.stats["lookup_draft_tokens"], auto.stats["accepted_lookup_draft_tokens"]
    return {"workload": workload, "clients": clients, "docs": len(prompts),
            "prompt_tokens": sum(len(p) for p in prompts) / len(prompts),
            "tok_s_off": off.tokens / off.seconds, "tok_s_auto": auto.tokens / auto.seconds,
            "speedup": (auto.tokens / auto.seconds) / (off.tokens / off.seconds),
            "tpot_ms_off": off.tpot_ms, "tpot_ms_auto": auto.tpot_ms,
            "steps_off": off.stats["steps"], "steps_auto": auto.stats["steps"],
            "forced_share": auto.stats["forced_tokens"] / max(auto.tokens, 1),
            "drafts_fed": fed, "drafts_kept": kept, "identical": off.outputs == auto.outputs, "valid": valid,
            "prefill_s": prefill_s, "prefill_share_off": prefill_s / off.seconds, "ceiling": off.seconds / prefill_s}


def format_row(r: dict) -> str:
    return (f"| {r['workload']} | {r['clients']} | {r['docs']} | {r['prompt_tokens']:.0f} | {r['tok_s_off']:.1f} | "
            f"{r['tok_s_auto']:.1f} | **{r['speedup']:.2f}x** | {r['tpot_ms_off']:.1f} | "
            f"{r['tpot_ms_auto']:.1f} | {r['tpot_ms_off'] / max(r['tpot_ms_auto'], 1e-9):.2f}x | "
            f"{r['prefill_s']:.1f} ({100 * r['prefill_share_off']:.0f}%) | {r['ceiling']:.2f}x | "
            f"{r['steps_off']} / {r['steps_auto']} | {100 * r['forced_share']:.0f}% | "
            f"{r['drafts_kept']} ({r['drafts_fed']}) | {'yes' if r['identical'] else 'NO'} | "
            f"{'yes' if r['valid'] else 'NO'} |")


if __name__ == "__main__":
    main()
