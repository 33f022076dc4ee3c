#!/bin/bash
# flowgraph as a Ray job: submit a run to a Ray cluster that is already up (`ray start`,
# KubeRay, deploy/slurm/ray.sbatch...), from any machine that reaches its dashboard.
#
#   RAY_API=http://head:8265 RUN_DIR=/shared/runs/grpo deploy/ray/submit.sh
#
# `ray job submit` uploads WORKING_DIR (graph files, plugins, data next to them) and
# runs `flowgraph run --target ray --address auto` on the head node, where Ray sets
# RAY_ADDRESS for it: the driver joins the cluster it was submitted to. flowgraph must
# be installed on every node (the upload is your files, not the package). The job's
# log follows in this terminal; Ctrl-C leaves the job running (`ray job stop ID` stops
# it, `ray job logs -f ID` follows it again).
#
# A cluster with token authentication (Ray's default when a token exists; what
# deploy/slurm/ray.sbatch sets up) needs RAY_AUTH_MODE=token and the cluster's token
# here too: RAY_AUTH_TOKEN_PATH=FILE, or ~/.ray/auth_token.

# ---- what you set (here, or in the environment) ---------------------------------------
RAY_API=${RAY_API:-http://127.0.0.1:8265}  # the head's dashboard (ray start --dashboard-port)
GRAPH=${GRAPH:-graphs/grpo.yaml}          # relative to WORKING_DIR
WORKING_DIR=${WORKING_DIR:-.}             # uploaded with the job
RUN_DIR=${RUN_DIR:?set RUN_DIR: an absolute path on a filesystem every node sees}
NPROC=${NPROC:-2}                         # workers of each resource pool (--nproc)
RESUME=${RESUME:-0}                       # 1: continue the run in RUN_DIR (--resume)
OVERRIDES=${OVERRIDES:-}                  # graph overrides, space-separated KEY=VALUE
# ---------------------------------------------------------------------------------------

set -euo pipefail

# The job runs in a copy of WORKING_DIR on the head, removed after it: a relative run
# dir would be written there and lost.
if [[ $RUN_DIR != /* ]]; then
    echo "RUN_DIR=$RUN_DIR is relative; give an absolute path on the shared filesystem" >&2
    exit 2
fi

read -r -a overrides <<< "$OVERRIDES"
args=(run "$GRAPH" --target ray --address auto --nproc "$NPROC"
      "trainer.run_dir=$RUN_DIR" "${overrides[@]}")
if [[ $RESUME == 1 ]]; then
    args+=(--resume)
fi
# How the run continues, in this script's words: the job's driver prints it when it
# stops (FLOWGRAPH_RESUME_WITH, in the job's environment).
resume="RESUME=1 RAY_API=$RAY_API GRAPH=$GRAPH WORKING_DIR=$WORKING_DIR RUN_DIR=$RUN_DIR"
resume+=" NPROC=$NPROC${OVERRIDES:+ OVERRIDES='$OVERRIDES'} $0"
runtime_env=$(python -c 'import json, sys
print(json.dumps({"env_vars": {"FLOWGRAPH_RESUME_WITH": sys.argv[1]}}))' "$resume")
# Exits 1 when the job fails.
ray job submit --address "$RAY_API" --working-dir "$WORKING_DIR" \
    --runtime-env-json "$runtime_env" -- flowgraph "${args[@]}"
