"""`gb10d diagnose`'s answer: the verdicts it can give, the `Diagnosis` itself, and how it is written out.

Apart from the reading and the judging so that every verdict builder, the
command line and its `--help` share one shape and one wording: a verdict
named in `VERDICT_HELP`, facts with their numbers, and advice written as
sentences.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...vllm.failures import VERDICTS as VERDICTS_OF_FAILURES

# Every verdict and what it means, for `gb10d diagnose --help`; the failures' come from the failure kinds' table.
VERDICT_HELP: dict[str, str] = {
    "ready": "vLLM started and serves",
    "loading": "still starting, nothing failed yet",
    **{verdict.name: verdict.help for verdict in VERDICTS_OF_FAILURES},
    "unknown": "no vLLM startup in the input",
}
VERDICTS = tuple(VERDICT_HELP)


@dataclass(frozen=True)
class Diagnosis:
    """A verdict (one of `VERDICTS`), the numbers behind it, and what to change."""

    verdict: str
    facts: dict[str, Any]
    advice: str
    summary: str = ""

    def to_json(self) -> dict[str, Any]:
        """The `--json` object: exactly verdict, facts and advice."""
        return {"verdict": self.verdict, "facts": dict(self.facts), "advice": self.advice}

    def render(self) -> str:
        """The human report: verdict and summary, the facts, then the advice."""
        lines = [f"verdict: {self.verdict}"]
        if self.summary:
            lines.append(self.summary)
        if self.facts:
            lines.append("facts:")
            lines.extend(f"  {key}: {value}" for key, value in self.facts.items())
        lines.append(f"advice: {self.advice}")
        return "\n".join(lines) + "\n"


def as_logged(value: float) -> str:
    """A figure vLLM logged in GiB, as the summaries write it: no trailing zeros (sizes in bytes: base.units.gib)."""
    return f"{value:g}"


def sentence(text: str) -> str:
    """A journal-style advice text (lower case, no full stop) as a sentence of its own."""
    head = text[:1] if text.startswith("vLLM") else text[:1].upper()
    return head + text[1:] + ("" if text.endswith(".") else ".")
