"""What every table of gb10d.toml shares: strict values, unknown keys refused, problems reported at their keys.

Apart from the schema because both the instance's tables (config.py) and the
front's (frontconfig.py) are built on it, and the schema imports the front's
table.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from pydantic import BaseModel, ConfigDict
from pydantic_core import PydanticCustomError


class Table(BaseModel):
    """A gb10d table: unknown keys are errors, values are checked strictly enough to catch typos."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True, strict=True)


def absolute(value: Path | None) -> Path | None:
    """Relative paths would depend on the working directory, which is / under systemd."""
    if value is not None and not value.is_absolute():
        raise ValueError(f"must be an absolute path (got {str(value)!r}); gb10d runs from / under systemd")
    return value


def raise_keyed(problems: Sequence[tuple[str | tuple[str, ...], str]]) -> None:
    """Report problems of several keys of one table at once, each located at its own key."""
    if problems:
        raise PydanticCustomError("keyed", "{summary}", {"summary": "; ".join(m for _, m in problems), "problems": problems})
