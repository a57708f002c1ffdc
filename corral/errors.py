"""Corral's one exception hierarchy.

Two regimes (see STYLE.md): internal invariants are ``assert``s; anything a caller can get wrong raises a
subclass of :class:`UserInputError`, whose message names the offending keyword and JSON pointer, or the regex
and the offset. The API maps every ``UserInputError`` to an OpenAI-style error body with status 400.
Inside a running batch nothing here is raised: a guide that meets an invalid token enters an error state.
"""


class CorralError(Exception):
    """Base of every error Corral raises on purpose."""


class UserInputError(CorralError):
    """The caller sent something invalid. HTTP 400."""

    status_code = 400
    error_type = "invalid_request_error"
    param: str | None = None


class InvalidSchemaError(UserInputError):
    """A JSON Schema is malformed: wrong keyword type, dangling ``$ref``, not JSON at all."""

    def __init__(self, message: str, *, keyword: str | None = None, pointer: str = ""):
        where = f" (keyword '{keyword}' at '{pointer or '#'}')" if keyword else ""
        super().__init__(f"{message}{where}")
        self.keyword, self.pointer = keyword, pointer


class UnsupportedSchemaError(InvalidSchemaError):
    """A schema keyword that would change the language is not implemented. Never silently dropped."""


class UnknownKeywordError(InvalidSchemaError):
    """A schema keyword that is no JSON Schema vocabulary, refused because the caller asked for that."""


class InvalidRegexError(UserInputError):
    """A regex does not parse."""

    def __init__(self, message: str, *, pattern: str, offset: int):
        super().__init__(f"{message} at offset {offset} in regex {pattern!r}")
        self.pattern, self.offset = pattern, offset


class UnsupportedRegexError(InvalidRegexError):
    """A regex construct outside the regular languages (lookaround, backreference) or not implemented."""


class InvalidGrammarError(UserInputError):
    """A Lark grammar, choice list or other constraint is malformed."""


class GrammarTooComplexError(UserInputError):
    """Compilation ran past its time or state budget. It fails fast rather than hang a worker."""


class CompileCancelledError(CorralError):
    """A compilation stopped because its request went away (client gone, server shutting down). Never cached."""

    status_code = 503
    error_type = "service_unavailable"


class InvalidRequestError(UserInputError):
    """A request parameter is out of range or two options contradict each other."""

    def __init__(self, message: str, *, param: str | None = None):
        super().__init__(message)
        self.param = param


class PromptTooLongError(InvalidRequestError):
    """The prompt plus the requested output cannot fit the model's context or the KV pool."""


class ModelNotFoundError(CorralError):
    """The model files are missing or unreadable. The message says how to install them."""


class EngineOverloadedError(CorralError):
    """The request queue is full. HTTP 429."""

    status_code = 429
    error_type = "rate_limit_error"
