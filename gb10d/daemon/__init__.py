"""The daemon, `gb10d run`: the parts wired together (daemon), the sequence of attempts and one start (supervisor,
attempt, pull), the checks around a start (preflight), probes (probe, probing), the config in force (keeper,
watcher, learnedfile), the fact loop (loop), a pair of machines (pair, worker), parking by sleep (parking, control),
the one door to everything observable (reporter, metrics, alerting) and `lab`, gb10d as real processes for the demo, the tests and the benchmarks.

May import gb10d.launch, gb10d.machine, gb10d.core, gb10d.vllm and gb10d.base; not the front nor the command line.
"""
