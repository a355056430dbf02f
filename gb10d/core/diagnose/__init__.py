"""`gb10d diagnose`: a pasted vLLM log read back into its starts, the failure that ended the latest, and the
gb10d.toml key to change.

- `pasted`: pasted text as clean log lines (journalctl's forms, wrapping, glued records);
- `starts`: the starts in the log and the failure that ended the latest;
- `verdicts`: the verdict for that failure, with advice taken from gb10d's own decision (policy, advice);
- `diagnosis`: the verdicts it can give, the `Diagnosis`, and how it is written out;
- `explain`: `diagnose(text)`, which runs them in that order.

Pure, as all of gb10d.core: text in, a `Diagnosis` out.
"""

from .diagnosis import VERDICT_HELP, VERDICTS, Diagnosis
from .explain import diagnose
from .pasted import read_lines

__all__ = ["VERDICTS", "VERDICT_HELP", "Diagnosis", "diagnose", "read_lines"]
