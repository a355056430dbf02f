"""`gb10d diagnose`'s answer: the verdicts it can give, the `Diagnosis` itself, and how it is written out.

Apart from the reading and the judging so that every verdict builder, the
command line and its `--help` share one shape and one wording: a verdict
named in `VERDICT_HELP`, facts with their numbers, and advice written as
sentences.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..vllm.known import ISSUES

# Every verdict and what it means, for `gb10d diagnose --help`; the GB10 platform's come from the known-issues table.
VERDICT_HELP: dict[str, str] = {
    "ready": "vLLM started and serves",
    "loading": "still starting, nothing failed yet",
    "shard_stall": "weight loading stopped making progress",
    "free_memory": "too little free memory for gpu_memory_utilization at start",
    "cuda_oom": "CUDA ran out of memory (loading, profiling, CUDA graphs or serving)",
    "kv_cache_insufficient": "the KV cache cannot hold one request of max_model_len, or there is no memory for it",
    "port_in_use": "the API port, or a port of vLLM's internal sockets, is taken",
    "model_not_found": "the model is not a local directory or a reachable (or permitted) Hugging Face repository",
    "bad_argument": "vLLM rejected a flag or its value",
    "engine_dead": "vLLM's engine process died",
    **{issue.name: issue.title for issue in ISSUES},
    "crash": "vLLM failed in another way (the error is named)",
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
