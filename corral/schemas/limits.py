"""RequestLimits: how much one request may ask for. Past a limit the request gets a 400 that names it.

These bound the work and memory a stranger can make the server spend before anything is generated: the tools to
compile, the messages to render, the prompts of one ``/v1/completions`` call, the sequences they fan out into
(``n``, ``best_of``, beam width), stop strings that are matched after every token, and ``logit_bias`` entries
applied at every step. Body size, compile time and requests in flight are the server's own limits
(``corral.api.context.ServerConfig``, ``corral.fsm.compiler``).
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class RequestLimits:
    max_tools: int = 128  # OpenAI's limit
    max_tools_bytes: int = 1 << 20  # the tools' JSON, all of them together
    max_messages: int = 2048
    max_prompts: int = 64  # prompts of one /v1/completions request
    max_sequences: int = 256  # prompts x (n, best_of, beam width or self-consistency samples)
    max_stop: int = 16
    max_stop_chars: int = 1024  # each stop string
    max_stop_token_ids: int = 1024
    max_logit_bias: int = 1024  # entries

    def __post_init__(self):
        assert all(value > 0 for value in vars(self).values()), self
