"""The decisions: pure code that takes facts, readings and `now` and returns states and actions. One start as a
state machine (lifecycle, phases, facts, outcome), what a failure means and what comes next (policy, advice,
driveroom), `gb10d diagnose` (the diagnose package), memory arithmetic and the machine-wide budget (memory,
budget, modelfit, host), liveness, reloads and learned settings (reload, learned, programs), the cluster's node table
(cluster), what a container start that never reached vLLM means (containerstart) and the state file's schema
(statefile). What they decide on is read for them by gb10d.machine (host, memory,
statefile, programsfile).

May import gb10d.vllm and gb10d.base; no I/O library (asyncio, httpx, watchdog, sdnotify, prometheus-client, Ray,
subprocess, socket, fcntl, select, shutil, tempfile).
"""
