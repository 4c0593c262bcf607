"""Exception hierarchy of the constraints package (the server maps every one to HTTP 400)."""

from __future__ import annotations


class ConstraintError(Exception):
    """A constraint cannot be used for this request.

    Attributes:
        message: human-readable, one line.
        param: the request field path at fault, e.g. ``response_format.json_schema.schema``.
        pointer: JSON pointer inside the schema, when the fault is at one place of it.
        keyword: the schema keyword at fault, when there is one.
        code: a stable machine-readable code.
    """

    default_code = "invalid_constraint"

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        pointer: str | None = None,
        keyword: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.pointer = pointer
        self.keyword = keyword
        self.code = code or self.default_code

    def for_param(self, param: str | None) -> "ConstraintError":
        """A copy of this error naming ``param`` (prefixed onto the message) when it has none."""
        if not param or self.param:
            return self
        return type(self)(
            f"{param}: {self.message}", param=param, pointer=self.pointer, keyword=self.keyword, code=self.code
        )

    def __reduce__(self):  # keep attributes across process boundaries
        return (_rebuild, (type(self), self.message, self.param, self.pointer, self.keyword, self.code))


def _rebuild(cls, message, param, pointer, keyword, code):
    return cls(message, param=param, pointer=pointer, keyword=keyword, code=code)


class InvalidConstraintError(ConstraintError):
    """The constraint is malformed (bad schema, bad regex, bad grammar, conflicting fields)."""

    default_code = "invalid_constraint"


class EmptyLanguageError(InvalidConstraintError):
    """The constraint admits no output at all (e.g. a regex matching no string)."""


class UnsupportedConstraintError(ConstraintError):
    """The constraint is valid but no backend can enforce all of it."""

    default_code = "unsupported_constraint"


class ConstraintTooLargeError(ConstraintError):
    """The constraint exceeds the size budget."""

    default_code = "constraint_too_large"


class ConstraintTimeoutError(ConstraintError):
    """Compiling the constraint exceeded the time budget."""

    default_code = "constraint_timeout"


class ConstraintMemoryError(ConstraintTooLargeError):
    """Compiling the constraint exceeded the compile worker's memory cap."""

    default_code = "constraint_memory_exceeded"


class ConstraintCrashError(ConstraintError):
    """The compile worker died while compiling the constraint (not for time or memory)."""

    default_code = "constraint_compile_failed"
