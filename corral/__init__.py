"""Corral: structured-output generation with a guarantee.

A prompt plus a constraint (JSON Schema, regex, Lark grammar, choice list or tools) in; text that matches the
constraint out, produced by Corral's own continuous-batching, paged-KV engine.
"""

__version__ = "0.1.0"


def __getattr__(name: str):
    # Lazy: ``import corral`` stays light; the helpers pull in the engine only when first used.
    if name in ("generate_json", "call_tools"):
        from corral.api import generate_json as module

        return getattr(module, name)
    raise AttributeError(f"module 'corral' has no attribute {name!r}")
