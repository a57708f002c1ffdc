"""``corral serve`` (the OpenAI-compatible server) and ``corral generate --schema file.json "prompt"`` (one shot)."""

import argparse
import json
import sys


def _serve(args) -> int:
    import uvicorn

    from corral.api.launch import ServeOptions, build_context, build_engine
    from corral.api.server import build_app
    from corral.engine import EngineConfig

    overrides = {"max_model_len": args.max_model_len} if args.max_model_len else {}
    engine = build_engine(EngineConfig(model=args.model, **overrides))
    options = ServeOptions(api_keys=tuple(args.api_key or ()), max_body_bytes=args.max_body_bytes,
                           default_max_tokens=args.default_max_tokens, max_in_flight=args.max_in_flight)
    ctx = build_context(engine, options=options)
    print(f"corral: serving {ctx.config.model_name} on http://{args.host}:{args.port}/v1", file=sys.stderr)
    try:
        uvicorn.run(build_app(ctx), host=args.host, port=args.port, log_level=args.log_level)
    finally:
        ctx.engine.shutdown()
    return 0


def _generate(args) -> int:
    from corral.api.generate_json import generate_json
    from corral.errors import CorralError

    with open(args.schema) as f:
        schema = json.load(f)
    sampling = {"temperature": args.temperature}
    if args.max_tokens is not None:
        sampling["max_tokens"] = args.max_tokens
    if args.seed is not None:
        sampling["seed"] = args.seed
    try:
        value = generate_json(schema, args.prompt, base_url=args.base_url, api_key=args.api_key, model=args.model,
                              **sampling)
    except CorralError as err:
        print(f"corral: {err}", file=sys.stderr)
        return 1
    print(json.dumps(value, ensure_ascii=False, indent=2))
    return 0


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="corral", description="Structured-output generation gateway.")
    sub = top.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the OpenAI-compatible server")
    serve.add_argument("--model", default=None, help="a .gguf file or Hugging Face folder (default: SmolLM2-135M)")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", action="append", help="require 'Authorization: Bearer KEY' (repeatable)")
    serve.add_argument("--max-model-len", type=int, default=None)
    serve.add_argument("--default-max-tokens", type=int, default=None,
                       help="output budget of requests without max_tokens (default: the rest of the context)")
    serve.add_argument("--max-body-bytes", type=int, default=4 << 20)
    serve.add_argument("--max-in-flight", type=int, default=320, help="running + waiting requests before 429")
    serve.add_argument("--log-level", default="info")
    gen = sub.add_parser("generate", help="generate one JSON value that matches a schema")
    gen.add_argument("prompt")
    gen.add_argument("--schema", required=True, help="a JSON Schema file")
    gen.add_argument("--model", default=None)
    gen.add_argument("--base-url", default=None, help="use a running server instead of an embedded engine")
    gen.add_argument("--api-key", default=None)
    gen.add_argument("--max-tokens", type=int, default=None, help="default: the rest of the context window")
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)
    return top


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    return _serve(args) if args.command == "serve" else _generate(args)


if __name__ == "__main__":
    sys.exit(main())
