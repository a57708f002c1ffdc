"""End to end: dev schemas through the live OpenAI-compatible server, against llama-cpp-python's JSON-schema grammar.

Each schema becomes one chat request: the prompt is the schema's ``description`` (or a generic request when it
has none), ``response_format`` is the schema itself, decoding is greedy. Corral gets all requests at once
through its server (``--concurrency`` clients, continuous batching); llama-cpp-python runs them one at a time,
as it serves, on the same GGUF file and threads. For both it reports:

- valid: of the outputs that ended with ``finish_reason == "stop"``, the share that ``jsonschema`` accepts (the
  target is 100%; a schema ``jsonschema`` itself cannot use is counted apart as ``unchecked``);
- truncated: the share of all requests cut by ``max_tokens``;
- compile errors grouped by the schema keyword the error names (Corral) or the exception (llama-cpp-python);
- throughput: output tokens per second over the whole run, and the median request latency.

    python bench/e2e.py [--limit 200] [--max-tokens 128] [--concurrency 16] [--base-url URL] [--no-llama] [--peer-timeout S]
"""

import argparse
import asyncio
import collections
import gzip
import json
import os
import re
import statistics
import sys
import time

import jsonschema

DEFAULT_DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "shared", "data",
                            "maskbench-dev.jsonl.gz")
_KEYWORD = re.compile(r"\(keyword '([^']+)' at")


def load_schemas(path: str, limit: int) -> list[dict]:
    """``limit`` entries spread evenly over the file (it is grouped by source, so a stride samples them all)."""
    with gzip.open(path, "rt") as f:
        entries = [json.loads(line) for line in f]
    stride = max(1, len(entries) // limit)
    return entries[::stride][:limit]


def prompt_of(schema) -> str:
    described = schema.get("description") if isinstance(schema, dict) else None
    if isinstance(described, str) and described.strip():
        return f"{described.strip()[:600]}\nAnswer with one JSON value."
    return "Produce one JSON value that fits the expected structure."


class Outcome:
    def __init__(self, schema_id: str):
        self.schema_id, self.finish, self.text, self.error, self.tokens, self.seconds = schema_id, None, "", None, 0, 0.0


def verdict(outcome: Outcome, schema) -> str:
    """'valid', 'invalid' or 'unchecked' for a stopped output."""
    try:
        value = json.loads(outcome.text)
    except json.JSONDecodeError:
        return "invalid"
    try:
        jsonschema.validate(value, schema)
    except jsonschema.ValidationError:
        return "invalid"
    except (jsonschema.SchemaError, jsonschema.exceptions.RefResolutionError, Exception):  # noqa: B014
        return "unchecked"
    return "valid"


async def corral_one(client, model: str, entry: dict, max_tokens: int, gate: asyncio.Semaphore) -> Outcome:
    import openai

    outcome = Outcome(entry["id"])
    async with gate:
        start = time.perf_counter()
        try:
            response = await client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": prompt_of(entry["schema"])}], temperature=0,
                max_tokens=max_tokens,
                response_format={"type": "json_schema", "json_schema": {"name": "out", "schema": entry["schema"]}})
            choice = response.choices[0]
            outcome.finish, outcome.text = choice.finish_reason, choice.message.content or ""
            outcome.tokens = response.usage.completion_tokens
        except openai.BadRequestError as err:
            message = err.body.get("message", "") if isinstance(err.body, dict) else str(err)
            match = _KEYWORD.search(message)
            outcome.error = match.group(1) if match else message[:60]
        outcome.seconds = time.perf_counter() - start
    return outcome


async def run_corral(base_url: str, entries: list[dict], max_tokens: int, concurrency: int) -> list[Outcome]:
    import openai

    client = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=3600)
    try:
        model = (await client.models.list()).data[0].id
        gate = asyncio.Semaphore(concurrency)
        return list(await asyncio.gather(*(corral_one(client, model, e, max_tokens, gate) for e in entries)))
    finally:
        await client.close()


_LLAMA = None  # the worker process's model


def _load_llama(threads: int) -> None:
    global _LLAMA
    from llama_cpp import Llama

    from corral.models import resolve_model

    _LLAMA = Llama(model_path=resolve_model().path, n_ctx=2048, n_threads=threads, verbose=False)


def _llama_one(entry: dict, max_tokens: int) -> Outcome:
    outcome = Outcome(entry["id"])
    start = time.perf_counter()
    try:
        response = _LLAMA.create_chat_completion(
            messages=[{"role": "user", "content": prompt_of(entry["schema"])}], temperature=0,
            max_tokens=max_tokens, response_format={"type": "json_object", "schema": entry["schema"]})
        choice = response["choices"][0]
        outcome.finish, outcome.text = choice["finish_reason"], choice["message"]["content"] or ""
        outcome.tokens = response["usage"]["completion_tokens"]
    except Exception as err:  # llama-cpp-python raises plain exceptions for schemas it cannot convert
        outcome.error = f"{type(err).__name__}: {str(err)[:50]}"
    outcome.seconds = time.perf_counter() - start
    return outcome


def run_llama(entries: list[dict], max_tokens: int, threads: int, timeout_s: float) -> list[Outcome]:
    """llama-cpp-python, one request at a time, in a worker process: a native crash on one schema (seen: the
    worker died on 4 of the first 140 dev schemas) or a request running past ``timeout_s`` (seen: one ran for
    over 15 minutes) is recorded as that schema's error, and a fresh worker goes on with the rest."""
    import concurrent.futures
    import multiprocessing

    outcomes, pending = [], list(entries)
    while pending:
        with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"),
                                                    initializer=_load_llama, initargs=(threads,)) as pool:
            try:
                while pending:
                    outcomes.append(pool.submit(_llama_one, pending[0], max_tokens).result(timeout=timeout_s))
                    pending.pop(0)
                    if len(outcomes) % 20 == 0:
                        print(f"llama-cpp-python: {len(outcomes)}/{len(entries)}", file=sys.stderr, flush=True)
            except (concurrent.futures.process.BrokenProcessPool, concurrent.futures.TimeoutError) as err:
                failed = Outcome(pending.pop(0)["id"])
                timed_out = isinstance(err, concurrent.futures.TimeoutError)
                failed.error = f"timeout: over {timeout_s:g} s" if timed_out else "crash: the worker process died"
                print(f"llama-cpp-python {failed.error} on {failed.schema_id}", file=sys.stderr, flush=True)
                outcomes.append(failed)
                for process in list(pool._processes.values()):  # a stalled worker would hold the pool's exit
                    process.kill()
    return outcomes


def summarize(name: str, outcomes: list[Outcome], schemas: dict, wall_s: float) -> dict:
    stopped = [o for o in outcomes if o.error is None and o.finish == "stop"]
    verdicts = collections.Counter(verdict(o, schemas[o.schema_id]) for o in stopped)
    checked = verdicts["valid"] + verdicts["invalid"]
    tokens = sum(o.tokens for o in outcomes)
    latencies = [o.seconds for o in outcomes if o.error is None]
    return {
        "engine": name, "requests": len(outcomes), "stop": len(stopped),
        "valid_of_stop": f"{verdicts['valid']}/{checked}" + (f" (+{verdicts['unchecked']} unchecked)"
                                                             if verdicts["unchecked"] else ""),
        "valid_pct": 100.0 * verdicts["valid"] / checked if checked else float("nan"),
        "truncated_pct": 100.0 * sum(o.finish == "length" for o in outcomes) / len(outcomes),
        "compile_errors": dict(collections.Counter(o.error for o in outcomes if o.error).most_common()),
        "output_tok_s": tokens / wall_s, "median_latency_s": statistics.median(latencies) if latencies else None,
        "wall_s": wall_s, "invalid_ids": [o.schema_id for o in stopped if verdict(o, schemas[o.schema_id]) ==
                                          "invalid"][:10],
    }


def print_table(rows: list[dict]) -> None:
    print("| engine | requests | stop | valid of stop | truncated | errors (compile, crash, timeout) | output tok/s | median latency |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        errors = sum(r["compile_errors"].values())
        print(f"| {r['engine']} | {r['requests']} | {r['stop']} | {r['valid_of_stop']} ({r['valid_pct']:.1f}%) | "
              f"{r['truncated_pct']:.1f}% | {errors} | {r['output_tok_s']:.1f} | {r['median_latency_s']:.2f} s |")
    for r in rows:
        print(f"\n{r['engine']} errors by keyword or exception: {r['compile_errors'] or 'none'}")
        if r["invalid_ids"]:
            print(f"{r['engine']} invalid outputs (first ids): {r['invalid_ids']}")


def start_server(max_model_len: int, threads: int | None):
    from corral.api.launch import ServeOptions, build_context, build_engine, serve_in_background
    from corral.engine import EngineConfig

    engine = build_engine(EngineConfig(max_model_len=max_model_len, num_threads=threads))
    return serve_in_background(build_context(engine, options=ServeOptions()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("data", nargs="?", default=DEFAULT_DATA)
    parser.add_argument("--limit", type=int, default=200)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--base-url", default=None, help="a running Corral server (default: start one here)")
    parser.add_argument("--no-llama", action="store_true")
    parser.add_argument("--peer-timeout", type=float, default=120.0, help="seconds per llama-cpp-python request")
    parser.add_argument("--out", default=None, help="write the summaries as JSON")
    args = parser.parse_args()
    entries = load_schemas(args.data, args.limit)
    schemas = {e["id"]: e["schema"] for e in entries}
    rows = []
    server = None if args.base_url else start_server(2048, args.threads)
    base_url = args.base_url or server.__enter__()
    try:
        start = time.perf_counter()
        outcomes = asyncio.run(run_corral(base_url, entries, args.max_tokens, args.concurrency))
        rows.append(summarize("corral (server)", outcomes, schemas, time.perf_counter() - start))
        print(json.dumps(rows[-1]), flush=True)  # kept if the peer crashes later
    finally:
        if server is not None:
            server.__exit__(None, None, None)
    if not args.no_llama:
        try:
            import llama_cpp  # noqa: F401
        except ImportError:
            print("llama-cpp-python is not installed (make bench-extras); skipping it", file=sys.stderr)
        else:
            start = time.perf_counter()
            outcomes = run_llama(entries, args.max_tokens, args.threads, args.peer_timeout)
            rows.append(summarize("llama-cpp-python", outcomes, schemas, time.perf_counter() - start))
            print(json.dumps(rows[-1]), flush=True)
    print_table(rows)
    if len(rows) == 2 and rows[1]["output_tok_s"]:
        print(f"\nthroughput ratio corral / llama-cpp-python: {rows[0]['output_tok_s'] / rows[1]['output_tok_s']:.2f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
