#!/bin/bash
# Train videodit on several nodes with Slurm: one torchrun per node, 8 GPUs each.
#   sbatch --nodes 4 scripts/slurm_train.sh CONFIG.yaml /shared/runs/exp1 [key=value ...]
#SBATCH --job-name=videodit
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=64
#SBATCH --output=%x-%j.out
set -euo pipefail
config=$1; out=$2; shift 2
head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
# HSDP: shard within a node, replicate across nodes; resume=auto continues after a requeue.
srun torchrun --nnodes "$SLURM_NNODES" --nproc-per-node 8 \
    --rdzv-backend c10d --rdzv-endpoint "$head:29500" --rdzv-id "$SLURM_JOB_ID" \
    -m videodit train "$config" --out "$out" \
    parallel.dp_replicate="$SLURM_NNODES" parallel.dp_shard=8 resume=auto "$@"
