#!/usr/bin/env bash
# gb10d against a real vLLM on a machine with an NVIDIA GPU (not part of CI, which has none).
#
# Usage: run-real-vllm.sh [checks|upgrade]   (VLLM_VERSION, default 0.23.0, names the release)
#   checks:  tests/gpu/real_vllm.py, the six checks (free memory, kills, stop, replay);
#   upgrade: tests/gpu/real_vllm_upgrade.py, a reload to a broken candidate venv and back.
# Expects, as docs/REAL_VLLM.md describes: the vLLM wheel's parts (vllm.partNN) under $HOME/stash or in .gpu,
# its missing dependencies as wheels in .gpu/deps and gb10d's own in .gpu/gb10d-deps (carried with
# the tree). vLLM and its dependencies go into a venv of their own, $HOME/vllm-$VLLM_VERSION, which
# sees the machine's PyTorch through a .pth file; gb10d's dependencies into $HOME/gb10d-site.
# Writes report.json, notify.json, journal.txt (and raw.tar.gz, each start's output) to $OUT.
set -euo pipefail
cd "$(dirname "$0")/../.."
mode=${1:-checks}
version=${VLLM_VERSION:-0.23.0}
OUT=${OUT:-$PWD/real-vllm-out}
mkdir -p "$OUT"
venv=$HOME/vllm-$version
gbsite=$HOME/gb10d-site
if [ ! -x "$venv/bin/vllm" ]; then
    torch_site=$(python3 -c 'import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))')
    python3 -m venv --without-pip "$venv"
    site=$(echo "$venv"/lib/python3*/site-packages)
    echo "$torch_site" > "$site/machine-torch.pth"
    wheel=$HOME/stash/vllm-$version-cp38-abi3-manylinux_2_28_x86_64.whl
    mkdir -p "$HOME/stash"
    for part in .gpu/vllm.part*; do [ -e "$part" ] && cp "$part" "$HOME/stash/"; done  # the last part may travel with the tree
    cat "$HOME"/stash/vllm.part* > "$wheel"
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" .gpu/deps/*.whl "$wheel"
    printf '#!%s\nimport sys\nfrom vllm.entrypoints.cli.main import main\nif __name__ == "__main__":\n    sys.argv[0] = "vllm"\n    sys.exit(main())\n' \
        "$venv/bin/python3" > "$venv/bin/vllm"
    chmod 755 "$venv/bin/vllm"
fi
[ -d "$gbsite/sdnotify" ] || python3 -m pip install -q --no-index --no-deps --no-compile --target "$gbsite" .gpu/gb10d-deps/*.whl
export PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0
[ -d "$HOME/tiny" ] || python3 tests/gpu/mkmodel.py "$HOME/tiny"
"$venv/bin/python3" -c 'import vllm, torch; print("vllm", vllm.__version__, "torch", torch.__version__, torch.cuda.get_device_name(0))'
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
if [ "$mode" = upgrade ]; then
    # gb10d sees only its own dependencies: the candidate venv must fail on its own, not find vLLM on PYTHONPATH.
    export PYTHONPATH=$gbsite:$PWD
    python3 tests/gpu/real_vllm_upgrade.py --model "$HOME/tiny" --out "$OUT" --good-venv "$venv" --version "$version" \
        2>&1 | tee "$OUT/driver.log"
else
    export PYTHONPATH=$gbsite:$PWD
    python3 tests/gpu/real_vllm.py --model "$HOME/tiny" --out "$OUT" --program "$venv/bin/python3 $venv/bin/vllm" \
        --hold-gib "${HOLD_GIB:-100}" 2>&1 | tee "$OUT/driver.log"
fi
