#!/usr/bin/env bash
# gb10d against a real vLLM 0.23.0 on a machine with an NVIDIA GPU (not part of CI, which has none).
#
# Expects, as docs/REAL_VLLM.md describes: the vLLM wheel assembled under $HOME/stash, its missing
# dependencies as wheels in .gpu/deps and gb10d's own in .gpu/gb10d-deps (both carried with the tree).
# Writes report.json, notify.json, journal.txt and raw.tar.gz (every start's stdout and stderr) to $OUT.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/real-vllm-out}
mkdir -p "$OUT"
site=$HOME/site
if [ ! -d "$site/vllm" ]; then
    cat "$HOME"/stash/vllm.part0* > "$HOME/stash/vllm-0.23.0-2-cp38-abi3-manylinux_2_28_x86_64.whl"
    own=(); for w in .gpu/gb10d-deps/*.whl; do [ -e ".gpu/deps/${w##*/}" ] || own+=("$w"); done
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" \
        .gpu/deps/*.whl "${own[@]}" "$HOME"/stash/vllm-0.23.0-*.whl
fi
export PYTHONPATH=$site:$PWD PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0
[ -d "$HOME/tiny" ] || python3 tests/gpu/mkmodel.py "$HOME/tiny"
python3 -c 'import vllm, torch; print("vllm", vllm.__version__, "torch", torch.__version__, torch.cuda.get_device_name(0))'
python3 tests/gpu/real_vllm.py --model "$HOME/tiny" --out "$OUT" 2>&1 | tee "$OUT/driver.log"
