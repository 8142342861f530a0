#!/bin/bash
# One GPU: the best one-GPU engine (fcoo) against the shard kernel of
# the several-GPU path (--gpus 1), on t3, same GPU, same call. Usage, from
# the repository root of a bundle on the GPU machine:
#   bash bench/shard-vs-fcoo.sh OUT_DIR   (K=path/to/kruskal, default gpu-run/kruskal)
set -u
N=/opt/torch/.venv/lib/python3.12/site-packages/nvidia/nccl/lib
mkdir -p /tmp/nccl && ln -sf $N/libnccl.so.2 /tmp/nccl/libnccl.so
export LD_LIBRARY_PATH=/tmp/nccl:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-} NCCL_NVLS_ENABLE=0
export KRUSKAL_CACHE_DIR=/tmp/kc
PY=/opt/torch/.venv/bin/python
K=${K:-gpu-run/kruskal}
R=${1:?an output folder}; mkdir -p $R
date -u > $R/date.txt; nvidia-smi --query-gpu=name --format=csv,noheader >> $R/date.txt
mkdir -p anchors; $PY bench/gen_anchor.py t3 anchors/t3.ktns > $R/gen.txt 2>&1; $K convert anchors/t3.ktns /tmp/t3c.ktns > /dev/null 2>&1
timeout 120 $K mttkrp /tmp/t3c.ktns --backend gpu --kernel fcoo --no-model -r 32 --repeat 10 > $R/fcoo.txt 2>&1
timeout 120 $K mttkrp /tmp/t3c.ktns --gpus 1 -r 32 --repeat 10 --verify > $R/shard.txt 2>&1
timeout 120 $K cpd /tmp/t3c.ktns --backend gpu --kernel fcoo --no-model -r 32 --iters 20 --tol 0 --json > $R/cpd-gpu.json 2> $R/cpd-gpu.err
timeout 120 $K cpd /tmp/t3c.ktns --gpus 1 -r 32 --iters 20 --tol 0 --json > $R/cpd-g1.json 2> $R/cpd-g1.err
cat $R/date.txt; grep -E "all |mode|^ +[0-9] " $R/fcoo.txt | head -6; tail -15 $R/shard.txt
for f in cpd-gpu cpd-g1; do $PY -c "import json; d=json.load(open('$R/$f.json')); it=d['iterations']; print('$f', d['cpd_s'], d['prepare_s'], len(it) if isinstance(it,list) else it, d['fit'])" 2>&1 | tail -1; done
