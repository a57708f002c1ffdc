"""Random walks over a whole schema set: every document a guide lets through must validate under ``jsonschema``.

For each schema that compiles (SmolLM2 vocabulary, flexible whitespace by default), ``--walks`` random documents
are drawn token by token through its guide (:func:`corral.fsm.random_walk.random_document`) and validated. The
tests run a fixed sample of 500 dev schemas; this runs all of them (or ``--every N`` / ``--limit N``) and prints:
schemas compiled and refused, walks drawn and finished, invalid documents (the target is zero) and guide-contract
errors, each listed by schema id. A schema whose walks run past ``--timeout`` seconds (masks built along the way
can take minutes for nested not/allOf over patterns) is stopped and listed apart.

    python bench/random_walks.py [DATA] [--walks 20] [--every 1] [--limit N] [--whitespace flexible] [--timeout S] [--out F]
"""

import argparse
import gzip
import json
import os
import random
import signal
import sys
import time

import jsonschema

from corral.errors import UserInputError
from corral.fsm.compiler import GrammarCompiler
from corral.fsm.random_walk import WalkError, random_document, single_byte_tokens
from corral.fsm.vocabulary import Vocabulary
from corral.grammar.constraint import Constraint
from corral.models import load_tokenizer

DEFAULT_DATA = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data", "maskbench-dev.jsonl.gz")


def load(path: str, every: int, limit: int | None) -> list[dict]:
    with gzip.open(path, "rt") as f:
        entries = [json.loads(line) for line in f][::every]
    return entries[:limit] if limit else entries


def run_schema(compiler, vocab, byte_tokens, entry: dict, walks: int, whitespace: str) -> dict:
    try:
        grammar = compiler.compile(Constraint("json_schema", entry["schema"], whitespace=whitespace))
    except UserInputError as err:
        return {"status": "refused", "error": type(err).__name__}
    validator = jsonschema.validators.validator_for(entry["schema"])(entry["schema"])
    rng = random.Random(entry["id"])
    finished, invalid = 0, []
    for _ in range(walks):
        try:
            document = random_document(grammar, vocab, byte_tokens, rng)
        except WalkError as err:
            return {"status": "contract", "error": str(err), "finished": finished, "invalid": invalid}
        if document is None:
            continue
        finished += 1
        try:
            instance = json.loads(document.decode("utf-8"))
        except ValueError as err:
            invalid.append({"document": document.decode("utf-8", "replace"), "errors": [f"not JSON: {err}"]})
            continue
        errors = [e.message for e in validator.iter_errors(instance)]
        if errors:
            invalid.append({"document": document.decode("utf-8", "replace"), "errors": errors[:3]})
    return {"status": "compiled", "finished": finished, "invalid": invalid}


class SchemaTimeout(Exception):
    pass


def _alarm(signum, frame):
    raise SchemaTimeout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("data", nargs="?", default=DEFAULT_DATA)
    parser.add_argument("--walks", type=int, default=20)
    parser.add_argument("--every", type=int, default=1)
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--whitespace", default="flexible", choices=("flexible", "compact"))
    parser.add_argument("--timeout", type=int, default=300, help="seconds per schema (0: none)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    signal.signal(signal.SIGALRM, _alarm)
    entries = load(args.data, args.every, args.limit)
    vocab = Vocabulary.from_tokenizer(load_tokenizer())
    byte_tokens = single_byte_tokens(vocab)
    results = {}
    start = time.perf_counter()
    for number, entry in enumerate(entries, 1):
        compiler = GrammarCompiler(vocab)  # a fresh cache: no schema's states help another's
        signal.alarm(args.timeout)
        try:
            results[entry["id"]] = run_schema(compiler, vocab, byte_tokens, entry, args.walks, args.whitespace)
        except SchemaTimeout:
            results[entry["id"]] = {"status": "timeout"}
        finally:
            signal.alarm(0)
        if number % 250 == 0:
            print(f"{number}/{len(entries)} schemas, {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    compiled = [r for r in results.values() if r["status"] in ("compiled", "contract")]
    summary = {
        "schemas": len(entries),
        "compiled": len(compiled),
        "refused": sum(r["status"] == "refused" for r in results.values()),
        "walks": len(compiled) * args.walks,
        "finished": sum(r.get("finished", 0) for r in compiled),
        "invalid_documents": sum(len(r.get("invalid", ())) for r in compiled),
        "schemas_with_invalid": sorted(i for i, r in results.items() if r.get("invalid")),
        "contract_errors": sorted(i for i, r in results.items() if r["status"] == "contract"),
        "timeouts": sorted(i for i, r in results.items() if r["status"] == "timeout"),
        "seconds": round(time.perf_counter() - start, 1),
    }
    for key, value in summary.items():
        print(f"{key:>22}: {value}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "summary": summary, "results": results}, f, indent=1)
    sys.exit(1 if summary["invalid_documents"] or summary["contract_errors"] else 0)


if __name__ == "__main__":
    main()
