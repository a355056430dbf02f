"""`python -m gb10d.sim serve MODEL [vllm serve flags]` and `python -m gb10d.sim make-venv DIR`."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Sequence

USAGE = """usage: python -m gb10d.sim serve MODEL [vllm serve flags]
       python -m gb10d.sim make-venv DIR
       python -m gb10d.sim --version

serve      behave like `vllm serve` (knobs: GB10D_SIM_ERA, GB10D_SIM_VERSION,
           GB10D_SIM_SCENARIO, GB10D_SIM_SPEED, GB10D_SIM_SHARDS,
           GB10D_SIM_TOTAL_GIB, GB10D_SIM_FREE_GIB, GB10D_SIM_MEMINFO)
make-venv  write DIR/bin/vllm (a `vllm` program running this stand-in),
           DIR/bin/ray and DIR/bin/python (this interpreter's Ray and Python)
"""


def main(argv: Sequence[str] | None = None) -> int:
    """Dispatch on the first word, as the `vllm` CLI does."""
    words = list(sys.argv[1:] if argv is None else argv)
    if words[:1] == ["serve"]:
        from .server import serve_main

        return serve_main(words[1:])
    if words[:1] == ["make-venv"] and len(words) == 2:
        from . import make_venv

        print(make_venv(Path(words[1])))
        return 0
    if words[:1] in (["--version"], ["-v"]):
        from .settings import SettingsError, from_environ

        try:
            print(from_environ().version)
        except SettingsError as exc:
            print(f"gb10d.sim: {exc}", file=sys.stderr)
            return 2
        return 0
    if words[:1] in (["-h"], ["--help"]):
        print(USAGE, end="")
        return 0
    print(USAGE, end="", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
