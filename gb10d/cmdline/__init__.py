"""The command line: argument parsing and dispatch (cli), `gb10d demo` (demo) and import-script's second step
(migrate).

The top layer: may import every part of gb10d, and gb10d.sim for the demo.
"""
