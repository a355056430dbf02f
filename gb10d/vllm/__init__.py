"""vLLM's language: the facts its output states (events), framing, classifying and scanning its lines (the logparse package), its known
failures and the NVIDIA driver's kernel lines (known, kernel), every failure kind declared once (failures), its sleep mode's calls
(sleepmode), and a hand-written `vllm serve` start script read into gb10d.toml data (importscript: its shell syntax and variables in
shellsyntax and shellexpansion, the vLLM command in servecommand, `docker run` in dockerrun, compose files in compose, the TOML
written in importtoml).

Pure. May import gb10d.base only.
"""
