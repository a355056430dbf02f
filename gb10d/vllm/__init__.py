"""vLLM's language: the facts its output states (events), framing, classifying and scanning its lines (the logparse package), its known
failures and the NVIDIA driver's kernel lines (known, kernel), every failure kind declared once (failures), its sleep mode's
calls (sleepmode), and a hand-written `vllm serve` start script read into gb10d.toml data (the importscript package: its
shell syntax, variables, the vLLM command, `docker run`, compose files and the TOML written, each in a module of its own).

Pure. May import gb10d.base only.
"""
