"""vLLM's /metrics as figures: the Prometheus text format's sample lines, each family summed over its label sets.

vLLM reports one sample per engine and model name (label sets), and gb10d wants totals: liveness its running and
waiting requests and token counters, the front's page its tokens and time to first token. Comments, other families,
timestamps and values that are no finite number are skipped; a family without a usable sample is absent, never 0.

Pure.
"""

from __future__ import annotations

import math
from collections.abc import Collection


def sample(line: str) -> tuple[str, float | None]:
    """(metric name, value) of one sample line; the value is None if it is not a finite number."""
    brace = line.find("{")
    if brace >= 0:
        name = line[:brace]
        # Label values may contain spaces and braces inside quotes; the value follows the last '}'.
        rest = line[line.rfind("}") + 1 :]
    else:
        name, _, rest = line.partition(" ")
    words = rest.split()
    if not words:
        return name.strip(), None
    try:
        value = float(words[0])
    except ValueError:
        return name.strip(), None
    return name.strip(), value if math.isfinite(value) else None


def sample_lines(text: str) -> list[str]:
    """The sample lines of the exposition, stripped (no blank line, no comment)."""
    return [line for line in (raw.strip() for raw in text.splitlines()) if line and not line.startswith("#")]


def family_sums(text: str, families: Collection[str]) -> dict[str, float]:
    """Each of `families` summed over its label sets; one without a usable sample is left out."""
    sums: dict[str, float] = {}
    for line in sample_lines(text):
        name, value = sample(line)
        if name in families and value is not None:
            sums[name] = sums.get(name, 0.0) + value
    return sums
