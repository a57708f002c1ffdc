"""Grammar bench: context-free mask engines side by side on the bundled grammars (``bench/grammars/``), in one run.

The MaskBench protocol (``bench/maskbench.py``, whose timing and worker code this reuses): each document is
tokenized with the default model's tokenizer; before each token the engine computes the mask, the token must be in
it, then it is committed; at the end EOS must be allowed. A grammar passes when it compiles, every valid document
is accepted to the end and every invalid one is rejected. TTFM is compile plus the first mask; TBM is each later
mask plus the commit before it. Every engine runs in its own worker process, one grammar at a time, under a
wall-clock ``--timeout`` per grammar, with no compile cache across grammars.

Engines and what each reads:

- ``corral``: the Lark grammar (the recursive JSON Schema ``tree`` as a ``json_schema`` constraint);
- ``corral-gbnf``: the GBNF twin (no twin for ``tree``);
- ``llguidance``: the Lark grammar, in its default configuration except for one policy fixed to Corral's: inline
  ``%json`` uses compact whitespace (``x-guidance: whitespace_flexible false``), as Corral's does; ``tree`` as a
  JSON Schema with ``whitespace_flexible`` false;
- ``xgrammar``: the GBNF twin as EBNF (``compile_grammar``); ``tree`` through ``compile_json_schema`` with compact
  separators.

Ratios: per grammar, Corral over llguidance on TBM p50 and p99, with their geometric means over the grammars both
ran; TTFM p50 over the grammars of Corral against xgrammar's and of ``corral-gbnf`` against xgrammar's. The CPU is
printed with the tables.

    python bench/grammars.py --engines corral,corral-gbnf,llguidance,xgrammar --out grammars-results.json
"""

import argparse
import gc
import json
import math
import os
import sys
import time
from types import SimpleNamespace

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import maskbench  # noqa: E402
from maskbench import cpu_summary, load_vocabulary, run_engine, run_schema  # noqa: E402

CORPUS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "grammars")
NAMES = ("json", "arithmetic", "sql", "c_like", "pgn", "yaml_flow", "tool_call", "tree")
ALL_ENGINES = ("corral", "corral-gbnf", "llguidance", "xgrammar")
LLG_JSON_OPTIONS = '"x-guidance": {"whitespace_flexible": false}, '


def load_corpus(names) -> list[dict]:
    entries = []
    for name in names:
        with open(os.path.join(CORPUS, f"{name}.json")) as f:
            docs = json.load(f)
        spec = {"name": name}
        if "schema" in docs:
            with open(os.path.join(CORPUS, docs["schema"])) as f:
                spec["schema"] = json.load(f)
        for ext in ("lark", "gbnf"):
            path = os.path.join(CORPUS, f"{name}.{ext}")
            if os.path.exists(path):
                with open(path) as f:
                    spec[ext] = f.read()
        tests = [{"valid": True, "text": d} for d in docs["valid"]] + \
                [{"valid": False, "text": d} for d in docs["invalid"]]
        entries.append({"id": name, "schema": spec, "tests": tests})
    return entries


# ---- engines: compile(spec) -> template; start/fill/consume as in maskbench -------------------------------------

class CorralEngine:
    source = "lark"

    def __init__(self, tokenizer, vocab, timeout_s):
        from corral.fsm.compiler import GrammarCompiler
        from corral.fsm.token_index import vocab_tables

        self.compiler = GrammarCompiler(vocab, time_budget_s=min(10.0, timeout_s), cache_bytes=64 << 20)
        vocab_tables(vocab).native_trie  # per-vocabulary tables, built once per process like the peers'

    def reset(self) -> None:
        self.compiler.clear()

    def expressible(self, spec) -> bool:
        return self.source in spec or ("schema" in spec and self.source == "lark")

    def compile(self, spec):
        from corral.grammar.constraint import Constraint

        if "schema" in spec:
            return self.compiler.compile(Constraint("json_schema", spec["schema"]))
        return self.compiler.compile(Constraint("grammar", spec[self.source]))

    def start(self, grammar):
        return grammar.new_guide()

    def fill(self, guide, row):
        guide.fill_mask(row)

    def consume(self, guide, token_id):
        return guide.advance(token_id)


class CorralGBNFEngine(CorralEngine):
    source = "gbnf"


class LLGuidanceEngine(maskbench.LLGuidanceEngine):
    def expressible(self, spec) -> bool:
        return "lark" in spec or "schema" in spec

    def compile(self, spec):
        llg = self.llg
        if "schema" in spec:
            grammar = llg.LLMatcher.grammar_from_json_schema(spec["schema"], defaults={"whitespace_flexible": False})
        else:
            grammar = llg.LLMatcher.grammar_from_lark(spec["lark"].replace("%json {", "%json {" + LLG_JSON_OPTIONS))
        matcher = llg.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher


class XGrammarEngine(maskbench.XGrammarEngine):
    def expressible(self, spec) -> bool:
        return "gbnf" in spec or "schema" in spec

    def compile(self, spec):
        if "schema" in spec:
            return self.compiler.compile_json_schema(json.dumps(spec["schema"]), any_whitespace=False,
                                                     separators=(",", ":"))
        return self.compiler.compile_grammar(spec["gbnf"])


ENGINES = {"corral": CorralEngine, "corral-gbnf": CorralGBNFEngine, "llguidance": LLGuidanceEngine,
           "xgrammar": XGrammarEngine}


def _worker(name, args, entries, connection):
    import logging

    logging.getLogger("corral").setLevel(logging.ERROR)
    tokenizer, vocab = load_vocabulary("smollm2")
    engine = ENGINES[name](tokenizer, vocab, args.timeout)
    num_words = (vocab.size + 31) // 32
    gc.collect()
    gc.freeze()  # the tokenizer's long-lived objects stay out of the collections inside timed masks
    connection.send("ready")
    while True:
        index = connection.recv()
        if index is None:
            return
        entry = entries[index]
        encoded = [(test["valid"], tokenizer.encode(test["text"])) for test in entry["tests"]]
        if not engine.expressible(entry["schema"]):  # no input for it (no GBNF twin): left out, not a failure
            connection.send({"id": entry["id"], "status": "not_expressible"})
            continue
        connection.send(run_schema(engine, entry, encoded, vocab.eos_token_ids[0], num_words))


# ---- tables -----------------------------------------------------------------------------------------------------

def _pct(values, q) -> float:
    return float(np.percentile(values, q)) if len(values) else float("nan")


def summarize(result: dict) -> dict:
    tbm = np.array(result.get("tbm_s", ())) * 1e6
    return {"status": result["status"], "accept_failures": result.get("should_accept_failures", 0),
            "reject_failures": result.get("should_reject_failures", 0),
            "ttfm_ms": result["ttfm_s"] * 1e3 if "ttfm_s" in result else float("nan"),
            "tbm_p50_us": _pct(tbm, 50), "tbm_p99_us": _pct(tbm, 99), "tbm_max_us": _pct(tbm, 100),
            "tbm_max_retimed_us": (result["tbm_retimed_max_s"] or float("nan")) * 1e6
            if result.get("tbm_retimed_max_s") is not None else float("nan"),
            "masks": int(len(tbm)), "error": result.get("error")}


def _geomean(values) -> float:
    values = [v for v in values if v > 0 and math.isfinite(v)]
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")


def print_tables(table: dict[str, dict[str, dict]]) -> None:
    print(f"CPU: {cpu_summary()}; {time.strftime('%Y-%m-%d %H:%M')}\n")
    print("| grammar | engine | passed | should accept, didn't | should reject, didn't | TTFM (ms) "
          "| TBM p50 / p99 / max (µs) | TBM max, re-timed (µs) |")
    print("|---|---|---|---|---|---|---|---|")
    for name, engines in table.items():
        for engine, s in engines.items():
            if s["status"] == "not_expressible":
                continue
            passed = "yes" if s["status"] == "passed" else s["status"]
            print(f"| {name} | {engine} | {passed} | {s['accept_failures']} | {s['reject_failures']} "
                  f"| {s['ttfm_ms']:.1f} | {s['tbm_p50_us']:.0f} / {s['tbm_p99_us']:.0f} / {s['tbm_max_us']:.0f} "
                  f"| {s['tbm_max_retimed_us']:.0f} |")
    engines = sorted({e for row in table.values() for e in row})
    print("\npasses: " + ", ".join(
        f"{e} {sum(row[e]['status'] == 'passed' for row in table.values() if e in row)}"
        f"/{sum(e in row and row[e]['status'] != 'not_expressible' for row in table.values())}" for e in engines))
    for mine, peer in (("corral", "llguidance"), ("corral-gbnf", "xgrammar"), ("corral", "xgrammar")):
        both = [n for n, row in table.items() if mine in row and peer in row
                and "passed" in (row[mine]["status"], row[peer]["status"])
                and math.isfinite(row[mine]["tbm_p50_us"]) and math.isfinite(row[peer]["tbm_p50_us"])]
        if not both:
            continue
        p50 = {n: table[n][mine]["tbm_p50_us"] / table[n][peer]["tbm_p50_us"] for n in both}
        p99 = {n: table[n][mine]["tbm_p99_us"] / table[n][peer]["tbm_p99_us"] for n in both}
        ttfm = [table[n][mine]["ttfm_ms"] for n in both], [table[n][peer]["ttfm_ms"] for n in both]
        print(f"\n{mine}/{peer} over {len(both)} grammars: TBM p50 geomean {_geomean(p50.values()):.2f}x, "
              f"p99 geomean {_geomean(p99.values()):.2f}x, worst p50 {max(p50.values()):.2f}x "
              f"({max(p50, key=p50.get)}), worst p99 {max(p99.values()):.2f}x ({max(p99, key=p99.get)}); "
              f"TTFM p50 {np.median(ttfm[0]):.1f} ms vs {np.median(ttfm[1]):.1f} ms "
              f"({np.median(ttfm[0]) / np.median(ttfm[1]):.2f}x)")
        print("  per grammar TBM p50 / p99: " + ", ".join(f"{n} {p50[n]:.2f}x / {p99[n]:.2f}x" for n in both))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engines", default=",".join(ALL_ENGINES), help="comma-separated; missing peers skip")
    parser.add_argument("--grammars", default=",".join(NAMES), help="comma-separated names from bench/grammars")
    parser.add_argument("--timeout", type=float, default=300.0, help="wall seconds per grammar and engine")
    parser.add_argument("--out", default="grammars-results.json", help="JSON result file")
    args = parser.parse_args(argv)
    entries = load_corpus(args.grammars.split(","))
    table: dict[str, dict[str, dict]] = {e["id"]: {} for e in entries}
    for name in args.engines.split(","):
        module = {"corral-gbnf": "corral"}.get(name, name)
        try:
            __import__(module)
        except ImportError:
            print(f"{name}: not installed, skipped", file=sys.stderr)
            continue
        start = time.perf_counter()
        options = SimpleNamespace(timeout=args.timeout, vocab="smollm2", baseline=None)
        for result in run_engine(name, options, entries, worker_main=_worker):
            table[result["id"]][name] = summarize(result)
        print(f"{name}: {len(entries)} grammars in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    print_tables(table)
    with open(args.out, "w") as f:
        json.dump({"cpu": cpu_summary(), "grammars": table}, f, indent=1)


if __name__ == "__main__":
    main()
