"""The command line: argument parsing and dispatch (cli), `gb10d demo` (demo), `gb10d status` (status: what the
daemons and the front left in their files) and import-script's second step (migrate).

The top layer: may import every part of gb10d, and gb10d.sim for the demo.
"""
