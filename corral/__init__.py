"""Corral: structured-output generation with a guarantee.

A prompt plus a constraint (JSON Schema, regex, Lark grammar, choice list or tools) in; text that matches the
constraint out, produced by Corral's own continuous-batching, paged-KV engine.
"""

__version__ = "0.1.0"
