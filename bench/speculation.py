"""Drafts off against drafts on (jump-forward through forced spans, prompt-lookup speculation), in one run, on the
same requests, in the engine itself (``LLMEngine``, no HTTP), greedy.

Workloads:

- ``json``: 100 MaskBench dev schemas (the same picks as ``bench/engine.py``'s JSON cells, compact whitespace as
  the API defaults to), each with its description as the prompt, up to 192 tokens;
- ``extract``: 20 records to copy from a long prompt (a paragraph about a person among filler sentences, about 500
  tokens) into a fixed schema, up to 160 tokens;
- ``free``: 20 free-text prompts, 128 tokens (speculation only: there is no grammar to force anything).

Each runs at concurrency 1 and 16 (a closed loop: a finished request is replaced at once), drafts off and on,
taking turns (``--repeats`` times each, the order swapped each time, totals reported). Reported per cell: forward passes per output token (the steps that produced each sequence's
tokens), output tok/s, acceptance (accepted / drafted tokens), TPOT (mean over requests of their decode time per
token after the first), and the ratios on/off. A schema the compiler refuses is left out of both sides and
counted; every other request counts, whatever its finish reason.

``--check`` runs the equality check instead: greedy outputs with drafts on and off must be token-identical, for
100 dev schemas, 20 free-text prompts and 20 regex/choice constraints, alone and in batches of 16. It exits 1
on any difference. ``--row-cost`` times one sequence's step with drafts of 0-8 forced tokens: the cost of a
verified row that ``EngineConfig.draft_row_cost`` (``--draft-row-cost``) stands for.

    .venv/bin/python bench/speculation.py                        # both formats, about 25 minutes on 2 cores
    .venv/bin/python bench/speculation.py --formats auto --cells json-1,extract-1
    .venv/bin/python bench/speculation.py --check --formats auto,fp32
    .venv/bin/python bench/speculation.py --formats auto --cells free-1 --draft-layers 24   # self-speculation
    .venv/bin/python bench/speculation.py --formats auto --cells extract-1 --records-seed 8  # other records

``--masks`` runs, drafts on, the same requests with every guided row's mask filled before its step (as where a
core beside the forward fills them) and with a plain greedy row's mask deferred (filled only where its grammar
refuses the model's own token: see ``LLMEngine._deferred``), taking turns; it reports tok/s both ways, the masks
filled per output token, the engine loop's median time per step (the step less its forward and its sampler
calls, timed around each), and whether the outputs are token-identical (it exits 1 where one is not).

    .venv/bin/python bench/speculation.py --masks --formats auto --cells json-1,json-16,extract-1 --repeats 2

``--draft-model``/``--draft-layers`` add a draft model to the "on" side (prompt lookup and jump-forward first, the
draft model for the sequences they leave without a draft); ``--draft-model-cost 0`` and ``--draft-row-cost 0``
make every sequence draft whatever it costs, which measures what the draft model's tokens are worth.
"""

import argparse
import logging
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from corral.engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from corral.engine.speculation import SpecState  # noqa: E402
from corral.errors import CorralError  # noqa: E402
from corral.fsm.compiler import GrammarCompiler  # noqa: E402
from corral.grammar.constraint import Constraint  # noqa: E402
from engine import free_text, json_requests, machine_check  # noqa: E402
from servers import clocked, cpu_summary, frozen_heap  # noqa: E402

FORMATS = {"auto": dict(dtype="auto", quantization="auto", kv_cache_dtype="auto"), "fp32": dict(dtype="float32")}
OFF = dict(jump_forward=False, speculation=False)
ON = dict(jump_forward=True, speculation=True)

FIRST = "Alice Maria Jonas Wei Priya Tomasz Aiko Omar Lucia Henrik Fatima Diego Ingrid Kofi Mei Rafael".split()
LAST = "Okafor Lindqvist Tanaka Moreau Castillo Novak Haddad Brennan Sato Kowalski Mensah Ferreira".split()
CITIES = "Lisbon Osaka Nairobi Toronto Krakow Valparaiso Tromso Adelaide Marseille Hanoi".split()
ROLES = ["senior data engineer", "head of procurement", "pediatric nurse", "marine biologist",
         "structural engineer", "public defender", "sous chef", "museum archivist"]
FILLER = ["The quarterly report was filed on time and reviewed by the committee.",
          "Several attendees mentioned that the venue was hard to find.",
          "Weather conditions delayed two of the scheduled deliveries.",
          "The new policy takes effect at the start of next month.",
          "Minutes of the previous meeting were approved without changes.",
          "A reminder was sent about the upcoming maintenance window."]
EXTRACT_SCHEMA = {"type": "object", "additionalProperties": False,
                  "required": ["full_name", "email", "phone", "city", "employer", "job_title", "quote"],
                  "properties": {"full_name": {"type": "string"}, "email": {"type": "string"},
                                 "phone": {"type": "string"}, "city": {"type": "string"},
                                 "employer": {"type": "string"}, "job_title": {"type": "string"},
                                 "quote": {"type": "string"}}}
REGEXES = [r"\d{3}-\d{3}-\d{4}", r"[A-Z][a-z]+ [A-Z][a-z]+", r"(19|20)\d\d-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])",
           r"[a-z]+@[a-z]+\.(com|org|net)", r"(\d{1,3}\.){3}\d{1,3}", r"#[0-9a-f]{6}", r"(yes|no), because [a-z ]{5,40}\.",
           r"[A-Z]{3}-\d{4}", r"\$\d{1,5}\.\d\d", r"https://www\.[a-z]{3,12}\.com/[a-z]{1,10}"]
CHOICES = [["positive", "negative", "neutral"], ["Paris", "London", "Berlin", "Madrid"], ["red", "green", "blue"],
           ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
            "November", "December"], ["cat", "dog", "bird", "fish"], ["true", "false"],
           ["Python", "JavaScript", "Rust", "Go", "C++"], ["small", "medium", "large", "extra large"],
           ["north", "south", "east", "west"], ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday"]]
CHOICE_QUESTIONS = ["Is the sentiment of 'I loved it' positive, negative or neutral?", "Which city is in France?",
                    "Name a color of the sky.", "Which month comes after March?", "Which animal barks?",
                    "Is water wet? Answer true or false.", "Which language has a borrow checker?",
                    "What size is an elephant?", "Where does the sun rise?", "Which day follows Monday?"]


@dataclass
class Job:
    name: str
    messages: list[dict]
    max_tokens: int
    constraint: Constraint | None = None


@dataclass
class Cell:
    workload: str
    concurrency: int
    jobs: list[Job]

    @property
    def name(self) -> str:
        return f"{self.workload}-{self.concurrency}"


@dataclass
class Run:
    wall: float
    tokens: list[list[int]]
    passes: int
    drafted: int
    accepted: int
    forced: int
    tpots: list[float]

    @property
    def num_tokens(self) -> int:
        return sum(len(t) for t in self.tokens)


# ---- workloads ------------------------------------------------------------------------------------------------
def json_jobs(num: int = 100) -> list[Job]:
    return [Job(f"schema {i}", r.messages, r.max_tokens, Constraint("json_schema", r.schema))
            for i, r in enumerate(json_requests(num))]


RECORDS_SEED = 7  # the extraction records the README's table was measured on


def extract_jobs(num: int = 20, seed: int = RECORDS_SEED) -> list[Job]:
    rng = random.Random(seed)
    jobs = []
    for i in range(num):
        first, last, city = rng.choice(FIRST), rng.choice(LAST), rng.choice(CITIES)
        employer = f"{rng.choice(LAST)} {rng.choice(['Logistics', 'Analytics', 'Health', 'Maritime', 'Foods'])}"
        role = rng.choice(ROLES)
        email = f"{first.lower()}.{last.lower()}@{employer.split()[0].lower()}.com"
        phone = f"+{rng.randint(1, 99)} {rng.randint(100, 999)} {rng.randint(100, 999)} {rng.randint(1000, 9999)}"
        quote = f"We moved the {rng.choice(['archive', 'clinic', 'kitchen', 'lab'])} to {city} because the " \
                f"{rng.choice(['rent', 'harbor', 'light', 'people'])} made it worth it."
        facts = [f"{first} {last} works as a {role} at {employer}.", f"{first} lives in {city}.",
                 f"Their email address is {email} and their phone number is {phone}.",
                 f"Asked about the move, {first} said: \"{quote}\""]
        body = []
        for fact in facts:
            body.extend(rng.sample(FILLER, 3))
            body.append(fact)
        text = " ".join(body * 2)  # repeated: a long record, as real ones are
        prompt = (f"Record {i}:\n{text}\n\nExtract full_name, email, phone, city, employer, job_title and quote "
                  "(the sentence they said, verbatim) from the record above as JSON.")
        jobs.append(Job(f"record {i}", [{"role": "user", "content": prompt}], 160,
                        Constraint("json_schema", EXTRACT_SCHEMA)))
    return jobs


def free_jobs(num: int = 20) -> list[Job]:
    return [Job(f"prompt {i}", r.messages, 128) for i, r in enumerate(free_text("speculation", num, seed=11))]


def constraint_jobs() -> list[Job]:
    jobs = [Job(f"regex {p}", [{"role": "user", "content": f"Write one example that matches {p}."}], 48,
                Constraint("regex", p)) for p in REGEXES]
    jobs += [Job(f"choice {c[0]}..", [{"role": "user", "content": q}], 16, Constraint("choice", c))
             for c, q in zip(CHOICES, CHOICE_QUESTIONS)]
    return jobs


# ---- running --------------------------------------------------------------------------------------------------
class Bench:
    def __init__(self, fmt: str, **drafts):
        """``drafts``: EngineConfig's draft settings (a draft model, its cost, the row cost)."""
        self.fmt = fmt
        self.engine = LLMEngine(EngineConfig(**FORMATS[fmt], **drafts))
        self.compiler = GrammarCompiler(self.engine.vocabulary)
        self.refused: dict[str, str] = {}
        self._grammars = {}

    def usable(self, jobs: list[Job]) -> list[Job]:
        """The jobs whose constraint compiles (compiled here, outside any timed window)."""
        kept = []
        for job in jobs:
            if job.constraint is None:
                kept.append(job)
                continue
            try:
                self._grammars[job.name] = self.compiler.compile(job.constraint)
                kept.append(job)
            except CorralError as exc:
                self.refused[job.name] = type(exc).__name__
        return kept

    def run(self, jobs: list[Job], concurrency: int, switches: dict) -> Run:
        engine, tokenizer = self.engine, self.engine.tokenizer
        engine.block_manager.reset_prefix_cache()  # both sides start cold: no prompt is cached from the other
        pending = list(enumerate(jobs))
        prompts = [tokenizer.encode(tokenizer.apply_chat_template(job.messages)) for job in jobs]
        tokens: list[list[int] | None] = [None] * len(jobs)
        tpots, passes, drafted, accepted, forced = [], 0, 0, 0, 0
        in_flight = 0
        with frozen_heap():  # no full collection inside, as in the server
            start = time.perf_counter()
            while pending or in_flight:
                while pending and in_flight < concurrency:
                    i, job = pending.pop(0)
                    guide = self._grammars[job.name].new_guide() if job.constraint is not None else None
                    params = SamplingParams(temperature=0, max_tokens=job.max_tokens, **switches)
                    engine.add_request(f"{self.fmt}-{i}-{time.monotonic_ns()}", prompts[i], params, guide=guide)
                    in_flight += 1
                for output in engine.step():
                    if not output.finished:
                        continue
                    in_flight -= 1
                    i = int(output.request_id.split("-")[1])
                    out = output.outputs[0]
                    tokens[i] = list(out.token_ids)
                    passes += out.num_forward_passes
                    drafted += out.num_draft_tokens
                    accepted += out.num_accepted_tokens
                    forced += out.num_forced_tokens
                    m = output.metrics
                    if m.first_token_time is not None and m.finished_time is not None and len(out.token_ids) > 1:
                        tpots.append((m.finished_time - m.first_token_time) / (len(out.token_ids) - 1))
            wall = time.perf_counter() - start
        return Run(wall, tokens, passes, drafted, accepted, forced, tpots)


def cells_for(names: list[str], records_seed: int = RECORDS_SEED) -> list[Cell]:
    makers = {"json": json_jobs, "extract": lambda: extract_jobs(seed=records_seed), "free": free_jobs}
    cells = []
    for name in names:
        workload, concurrency = name.rsplit("-", 1)
        cells.append(Cell(workload, int(concurrency), makers[workload]()))
    return cells


def report(fmt: str, cell: Cell, off: Run, on: Run) -> str:
    def passes_per_token(r: Run) -> float:
        return r.passes / max(1, r.num_tokens)

    def tpot(r: Run) -> float:
        return statistics.mean(r.tpots) * 1e3 if r.tpots else float("nan")

    same = sum(a == b for a, b in zip(off.tokens, on.tokens))
    acceptance = on.accepted / on.drafted if on.drafted else float("nan")
    return (f"| {fmt} | {cell.name} | {len(cell.jobs)} | {passes_per_token(off):.3f} | "
            f"{passes_per_token(on):.3f} | **{passes_per_token(off) / passes_per_token(on):.2f}x** | "
            f"{off.num_tokens / off.wall:.1f} | {on.num_tokens / on.wall:.1f} | "
            f"**{(on.num_tokens / on.wall) / (off.num_tokens / off.wall):.2f}x** | {acceptance:.2f} "
            f"({on.forced}/{on.accepted}/{on.drafted}) | {tpot(off):.2f} | {tpot(on):.2f} | "
            f"{same}/{len(off.tokens)} |")


def draft_model_counts(engine) -> tuple[int, int, int]:
    """(draft-model tokens accepted, drafted, draft-model forwards) so far, over the engine's whole life."""
    stats = engine.stats()
    return stats.num_model_accepted_tokens, stats.num_model_draft_tokens, stats.num_draft_model_forwards


def merged(runs: list[Run]) -> Run:
    """Several runs of the same jobs as one: walls, counts, tokens and TPOTs added up."""
    return Run(sum(r.wall for r in runs), [t for r in runs for t in r.tokens], sum(r.passes for r in runs),
               sum(r.drafted for r in runs),
               sum(r.accepted for r in runs), sum(r.forced for r in runs), [t for r in runs for t in r.tpots])


def bench(formats: list[str], cell_names: list[str], repeats: int = 1, drafts: dict | None = None,
          records_seed: int = RECORDS_SEED) -> None:
    print(f"machine: {cpu_summary()}")
    if records_seed != RECORDS_SEED:
        print(f"extraction records drawn with seed {records_seed}")
    if drafts:
        print(f"draft settings: {drafts}")
    print("| format | cell | requests | passes/token off | on | fewer passes | tok/s off | on | speed-up | "
          "acceptance (forced/accepted/drafted) | TPOT ms off | on | identical |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for fmt in formats:
        b = Bench(fmt, **(drafts or {}))
        b.run(free_jobs(2), 1, OFF)  # warm-up: the first steps of a fresh engine are slower
        for cell in cells_for(cell_names, records_seed):
            jobs = b.usable(cell.jobs)
            refused = len(cell.jobs) - len(jobs)
            cell = Cell(cell.workload, cell.concurrency, jobs)
            switches = dict(ON) if cell.workload != "free" else dict(jump_forward=False, speculation=True)
            check = machine_check()
            offs, ons = [], []
            before = draft_model_counts(b.engine)
            for i in range(repeats):  # taking turns, the order swapped each time
                for side in ((OFF, offs), (switches, ons))[:: 1 if i % 2 == 0 else -1]:
                    side[1].append(b.run(jobs, cell.concurrency, side[0]))
            off, on = merged(offs), merged(ons)
            # this cell's own counts: the engine's counters run on across cells
            kept, drafted, forwards = (n - m for n, m in zip(draft_model_counts(b.engine), before))
            models = (f"; draft model: {kept}/{drafted} accepted, {forwards} forwards"
                      if b.engine.model_drafter is not None else "")
            print(report(fmt, cell, off, on) + f" {check}; refused {refused}{models}", flush=True)


def check(formats: list[str], max_tokens: int | None, drafts: dict | None = None) -> int:
    print(f"machine: {cpu_summary()}")
    failures = 0
    for fmt in formats:
        b = Bench(fmt, **(drafts or {}))
        jobs = b.usable(json_jobs() + free_jobs() + constraint_jobs())
        if max_tokens:
            jobs = [Job(j.name, j.messages, min(j.max_tokens, max_tokens), j.constraint) for j in jobs]
        for concurrency in (1, 16):
            started = time.perf_counter()
            off = b.run(jobs, concurrency, OFF)
            on = b.run(jobs, concurrency, ON)
            bad = [job.name for job, a, c in zip(jobs, off.tokens, on.tokens) if a != c]
            failures += len(bad)
            print(f"{fmt} concurrency {concurrency}: {len(jobs) - len(bad)}/{len(jobs)} identical "
                  f"({len(b.refused)} schemas refused at compile, left out); passes {off.passes} -> {on.passes}; "
                  f"{time.perf_counter() - started:.0f} s" + (f"; differ: {bad}" if bad else ""), flush=True)
    return 1 if failures else 0


def masks(formats: list[str], cell_names: list[str], repeats: int = 1) -> int:
    """Masks filled before every step against deferred masks, drafts on, in one run: see the module's text."""
    from corral.engine.sampler import Sampler
    from corral.fsm.cfg_guide import CFGGuide
    from corral.fsm.fsm_guide import FSMGuide
    filled, side = {False: 0, True: 0}, [False]
    inner, loops = [0.0], {False: [], True: []}  # forward and sampler time; per step, the rest

    Sampler.__call__, Sampler.verify = clocked(Sampler.__call__, inner), clocked(Sampler.verify, inner)

    def counting(fill_mask):
        def fill(self, row):
            filled[side[0]] += 1
            fill_mask(self, row)
        return fill
    for guide_class in (FSMGuide, CFGGuide):  # every mask a guided row fills, either way, counted by side
        guide_class.fill_mask = counting(guide_class.fill_mask)
    print(f"machine: {cpu_summary()}")
    print("| format | cell | requests | tok/s masks first | deferred | speed-up | masks per token, first | deferred | "
          "loop us/step, first | deferred | identical |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    failures = 0
    for fmt in formats:
        b = Bench(fmt)
        runner, step = b.engine.runner, b.engine.step
        runner.execute, runner.execute_burst = clocked(runner.execute, inner), clocked(runner.execute_burst, inner)
        runner.execute_picking = clocked(runner.execute_picking, inner)  # a step whose picks the native call makes

        def timed_step():
            start, before = time.perf_counter(), inner[0]
            try:
                return step()
            finally:
                loops[side[0]].append(time.perf_counter() - start - (inner[0] - before))
        b.engine.step = timed_step
        b.run(free_jobs(2), 1, OFF)  # warm-up
        for cell in cells_for(cell_names):
            jobs = b.usable(cell.jobs)
            runs = {False: [], True: []}
            counts = {False: 0, True: 0}
            loops[False].clear()
            loops[True].clear()
            check = machine_check()
            for i in range(repeats):  # taking turns, the order swapped each time
                for defer in (False, True)[:: 1 if i % 2 == 0 else -1]:
                    b.engine.defer_masks, side[0] = defer, defer
                    before = filled[defer]
                    runs[defer].append(b.run(jobs, cell.concurrency, ON))
                    counts[defer] += filled[defer] - before
            first, deferred = merged(runs[False]), merged(runs[True])
            same = sum(a == c for a, c in zip(first.tokens, deferred.tokens))
            failures += len(first.tokens) - same
            rate = {d: (r.num_tokens / r.wall) for d, r in ((False, first), (True, deferred))}
            print(f"| {fmt} | {cell.name} | {len(jobs)} | {rate[False]:.1f} | {rate[True]:.1f} | "
                  f"**{rate[True] / rate[False]:.2f}x** | {counts[False] / max(1, first.num_tokens):.2f} | "
                  f"{counts[True] / max(1, deferred.num_tokens):.2f} | {statistics.median(loops[False]) * 1e6:.0f} | "
                  f"{statistics.median(loops[True]) * 1e6:.0f} | {same}/{len(first.tokens)} | {check}; "
                  f"refused {len(cell.jobs) - len(jobs)}", flush=True)
        b.engine.defer_masks = None
    return 1 if failures else 0


def row_cost(formats: list[str]) -> None:
    """One sequence, a fixed forced draft of k tokens each step (the last token repeated, a free-text request
    so the model decides what it accepts): mean step time by k, against k = 0."""
    print(f"machine: {cpu_summary()}")
    for fmt in formats:
        b = Bench(fmt)
        engine = b.engine
        times = {}
        for k in (0, 1, 2, 4, 8):
            def propose(k=k):
                for seq in engine.scheduler.running:
                    if seq.num_uncomputed_tokens == 1:
                        seq.draft, seq.num_draft_forced = [seq.token_ids[-1]] * k, 0
                        seq.spec = seq.spec or SpecState()
            engine._propose_drafts = propose
            engine.add_request(f"row-{k}", engine.tokenizer.encode("Once upon a time"),
                               SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
            samples = []
            while engine.has_unfinished_requests():
                t = time.perf_counter()
                engine.step()
                samples.append(time.perf_counter() - t)
            times[k] = statistics.median(samples[2:])
        base = times[0]
        print(f"{fmt}: step at k draft rows (median ms): " +
              ", ".join(f"k={k}: {t * 1e3:.2f}" for k, t in times.items()) +
              "; per extra row / step at k=0: " +
              ", ".join(f"k={k}: {(t - base) / k / base:.3f}" for k, t in times.items() if k))


def main() -> None:
    logging.getLogger("corral.fsm.compiler").setLevel(logging.ERROR)  # schema warnings are not this bench's news
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--formats", default="auto,fp32")
    parser.add_argument("--cells", default="json-1,extract-1,free-1,json-16,extract-16,free-16")
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--max-tokens", type=int, default=None, help="--check: cap every request's output")
    parser.add_argument("--row-cost", action="store_true")
    parser.add_argument("--masks", action="store_true", help="masks filled first against deferred masks")
    parser.add_argument("--repeats", type=int, default=1, help="runs per side and cell, taking turns")
    parser.add_argument("--draft-model", default=None, help="drafts from this model too (same vocabulary)")
    parser.add_argument("--draft-layers", type=int, default=None,
                        help="the draft model's first this many layers; alone: the target's (self-speculation)")
    parser.add_argument("--draft-model-cost", type=float, default=None,
                        help="a draft step's price as a share of a target step (default: weight bytes; 0 drafts "
                             "whatever the acceptance, to measure the mechanism)")
    parser.add_argument("--draft-row-cost", type=float, default=None)
    parser.add_argument("--num-speculative-tokens", type=int, default=None, help="the most lookup tokens per step")
    parser.add_argument("--records-seed", type=int, default=RECORDS_SEED,
                        help="draws the extraction cells' 20 records (people, places, quotes) with this seed")
    args = parser.parse_args()
    formats = args.formats.split(",")
    drafts = {name: value for name, value in (("draft_model", args.draft_model), ("draft_layers", args.draft_layers),
                                              ("draft_model_cost", args.draft_model_cost),
                                              ("draft_row_cost", args.draft_row_cost),
                                              ("num_speculative_tokens", args.num_speculative_tokens))
              if value is not None}
    if args.check:
        sys.exit(check(formats, args.max_tokens, drafts))
    if args.row_cost:
        return row_cost(formats)
    if args.masks:
        sys.exit(masks(formats, args.cells.split(","), args.repeats))
    bench(formats, args.cells.split(","), args.repeats, drafts, args.records_seed)


if __name__ == "__main__":
    main()
