"""What the fuzz targets share: the profile in force, the example budgets, and input mutations at the byte level."""

from __future__ import annotations

import os

from hypothesis import settings
from hypothesis import strategies as st

PROFILE = os.environ.get("GB10D_FUZZ") or "ci"
if PROFILE not in ("ci", "long"):
    raise SystemExit(f"GB10D_FUZZ={PROFILE!r}: say long (thousands of examples a target) or leave it unset (the CI budget)")


def budget(ci: int, long: int) -> settings:
    """Examples of one target: `ci` fits a few seconds on a CI machine's two cores, `long` the long run's share."""
    return settings(max_examples=long if PROFILE == "long" else ci)


# Bytes that break decoders and parsers: invalid UTF-8, NUL, a BOM, lone CR, ANSI, a surrogate's encoding, DEL.
JUNK = st.sampled_from([b"\xff", b"\xc3", b"\x80", b"\xed\xa0\x80", b"\x00", b"\xef\xbb\xbf", b"\r", b"\x1b[31m", b"\x1b[", b"\x7f",
                        b"\xfe\xff", b"\t", b"\\", b'"', b"'", b"[", b"]", b"=", b"\n\n", b"\xe2\x80\xa8"])


@st.composite
def mutated_bytes(draw: st.DrawFn, data: bytes, max_mutations: int = 4) -> bytes:
    """`data` with a few cuts, junk insertions, dropped spans and duplicated spans at random places."""
    for _ in range(draw(st.integers(0, max_mutations))):
        if not data:
            data = draw(st.binary(max_size=64))
            continue
        at = draw(st.integers(0, len(data)))
        kind = draw(st.sampled_from(["cut", "junk", "drop", "dup", "random"]))
        if kind == "cut":
            data = data[:at]
        elif kind == "junk":
            data = data[:at] + draw(JUNK) + data[at:]
        elif kind == "drop":
            data = data[:at] + data[at + draw(st.integers(1, 200)) :]
        elif kind == "dup":
            end = min(len(data), at + draw(st.integers(1, 400)))
            data = data[:end] + data[at:end] + data[end:]
        else:
            data = data[:at] + draw(st.binary(min_size=1, max_size=16)) + data[at:]
    return data
