#!/bin/bash
# Train videodit on the nodes of a Slurm allocation: one torchrun agent per node (srun, one task
# per node), the agents meeting by c10d rendezvous on the allocation's first node.
#
#   sbatch --nodes 4 scripts/slurm_train.sh CONFIG /shared/runs/exp1 [key=value ...]
#
# - The run folder must be on a file system every node sees: rank 0 writes it (metrics, logs,
#   checkpoint files, samples), every rank writes its DCP shards into it.
# - Layout: HSDP, sharded within a node and replicated across nodes
#   (parallel.dp_replicate=NODES parallel.dp_shard=PROCESSES_PER_NODE); key=value arguments
#   after OUT come later and win (e.g. parallel.sp=2 parallel.dp_shard=-1).
# - resume=auto: a requeued job (--requeue: after a node failure or a preemption) continues from
#   the newest complete checkpoint of the run folder.
# - srun --kill-on-bad-exit: a node that dies ends the whole step at once, instead of leaving the
#   other agents waiting in the rendezvous.
# Settings from the environment (sbatch exports it): VIDEODIT_PROCS_PER_NODE (default: the GPUs
# Slurm gave the node, else 8), VIDEODIT_RDZV_PORT (default: 20000 + job id mod 20000, so two jobs
# sharing a first node do not collide), PYTHON (default: python; its torch and videodit are used).
# The GPU and CPU requests below are defaults; options given to sbatch override them
# (a CPU rehearsal: --gpus-per-node=0 --cpus-per-task=2 with VIDEODIT_PROCS_PER_NODE=2).
#SBATCH --job-name=videodit
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=64
#SBATCH --requeue
#SBATCH --output=%x-%j.out
set -euo pipefail
if [ $# -lt 2 ]; then
    echo "usage: sbatch --nodes N $0 CONFIG OUT [key=value ...]" >&2
    exit 2
fi
config=$1; out=$2; shift 2
gpus=${SLURM_GPUS_ON_NODE:-0}
procs=${VIDEODIT_PROCS_PER_NODE:-$([ "$gpus" -gt 0 ] 2>/dev/null && echo "$gpus" || echo 8)}
port=${VIDEODIT_RDZV_PORT:-$((20000 + SLURM_JOB_ID % 20000))}
head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
echo "videodit: job $SLURM_JOB_ID, $SLURM_NNODES node(s) x $procs process(es), rendezvous $head:$port," \
     "restart $((${SLURM_RESTART_COUNT:-0}))"
srun --kill-on-bad-exit=1 "${PYTHON:-python}" -m torch.distributed.run \
    --nnodes "$SLURM_NNODES" --nproc-per-node "$procs" \
    --rdzv-backend c10d --rdzv-endpoint "$head:$port" --rdzv-id "$SLURM_JOB_ID" \
    -m videodit train "$config" --out "$out" \
    parallel.dp_replicate="$SLURM_NNODES" parallel.dp_shard="$procs" resume=auto "$@"
