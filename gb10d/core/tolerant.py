"""How gb10d reads the JSON records any gb10d version may have written (the state file, the memory ledger, the
front's snapshot): pydantic reads a record from its declared fields, and the types here say what a field accepts.

A field's own type is exact (a bool is no number, a float no count, a name not empty); a field that may be missing
or odd in a file of another version reads as its default (`otherwise`), where one the reader cannot do without
makes the whole record none.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BeforeValidator, Strict, StringConstraints, TypeAdapter, ValidationError, ValidatorFunctionWrapHandler, WrapValidator

Whole = Annotated[int, Strict()]
Number = Annotated[float, Strict()]  # an int reads as its float
Name = Annotated[str, StringConstraints(strict=True, min_length=1)]


def otherwise(default: Any) -> WrapValidator:
    """A field that does not read as its type is `default` instead of an error."""

    def read(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        try:
            return handler(value)
        except ValidationError:
            return default

    return WrapValidator(read)


def _strings(value: Any) -> tuple[str, ...]:
    return tuple(w for w in value if isinstance(w, str)) if isinstance(value, list) else ()


# A list of names: what is not a string in it is left out; anything but a list is none.
Names = Annotated[tuple[str, ...], BeforeValidator(_strings)]


def readable(kind: type[Any]) -> BeforeValidator:
    """A list of `kind` records: those that read, the others left out; anything but a list is none."""
    adapter = TypeAdapter(kind)

    def keep(value: Any) -> list[Any]:
        kept = []
        for item in value if isinstance(value, list) else []:
            try:
                kept.append(adapter.validate_python(item))
            except ValidationError:
                continue
        return kept

    return BeforeValidator(keep)

