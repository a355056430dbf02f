"""`gb10d import-script`'s first step: a hand-written `vllm serve` start script (or a `docker run` of an image, or a
docker compose file) read into gb10d.toml data. It never runs anything; what it cannot reproduce it says.

One module for each piece, used in this order:

- `shellsyntax` splits the script into simple commands (words as written, quotes kept, redirections, `&`, pipes,
  line numbers) and the compound blocks around them.
- `shellexpansion` keeps the script's variables and expands its words (`$X`, `${X:-default}`, `~`, the owner's
  `$HOME`); what the script alone cannot tell is reported.
- `servecommand` reads the command that runs vLLM: what it runs from, the model, the flags, the environment.
- `dockerrun` reads `docker run`/`podman run` of an image into [container] keys; `compose` reads a compose file's
  vLLM service as the `docker run` it amounts to.
- `script` goes through the script command by command and judges blocks whole (`import_script`, `read_script`).
- `importtoml` holds what every input form found (`Findings`) and the gb10d.toml it becomes (`Imported`, `render`).

Pure, like the rest of gb10d.vllm. May import gb10d.base and its own modules only: nothing of vLLM's output
(logparse, events, known, kernel, sleepmode) is needed to read a script, and the import-linter contract
"importscript-apart" in pyproject.toml keeps it so. The names below are the package's public surface, what
`gb10d import-script` (gb10d.cmdline.cli, .migrate) uses; the modules' other names are its own.
"""

from .importtoml import Findings, Imported, render
from .script import import_script, read_script
from .shellexpansion import ScriptOwner

__all__ = ["Findings", "Imported", "ScriptOwner", "import_script", "read_script", "render"]
