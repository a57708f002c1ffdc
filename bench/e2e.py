"""End to end: dev schemas through Corral's server and llama.cpp's ``llama-server``, the same requests, the same
client, in one run.

Each schema becomes one chat request: the prompt is the schema's ``description`` (or a generic request when it
has none), ``response_format`` is the schema itself, decoding is greedy, at most ``--max-tokens`` tokens. Both
servers get ``--concurrency`` clients at once: Corral batches continuously, llama-server runs that many parallel
slots (continuous batching on). Whitespace is allowed on both sides, by the same rule: llama.cpp's JSON
grammar allows a space, or one or two newlines and up to 20 spaces or tabs, between tokens, and so does Corral's
``indented`` policy (``disable_any_whitespace: false``). Objects: both
servers generate only the declared properties of an object that declares some and says nothing of
``additionalProperties`` (Corral's default, ``disable_additional_properties``); Corral also runs with the
standard's default there, undeclared members allowed (``--objects``: "corral-standard", the same server taking each
turn twice, the two ways alternating which goes first). Each server
answers one small constrained request, unlike any measured one, before the clock starts. The schemas go in chunks, the engines taking turns
chunk by chunk, so a slow minute on this shared machine hits both; servers are started (models loaded) before
any clock runs. A server that dies is restarted, and the request it was serving counts as a crash.

Reported per engine, over **all** requests: valid (a finished output that ``jsonschema`` accepts), invalid,
truncated (``finish_reason: length``), refused (the server answered 400 or 422: a schema it cannot enforce), crashed,
other (any other finish or HTTP status), and validity over the finished outputs too; plus output tokens per
second over the run and the median latency of the answered requests (refusals are fast and left out).

    python bench/e2e.py [--limit 200] [--max-tokens 128] [--concurrency 16] [--chunk 50]
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

import httpx
import jsonschema

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from servers import (LLAMA_SERVER, closed_loop, corral_server, cpu_summary, dropped_kind,  # noqa: E402
                     llama_server, llama_server_version)

DEFAULT_DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "shared", "data",
                            "maskbench-dev.jsonl.gz")
MODEL = "SmolLM2-135M-Instruct"
_KEYWORD = re.compile(r"\(keyword '([^']+)' at")


def load_schemas(path: str, limit: int, offset: int = 0) -> list[dict]:
    """``limit`` entries spread evenly over the file (it is grouped by source, so a stride samples them all),
    from its ``offset``-th entry: offsets below the stride give disjoint samples."""
    with gzip.open(path, "rt") as f:
        entries = [json.loads(line) for line in f]
    stride = max(1, len(entries) // limit)
    return entries[offset::stride][:limit]


def prompt_of(schema) -> str:
    described = schema.get("description") if isinstance(schema, dict) else None
    if isinstance(described, str) and described.strip():
        return f"{described.strip()[:600]}\nAnswer with one JSON value."
    return "Produce one JSON value that fits the expected structure."


class Outcome:
    def __init__(self, schema_id: str):
        self.schema_id, self.kind, self.text, self.detail, self.tokens, self.seconds = schema_id, "", "", "", 0, 0.0
        self.dropped: str | None = None  # the connection failed before a response: see servers.closed_loop


def classify(outcome: Outcome, finish: str, schema) -> str:
    if finish == "length":
        return "truncated"
    if finish != "stop":
        return "other"
    try:
        jsonschema.validate(json.loads(outcome.text), schema)
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return "invalid"
    except Exception:  # noqa: BLE001 - a schema jsonschema itself cannot use
        return "unchecked"
    return "valid"


async def one(client: httpx.AsyncClient, url: str, engine: str, entry: dict, max_tokens: int) -> Outcome:
    outcome = Outcome(entry["id"])
    body = {"model": MODEL, "messages": [{"role": "user", "content": prompt_of(entry["schema"])}], "temperature": 0,
            "max_tokens": max_tokens,
            "response_format": {"type": "json_schema", "json_schema": {"name": "out", "schema": entry["schema"]}}}
    if engine.startswith("corral"):
        body["structured_outputs"] = {"disable_any_whitespace": False,
                                      "disable_additional_properties": engine != "corral-standard"}
    start = time.perf_counter()
    try:
        response = await client.post(url + "/v1/chat/completions", json=body)
    except httpx.HTTPError as err:
        outcome.kind, outcome.detail = "crashed", f"{type(err).__name__}"
        outcome.dropped = dropped_kind(err)
    else:
        if response.status_code in (400, 422):
            message = response.text
            try:
                message = response.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                pass
            match = _KEYWORD.search(message)
            outcome.kind, outcome.detail = "refused", (match.group(1) if match else message[:60])
        elif response.status_code != 200:
            outcome.kind, outcome.detail = "other", f"HTTP {response.status_code}"
        else:
            try:
                data = response.json()
                choice = data["choices"][0]
                outcome.text = choice["message"].get("content") or ""
                outcome.tokens = data.get("usage", {}).get("completion_tokens", 0)
            except (ValueError, KeyError, IndexError, TypeError, AttributeError) as err:
                outcome.kind, outcome.detail = "other", f"malformed response: {type(err).__name__}"
            else:
                outcome.kind = classify(outcome, choice.get("finish_reason"), entry["schema"])
    outcome.seconds = time.perf_counter() - start
    return outcome


async def run_chunk(server, engine: str, entries: list[dict], max_tokens: int,
                    concurrency: int) -> tuple[list[Outcome], float]:
    """One chunk through ``concurrency`` closed-loop clients (``servers.closed_loop``: a dropped connection is
    retried, a dead server restarted off the clock, the requests it was serving counted as crashes)."""
    async def send(client, entry):
        outcome = await one(client, server.url, engine, entry, max_tokens)
        return outcome, outcome.dropped

    def crashed(outcome: Outcome) -> Outcome:
        outcome.detail = "the server died"
        return outcome

    outcomes, wall, _ = await closed_loop(server, entries, concurrency, send, crashed)
    return outcomes, wall


def summarize(name: str, outcomes: list[Outcome], wall_s: float) -> dict:
    kinds = collections.Counter(o.kind for o in outcomes)
    finished = kinds["valid"] + kinds["invalid"]
    return {
        "engine": name, "requests": len(outcomes), "kinds": dict(kinds),
        "valid_of_all": f"{kinds['valid']}/{len(outcomes)}", "valid_of_finished": f"{kinds['valid']}/{finished}",
        "refusals": dict(collections.Counter(o.detail for o in outcomes if o.kind == "refused").most_common()),
        "output_tok_s": sum(o.tokens for o in outcomes) / wall_s,
        "median_latency_s": statistics.median([o.seconds for o in outcomes if o.kind in ("valid", "invalid",
                                                                                          "truncated")] or [0.0]),
        "wall_s": wall_s,
        "invalid_ids": [o.schema_id for o in outcomes if o.kind == "invalid"][:10],
    }


def print_table(rows: list[dict]) -> None:
    print("| engine | requests | valid (of all) | valid of finished | invalid | truncated | refused | crashed "
          "| unchecked | other | output tok/s | median latency (answered) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        k = r["kinds"]
        print(f"| {r['engine']} | {r['requests']} | **{r['valid_of_all']}** | {r['valid_of_finished']} "
              f"| {k.get('invalid', 0)} | {k.get('truncated', 0)} | {k.get('refused', 0)} | {k.get('crashed', 0)} "
              f"| {k.get('unchecked', 0)} | {k.get('other', 0)} | {r['output_tok_s']:.1f} "
              f"| {r['median_latency_s']:.2f} s |")
    for r in rows:
        print(f"\n{r['engine']} refusals by keyword or message: {r['refusals'] or 'none'}")
        if r["invalid_ids"]:
            print(f"{r['engine']} invalid outputs (first ids): {r['invalid_ids']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("data", nargs="?", default=DEFAULT_DATA)
    parser.add_argument("--limit", type=int, default=200)
    parser.add_argument("--offset", type=int, default=0,
                        help="where the stride starts: another offset below the stride is another, disjoint sample")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--chunk", type=int, default=50, help="schemas per turn of each engine")
    parser.add_argument("--dtype", default="auto",
                        help="Corral's formats: auto (what make serve runs, every format picked from the CPU), or "
                             "float32 (dense fp32 weights, the torch path)")
    parser.add_argument("--no-llama", action="store_true")
    parser.add_argument("--objects", choices=("both", "standard", "declared"), default="both",
                        help="Corral's undeclared properties: declared ones only (its default, llama.cpp's policy), "
                             "the standard's default (allowed), or a run of each")
    parser.add_argument("--out", default=None, help="write the summaries as JSON")
    parser.add_argument("--outputs", default=None,
                        help="write every request's outcome (schema id, kind, finish detail, text) as JSON lines")
    args = parser.parse_args()
    entries = load_schemas(args.data, args.limit, args.offset)
    print(f"CPU: {cpu_summary()}; {time.strftime('%Y-%m-%d %H:%M')}; {len(entries)} schemas, "
          f"{args.concurrency} clients, max_tokens {args.max_tokens}; whitespace allowed on both sides, by llama.cpp's "
          f"JSON rule (Corral's indented policy)")
    corral = corral_server(args.dtype, quantization="auto" if args.dtype == "auto" else "none").start()
    kinds = {"standard": ["corral-standard"], "declared": ["corral"]}.get(args.objects,
                                                                          ["corral", "corral-standard"])
    servers = {name: corral for name in kinds}
    health = httpx.get(corral.url + "/health", timeout=30).json()
    native = health.get("native") or {}
    print(f"corral ({args.dtype}): decode step {health.get('decode_step')}, kernels {native.get('kernels')}, "
          f"products {native.get('qmatmul')}")
    if not args.no_llama and not os.path.exists(LLAMA_SERVER):
        print(f"WARNING: {LLAMA_SERVER} is missing (make bench-extras): Corral alone, no comparison",
              file=sys.stderr)
    elif not args.no_llama:
        print(f"llama-server: {llama_server_version()}")
        servers[f"llama-server -np {args.concurrency}"] = llama_server(args.concurrency).start()
    warm = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    for name, server in servers.items():  # one constrained request off the clock, unlike any measured schema
        asyncio.run(run_chunk(server, name if name.startswith("corral") else "llama",
                              [{"id": "warm-up", "schema": warm}], 8, 1))
    outcomes = {name: [] for name in servers}
    walls = dict.fromkeys(servers, 0.0)
    try:
        for begin in range(0, len(entries), args.chunk):
            chunk = entries[begin: begin + args.chunk]
            order = list(servers.items())
            if begin // args.chunk % 2:  # Corral's two ways take turns going first (the second finds the
                order = order[1::-1] + order[2:] if len(kinds) == 2 else order  # prompts in its prefix cache)
            for name, server in order:
                engine = name if name.startswith("corral") else "llama"
                done, wall = asyncio.run(run_chunk(server, engine, chunk, args.max_tokens, args.concurrency))
                outcomes[name] += done
                walls[name] += wall
            print(f"{begin + len(chunk)}/{len(entries)} schemas", file=sys.stderr, flush=True)
    finally:
        for server in {id(s): s for s in servers.values()}.values():
            server.stop()
    rows = [summarize(name, outcomes[name], walls[name]) for name in servers]
    print_table(rows)
    peer = next((r for r in rows if not r["engine"].startswith("corral")), None)
    for row in rows:
        if row is not peer and peer is not None and peer["output_tok_s"]:
            print(f"\nthroughput ratio {row['engine']} / {peer['engine']}: "
                  f"{row['output_tok_s'] / peer['output_tok_s']:.2f}x")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)
    if args.outputs:
        with open(args.outputs, "w") as f:
            for name, done in outcomes.items():
                for o in done:
                    f.write(json.dumps({"engine": name, "id": o.schema_id, "kind": o.kind, "detail": o.detail,
                                        "tokens": o.tokens, "text": o.text}) + "\n")


if __name__ == "__main__":
    main()
