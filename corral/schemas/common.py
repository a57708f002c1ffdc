"""Wire pieces shared by both endpoints: errors, usage, stream options, constraints, sampling knobs.

Every request model forbids unknown fields. That is deliberate: a misspelt constraint key (``guided_jsn``,
``structured_outputs.regx``) must be a 400, never a silently unconstrained answer. The sampling knobs are written
once here and mixed into both request models; their mapping to ``SamplingParams`` is ``corral.schemas.sampling``.
"""

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from corral.engine.sampling_params import REPETITION_PENALTY_RANGE


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Open(BaseModel):
    """A response model; responses may grow fields, clients ignore what they do not know."""

    model_config = ConfigDict(extra="allow")


class ErrorInfo(Open):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(Open):
    """OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorInfo


class PromptTokensDetails(Open):
    cached_tokens: int = 0


class CompletionTokensDetails(Open):
    """OpenAI's names for a prediction's tokens: draft tokens the model accepted and rejected."""
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0


class SpeculationUsage(Open):
    """Corral's extension: how the completion tokens were produced. ``forward_passes`` counts, per choice, the
    steps that produced its tokens (one token each, plus the draft tokens they accepted), summed."""
    forward_passes: int = 0
    draft_tokens: int = 0  # drafted and checked by the model: jump-forward and prompt lookup
    accepted_tokens: int = 0  # of those, kept
    forced_tokens: int = 0  # of those kept, jump-forward tokens (spans the grammar forced)


class Usage(Open):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None
    completion_tokens_details: CompletionTokensDetails | None = None
    speculation: SpeculationUsage | None = None


class StreamOptions(Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchemaSpec(Strict):
    name: str = Field(default="response", max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None

    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class ResponseFormat(Strict):
    """``text`` (no constraint), ``json_object`` (any JSON object), ``json_schema``, or ``grammar`` (Lark or
    GBNF text in ``grammar``)."""

    type: Literal["text", "json_object", "json_schema", "grammar"]
    json_schema: JsonSchemaSpec | None = None
    grammar: str | None = None


class StructuredOutputs(Strict):
    """vLLM's ``structured_outputs`` body extension. Exactly one of the constraint fields may be set."""

    json_: dict[str, Any] | bool | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = True
    # vLLM's name: an object schema that declares properties and says nothing of additionalProperties gets those
    # only (corral.grammar.constraint.Constraint), as llama.cpp, XGrammar and outlines generate; false: the
    # standard's default, undeclared members allowed after the declared ones
    disable_additional_properties: bool = True
    # Corral's: refuse (True) or report (False) schema keywords that are no JSON Schema vocabulary; None takes
    # the server's default (reported, unless started with --reject-unknown-keywords).
    reject_unknown_keywords: bool | None = None

    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class SamplingFields(Strict):
    """OpenAI's sampling parameters plus vLLM's extensions (``top_k``, ``min_p``, ``repetition_penalty``,
    ``best_of``, ``use_beam_search``) and Corral's ``self_consistency`` (majority vote over that many samples, on
    the value at ``self_consistency_pointer`` when the answer is JSON)."""

    n: int = Field(default=1, ge=1, le=128)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    max_tokens: int | None = Field(default=None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=-(2**63), le=2**64 - 1)  # torch.Generator's range
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # Extensions (vLLM names).
    top_k: int | None = Field(default=None, ge=-1, le=2**31 - 1)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    # HF-style: positive logits are divided by it, so a tiny value overflows them to inf.
    repetition_penalty: float | None = Field(default=None, ge=REPETITION_PENALTY_RANGE[0],
                                             le=REPETITION_PENALTY_RANGE[1])
    min_tokens: int = Field(default=0, ge=0)
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    # Corral's: drafts for this request (None: the server's --jump-forward / --speculation); outputs are the same
    jump_forward: bool | None = None
    speculation: bool | None = None
    best_of: int | None = Field(default=None, ge=1, le=128)
    use_beam_search: bool = False
    length_penalty: float = Field(default=1.0, ge=-10.0, le=10.0)  # length ** penalty must stay finite
    self_consistency: int | None = Field(default=None, ge=2, le=128)
    self_consistency_pointer: str | None = None
    # Constraint extensions: ``structured_outputs`` or vLLM's older top-level ``guided_*`` names.
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | bool | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None
