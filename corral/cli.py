"""``corral serve`` (the OpenAI-compatible server) and ``corral generate --schema file.json "prompt"`` (one shot)."""

import argparse
import json
import sys


def _serve(args) -> int:
    from corral import native
    from corral.api.launch import GracefulServer, ServeOptions, build_context, build_engine
    from corral.engine import EngineConfig
    from corral.errors import InvalidRequestError
    from corral.schemas.limits import RequestLimits

    try:  # before the model loads: CORRAL_NATIVE=require fails here, auto warns here when it falls back
        native.module()
    except native.NativeModuleError as err:
        print(f"corral: {err}", file=sys.stderr)
        return 1
    paths = native.status()
    print(f"corral: mask path {paths['mask_path']}, CPU kernels {paths['kernels']} (CORRAL_NATIVE={paths['mode']})",
          file=sys.stderr)

    overrides = {"max_model_len": args.max_model_len} if args.max_model_len else {}
    try:
        engine = build_engine(EngineConfig(model=args.model, num_threads=args.threads, **_formats(args), **overrides))
    except InvalidRequestError as err:  # a setting the engine refuses (out of range, or one the formats rule out)
        print(f"corral: {err}", file=sys.stderr)
        return 2
    print(f"corral: formats {engine.formats.tag} ({engine.formats.reason})", file=sys.stderr)
    options = ServeOptions(api_keys=tuple(args.api_key or ()), protect_all=args.protect_all,
                           max_body_bytes=args.max_body_bytes, default_max_tokens=args.default_max_tokens,
                           max_in_flight=args.max_in_flight, max_compiling=args.max_compiling,
                           compile_time_budget_s=args.compile_time_budget_s,
                           send_timeout_s=args.send_timeout_s, header_timeout_s=args.header_timeout_s,
                           body_timeout_s=args.body_timeout_s, max_connections=args.max_connections,
                           shutdown_grace_s=args.shutdown_grace_s,
                           reject_unknown_keywords=args.reject_unknown_keywords,
                           limits=RequestLimits(max_tools=args.max_tools, max_tools_bytes=args.max_tools_bytes))
    ctx = build_context(engine, options=options)
    print(f"corral: serving {ctx.config.model_name} on http://{args.host}:{args.port}/v1", file=sys.stderr)
    GracefulServer(ctx, args.host, args.port, args.shutdown_grace_s, args.log_level).run()
    return 0


def _formats(args) -> dict:
    return {"dtype": args.dtype, "quantization": args.quantization, "kv_cache_dtype": args.kv_cache_dtype,
            "quant_group_size": args.quant_group_size, "awq": args.awq, "decode_step": args.decode_step,
            "decode_burst": args.decode_burst, "deterministic": args.deterministic,
            "jump_forward": args.jump_forward == "on", "speculation": args.speculation == "on",
            "num_speculative_tokens": args.num_speculative_tokens, "draft_row_cost": args.draft_row_cost,
            "draft_model": args.draft_model, "draft_layers": args.draft_layers,
            "draft_model_cost": args.draft_model_cost}


def _add_format_args(command) -> None:
    command.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                         help="activations and dense weights (auto: float32 under w4a8, else bfloat16 where the CPU "
                              "has AMX or AVX-512 bf16)")
    command.add_argument("--quantization", default="auto", choices=("auto", "none", "w8a16", "w4a16", "gguf", "w4a8"),
                         help="linear weights: w4a8 runs a GGUF's Q4, Q5, Q6_K and Q8 blocks and Q8 head as "
                              "shipped on the native integer kernels, gguf runs the Q4 blocks through torch's int4 "
                              "kernel, w4a16/w8a16 quantize at load (auto: w4a8 for a GGUF with Q4, Q5, Q6_K or "
                              "Q8_0 linears, gguf without the native module, else none)")
    command.add_argument("--quant-group-size", type=int, default=32, choices=(32, 64, 128),
                         help="w4a16: weights per scale along K")
    command.add_argument("--awq", action="store_true",
                         help="w4a16: activation-aware scales per input channel before rounding, calibrated at load "
                              "on a small text that ships with Corral (a float32 pass and a search, seconds)")
    command.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "float32", "bfloat16", "int8"),
                         help="auto: bfloat16 under w4a8, else the activation dtype; int8 halves the KV bytes")
    command.add_argument("--decode-step", default="auto", choices=("auto", "native", "torch"),
                         help="each step in one native call (auto: where it serves the model, w4a8; prompts where "
                              "the head size is 64 or 128) or op by op in torch (the oracle)")
    command.add_argument("--decode-burst", type=int, default=8,
                         help="the most tokens one native call decodes per sequence while every running sequence "
                              "decodes greedily or samples with no draft, guide, bias or penalty and no request "
                              "waits (1: a call per token); each token is the one the sampler would pick or draw, "
                              "so outputs do not change")
    command.add_argument("--deterministic", action="store_true",
                         help="a request's tokens and logprobs the same bits whatever the prefix cache holds, how "
                              "its prompt is chunked, whether it is preempted and what runs beside it: every "
                              "query, prompts' included, through the decode kernel over the cache (w4a8 only; "
                              "long prompts take longer)")
    command.add_argument("--jump-forward", default="on", choices=("on", "off"),
                         help="draft the spans a grammar forces (a request's jump_forward overrides it); drafts are "
                              "verified and never change an output")
    command.add_argument("--speculation", default="on", choices=("on", "off"),
                         help="draft by prompt lookup (a request's speculation overrides it)")
    command.add_argument("--num-speculative-tokens", type=int, default=8,
                         help="the most prompt-lookup tokens a sequence drafts per step")
    command.add_argument("--draft-row-cost", type=float, default=0.25,
                         help="a draft row's cost as a share of a whole step at batch 1 (bench/speculation.py "
                              "--row-cost measures it); it prices drafts at every batch size")
    command.add_argument("--draft-model", default=None,
                         help="a model with the same vocabulary that drafts tokens for the target to verify (a "
                              ".gguf file or HF folder); with --draft-layers alone, the target's own first layers "
                              "draft (self-speculation). Off by default; asked only where --speculation is on")
    command.add_argument("--draft-layers", type=int, default=None,
                         help="run the draft model's first this many layers, then its final norm and LM head")
    command.add_argument("--draft-model-cost", type=float, default=None,
                         help="a draft-model step's cost as a share of a target step (default: the ratio of their "
                              "weight bytes); draft-model tokens must be accepted often enough to pay for it")


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
    engine = None
    try:
        if args.base_url is None:  # a setting the engine refuses is printed as any other error
            from corral.api.launch import build_engine
            from corral.engine import EngineConfig

            engine = build_engine(EngineConfig(model=args.model, **_formats(args)))
        value = generate_json(schema, args.prompt, base_url=args.base_url, api_key=args.api_key, model=args.model,
                              engine=engine, **sampling)
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
    serve.add_argument("--api-key", action="append", help="require 'Authorization: Bearer KEY' on /v1 (repeatable)")
    serve.add_argument("--protect-all", action="store_true",
                       help="with --api-key: /metrics and the API docs need a key too (default: only /v1)")
    serve.add_argument("--max-model-len", type=int, default=None)
    _add_format_args(serve)
    serve.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    serve.add_argument("--default-max-tokens", type=int, default=None,
                       help="output budget of requests without max_tokens (default: the rest of the context)")
    serve.add_argument("--max-body-bytes", type=int, default=4 << 20)
    serve.add_argument("--max-in-flight", type=int, default=320,
                       help="requests from arrival to end (compiling, waiting, running) before 429")
    serve.add_argument("--max-compiling", type=int, default=64, help="constraints compiling or queued before 429")
    serve.add_argument("--compile-time-budget-s", type=float, default=10.0,
                       help="wall-clock budget of one request's constraint, all its tools included")
    serve.add_argument("--max-tools", type=int, default=128, help="tools per request")
    serve.add_argument("--max-tools-bytes", type=int, default=1 << 20, help="the JSON of a request's tools, in all")
    serve.add_argument("--reject-unknown-keywords", action="store_true",
                       help="refuse schema keywords that are no JSON Schema vocabulary (default: warn)")
    serve.add_argument("--send-timeout-s", type=float, default=30.0,
                       help="end a stream whose client takes nothing for this long")
    serve.add_argument("--header-timeout-s", type=float, default=20.0,
                       help="close a connection whose request headers have not arrived this long after it opened "
                            "or after its last response")
    serve.add_argument("--body-timeout-s", type=float, default=60.0,
                       help="answer 408 where a request body has not arrived this long after its headers")
    serve.add_argument("--max-connections", type=int, default=1024,
                       help="open connections past which a new one is answered 503 (lowered to fit ulimit -n)")
    serve.add_argument("--shutdown-grace-s", type=float, default=5.0,
                       help="on SIGTERM, how long requests in flight may still run")
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
    _add_format_args(gen)
    return top


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    return _serve(args) if args.command == "serve" else _generate(args)


if __name__ == "__main__":
    sys.exit(main())
