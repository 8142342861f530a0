#!/bin/bash
# Several GPUs of one host: the group's GPU tests, then CPD-ALS per
# iteration (median after the first) and the preparation on 1 GPU (fcoo),
# and on 2, 3 and 4 GPUs with every row all-gathered and with only the rows
# each GPU reads, on the tensors of the several-GPU issue. Usage, from the
# repository root of a bundle on the GPU machine:
#   bash bench/multi-gpu-check.sh OUT_DIR [tests] [nell1] [full] [t3u] [amazon] [dist]
# (no parts: all but amazon). K=path/to/kruskal (default gpu-run/kruskal);
# TESTS=names of the test executables to run (default: every GPU one),
# FILTER=a test name filter passed to each; NELL1_SPECS, FULL_SPECS=the
# GPU counts and what each runs (e.g. "4:all 4:rows 4:auto": all = every
# row all-gathered by owner, rows = rows by owner (--gpu-plan rows), split
# = --gpu-plan split, auto = the defaults, nccl = the defaults with a split
# plan's partial sums reduced by NCCL, --partial-reduce nccl, allx = the
# defaults with every row exchanged and reduced, --exchange-rows all, read =
# only the rows read, --exchange-rows read, pull = read with
# --partial-reduce pull); QUICK=1 skips nell-1's p2p,
# host-built and --gpus all runs; REUSE=1 keeps /tmp/nell1.ktns,
# /tmp/full.ktns and /tmp/amazon.ktns when they exist.
set -u
N=/opt/torch/.venv/lib/python3.12/site-packages/nvidia/nccl/lib
mkdir -p /tmp/nccl && ln -sf $N/libnccl.so.2 /tmp/nccl/libnccl.so
export LD_LIBRARY_PATH=/tmp/nccl:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-} NCCL_NVLS_ENABLE=0
K=${K:-gpu-run/kruskal}
# Absolute paths: some CLI tests run the program from a temporary folder.
export KRUSKAL_CACHE_DIR=/tmp/kc KRUSKAL_BIN=$(realpath $K) KRUSKAL_TEST_DATA=$(realpath data)
PY=/opt/torch/.venv/bin/python
R=${1:?an output folder}; shift; mkdir -p $R
PARTS=${*:-tests nell1 full t3u dist}
has() { case " $PARTS " in *" $1 "*) return 0;; esac; return 1; }
GPUS=$(nvidia-smi --query-gpu=name --format=csv,noheader | wc -l)
{ date -u; nvidia-smi --query-gpu=name --format=csv,noheader | sort | uniq -c; nproc; } > $R/machine.txt
cat $R/machine.txt

summary() { # label json
  $PY - "$1" "$2" <<'EOF'
import json, statistics, sys
label, path = sys.argv[1], sys.argv[2]
try:
    d = json.load(open(path))
except Exception as e:
    print(f"{label:34s} FAILED ({e})"); sys.exit()
its = [i["mttkrp_s"] + i["other_s"] for i in d["iterations"]][1:]
ms = statistics.median(its) * 1e3 if its else float("nan")
load = d.get("tensor", {}).get("load_s", float("nan"))
line = f"{label:34s} {ms:8.2f} ms/it  prep {d['prepare_s']:6.2f} s  load {load:5.2f} s  fit {d['fit']:.6f}"
k = d.get("kernel")
if isinstance(k, dict) and "breakdown" in k:
    parts = []
    for m, b in enumerate(k["breakdown"]):
        c = max(b["calls"], 1)
        red = ""
        if b.get("reduce_bytes", 0):
            red = f" red {b['reduce_ms']/c:.2f} {b['reduce_bytes']/1e6:.0f}MB"
        ar = f" (ar {b['all_reduce_ms']/c:.2f})" if b.get("all_reduce_ms", 0) else ""
        parts.append(f"m{m+1}: mttkrp {b['mttkrp_ms']/c:.2f}{red} upd {b['update_ms']/c:.2f}{ar} "
                     f"xchg {b['exchange_ms']/c:.2f} {b['exchange_rows']} {b['exchange_bytes']/1e6:.0f}/{b['all_gather_bytes']/1e6:.0f}MB")
    line += "\n" + " " * 36 + "; ".join(parts)
    if k.get("plan"):
        line += "\n" + " " * 36 + "plan: " + k["plan"]
    if k.get("exchange_note"):
        line += "\n" + " " * 36 + "exchange: " + k["exchange_note"]
    for p in k.get("placement", []):
        line += "\n" + " " * 36 + p
print(line)
EOF
}

run_cpd() { # label file args...
  local label=$1 file=$2; shift 2
  local f=$R/cpd-$(echo "$label" | tr -d ',' | tr ' /' '__').json
  timeout 400 $K cpd $file -r 32 --tol 0 --json "$@" > $f 2> ${f%.json}.err
  summary "$label" $f | tee -a $R/summary.txt
}

if has tests; then
  for name in ${TESTS:-devices kruskal_device kruskal_group cli multi_gpu multi_gpu_fault distributed gpu_backend kruskal}; do
   for t in gpu-run/tests/$name-*; do
    n=$(basename $t)
    timeout 500 $t --include-ignored --test-threads 1 ${FILTER:-} > $R/test-$n.txt 2>&1
    echo "test $n: rc $? $(grep -E '^test result' $R/test-$n.txt | tail -1)" | tee -a $R/summary.txt
    grep -E "FAILED|panicked" $R/test-$n.txt | head -5
   done
  done
fi

cpd_set() { # name file iters counts...
  local name=$1 file=$2 iters=$3; shift 3
  run_cpd "$name 1 GPU fcoo" $file --iters $iters --backend gpu --kernel fcoo --no-model
  for spec in "$@"; do
    local g=${spec%:*} rows=${spec#*:}
    [ $g -le $GPUS ] || continue
    case "$rows" in
      all) run_cpd "$name $g GPUs all rows" $file --iters $iters --gpus $g --exchange-rows all --gpu-plan rows ;;
      rows) run_cpd "$name $g GPUs rows plan" $file --iters $iters --gpus $g --gpu-plan rows ;;
      split) run_cpd "$name $g GPUs split plan" $file --iters $iters --gpus $g --gpu-plan split ;;
      nccl) run_cpd "$name $g GPUs auto, NCCL reduce" $file --iters $iters --gpus $g --partial-reduce nccl ;;
      allx) run_cpd "$name $g GPUs auto, all rows" $file --iters $iters --gpus $g --exchange-rows all ;;
      read) run_cpd "$name $g GPUs auto, rows read" $file --iters $iters --gpus $g --exchange-rows read ;;
      pull) run_cpd "$name $g GPUs auto, rows read pulled" $file --iters $iters --gpus $g --exchange-rows read --partial-reduce pull ;;
      *) run_cpd "$name $g GPUs auto" $file --iters $iters --gpus $g ;;
    esac
  done
}

if has nell1; then
  if [ -z "${REUSE:-}" ] || [ ! -f /tmp/nell1.ktns ]; then
    /usr/bin/time -v $K gen /tmp/nell1.ktns --like nell-1 --nnz 144M > $R/gen-nell1.txt 2>&1
    grep -E "Elapsed|Maximum resident" $R/gen-nell1.txt
  fi
  cpd_set nell-1 /tmp/nell1.ktns 8 ${NELL1_SPECS:-2:all 2:auto 3:auto 4:all 4:auto}
  if [ -z "${QUICK:-}" ]; then
    run_cpd "nell-1 4 GPUs auto p2p" /tmp/nell1.ktns --iters 8 --gpus 4 --exchange p2p
    run_cpd "nell-1 4 GPUs host-built" /tmp/nell1.ktns --iters 8 --gpus 4 --fcoo-build host
    run_cpd "nell-1 --gpus all" /tmp/nell1.ktns --iters 8 --gpus all
  fi
  # The preparation's steps, as the program prints them.
  timeout 300 $K cpd /tmp/nell1.ktns -r 32 --iters 2 --gpus 4 > $R/nell1-g4-steps.txt 2>&1
  grep -E "gpus|plan|exchange|backend|load|per iteration" $R/nell1-g4-steps.txt | head -20 | tee -a $R/summary.txt
fi
if has full; then
  if [ -z "${REUSE:-}" ] || [ ! -f /tmp/full.ktns ]; then
    $K gen /tmp/full.ktns --dims 3000000,2000000,26000000 --nnz 144M --exponent 0.5 > $R/gen-full.txt 2>&1
  fi
  cpd_set nearly-full /tmp/full.ktns 8 ${FULL_SPECS:-2:auto 4:all 4:auto}
fi
if has t3u; then
  $PY bench/gen_anchor.py t3 /tmp/t3u.ktns 20000000 --distinct > $R/gen-t3u.txt 2>&1
  cpd_set t3u /tmp/t3u.ktns 20 2:auto 4:auto
  run_cpd "t3u --gpus all" /tmp/t3u.ktns --iters 20 --gpus all
fi
if has dist; then
  # One process per GPU (all of this machine's GPUs, at most 4), against
  # --gpus of as many on nell-1 (DIST_ARGS: more flags for every rank,
  # e.g. --gpu-plan rows).
  W=$(( GPUS < 4 ? GPUS : 4 ))
  [ -f /tmp/nell1.ktns ] || $K gen /tmp/nell1.ktns --like nell-1 --nnz 144M > /dev/null 2>&1
  port=$((20000 + RANDOM % 20000)); export KRUSKAL_JOB_TOKEN=$(head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n')
  for r in $(seq $((W - 1)) -1 1); do
    timeout 300 $K cpd /tmp/nell1.ktns -r 32 --tol 0 --iters 8 --json --distributed --process-rank $r --world-size $W --local-gpu $r --rendezvous 127.0.0.1:$port ${DIST_ARGS:-} > $R/dist-$r.json 2> $R/dist-$r.err &
  done
  timeout 300 $K cpd /tmp/nell1.ktns -r 32 --tol 0 --iters 8 --json --distributed --process-rank 0 --world-size $W --local-gpu 0 --rendezvous 127.0.0.1:$port ${DIST_ARGS:-} > $R/cpd-dist$W.json 2> $R/cpd-dist$W.err
  wait
  summary "nell-1 $W processes" $R/cpd-dist$W.json | tee -a $R/summary.txt
fi
if has amazon; then
  if [ -z "${REUSE:-}" ] || [ ! -f /tmp/amazon.ktns ]; then
    /usr/bin/time -v $K gen /tmp/amazon.ktns --like amazon > $R/gen-amazon.txt 2>&1
    grep -E "Elapsed|Maximum resident" $R/gen-amazon.txt
  fi
  for g in 2 4; do
    /usr/bin/time -v timeout 300 $K cpd /tmp/amazon.ktns -r 32 --tol 0 --json --iters 4 --gpus $g > $R/cpd-amazon-$g.json 2> $R/cpd-amazon-$g.err
    summary "amazon $g GPUs" $R/cpd-amazon-$g.json | tee -a $R/summary.txt
    grep -E "Maximum resident" $R/cpd-amazon-$g.err
  done
fi
echo "== summary"; cat $R/summary.txt
