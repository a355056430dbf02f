"""vLLM's language: the facts its output states (events), framing and classifying its lines (logparse), its known
failures and the NVIDIA driver's kernel lines (known, kernel), its sleep mode's calls (sleepmode), and a hand-written
`vllm serve` start script read into gb10d.toml data (importscript).

Pure. May import gb10d.base only.
"""
