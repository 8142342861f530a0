#!/usr/bin/env bash
# The Python package on the GPU against the command line: the same
# decomposition (same tensor, rank, seed, iterations) with backend="gpu"
# from Python and `kruskal cpd --backend gpu --json`, and with gpus=2 /
# `--gpus 2` when two GPUs are present. Prints a Markdown table: the
# largest difference of the fits over the iterations, and the time per
# iteration (mean of iterations 2 to the last) from Python and from the CLI.
#
# On the development machine (no GPU needed), from the repository root:
#
#   cargo xtask bundle            # the release kruskal into gpu-run/
#   python3 -m venv /tmp/mat && /tmp/mat/bin/pip install "maturin>=1.9,<2"
#   /tmp/mat/bin/maturin build --release --strip -m crates/kruskal-py/Cargo.toml -o gpu-run/
#
# (one abi3 wheel, kruskal-*-cp39-abi3-*.whl, about 2 MB stripped, serves
# every CPython >= 3.9).
# Then on the GPU machine, from the repository root with gpu-run/ carried:
#
#   bash bench/python-gpu-check.sh [NNZ] [RANK] [ITERS]
#
# It installs the wheel into a scratch folder put on PYTHONPATH and runs
# /opt/torch/.venv/bin/python (numpy there; no internet needed).
set -euo pipefail
NNZ=${1:-20M}
RANK=${2:-32}
ITERS=${3:-12}
K=gpu-run/kruskal
PY=${KRUSKAL_CHECK_PYTHON:-/opt/torch/.venv/bin/python}
SCRATCH=${TMPDIR:-/tmp}/kruskal-python-gpu-check
mkdir -p "$SCRATCH"

wheels=(gpu-run/kruskal-*-abi3-*.whl)
[ -f "${wheels[0]}" ] || { echo "no wheel in gpu-run/ (see the header of $0)" >&2; exit 1; }
[ -x "$K" ] || { echo "no $K (see the header of $0)" >&2; exit 1; }
# The wheel goes into a folder of its own on PYTHONPATH: a virtual
# environment made from the PyTorch one would not see that one's numpy.
site="$SCRATCH/site"
rm -rf "$site"
"$PY" -m pip install --quiet --no-index --no-deps --target "$site" "${wheels[0]}"
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -c 'import kruskal; d = kruskal.devices(); print("gpus", [g["name"] for g in d] or d.reason)'

T="$SCRATCH/nell-2.ktns"
[ -f "$T" ] || "$K" gen --like nell-2 --nnz "$NNZ" "$T" > /dev/null
ngpus=$("$PY" -c 'import kruskal; print(len(kruskal.devices()))')
A=(--rank "$RANK" --iters "$ITERS" --tol 0 --seed 1 --json)

"$K" cpd "$T" --backend gpu "${A[@]}" > "$SCRATCH/cli-gpu.json"
if [ "$ngpus" -ge 2 ]; then
  "$K" cpd "$T" --gpus 2 "${A[@]}" > "$SCRATCH/cli-gpus2.json"
fi

"$PY" - "$T" "$SCRATCH" "$RANK" "$ITERS" "$ngpus" <<'PY'
import json, sys
import numpy as np
import kruskal

path, scratch, rank, iters, ngpus = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
X = kruskal.read(path)

def per_iteration_ms(its):
    rest = its[1:] or its
    return 1e3 * sum(s["mttkrp_s"] + s["other_s"] for s in rest) / len(rest)

runs = [("gpu", dict(backend="gpu"), "cli-gpu.json")]
if ngpus >= 2:
    runs.append(("gpus=2", dict(gpus=2), "cli-gpus2.json"))
print(f"tensor {path}: {X.shape}, {X.nnz} nonzeros; rank {rank}, {iters} iterations")
print("| run | backend (Python / CLI) | largest fit difference | ms/iteration Python | ms/iteration CLI | Python / CLI |")
print("|---|---|---|---|---|---|")
for name, kwargs, cli_file in runs:
    m = kruskal.cp_als(X, rank, iters=iters, tol=0, seed=1, progress=False, **kwargs)
    cli = json.load(open(f"{scratch}/{cli_file}"))
    theirs = np.array([s["fit"] for s in cli["iterations"]])
    n = min(len(theirs), len(m.fits))
    diff = float(np.abs(m.fits[:n] - theirs[:n]).max())
    py_ms, cli_ms = per_iteration_ms(m.iterations), per_iteration_ms(cli["iterations"])
    print(f"| {name} | {m.backend} / {cli['backend']} | {diff:.1e} | {py_ms:.2f} | {cli_ms:.2f} "
          f"| {py_ms / cli_ms:.3f} |")
PY
