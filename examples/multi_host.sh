#!/usr/bin/env bash
# The README main job on two machines, one worker each. Run ONE of the two lines on each
# host, from a checkout with gf_tf installed (pip install ".[models]"). Replace the
# addresses with the hosts' addresses on a private network; port 2222 must be reachable
# between the hosts and from nowhere else (TensorFlow's worker servers listen on all
# interfaces and have no authentication).
#
#   host A (10.0.0.1, the chief):  examples/multi_host.sh 0
#   host B (10.0.0.2):             examples/multi_host.sh 1
set -euo pipefail
WORKERS="${WORKERS:-10.0.0.1:2222,10.0.0.2:2222}"
INDEX="${1:?usage: $0 WORKER_INDEX  (0 on the first host of WORKERS, 1 on the second, ...)}"
shift
# gf-tf-run writes TF_CONFIG={"cluster": {"worker": [WORKERS]}, "task": {"type": "worker",
# "index": INDEX}}, checks it as a worker would, and prefixes the output with the task.
exec gf-tf-run --workers "$WORKERS" --index "$INDEX" -- python -m models.train "$@"

# The same without gf-tf-run, exporting TF_CONFIG by hand (host A; index 1 on host B):
#   TF_CONFIG='{"cluster": {"worker": ["10.0.0.1:2222", "10.0.0.2:2222"]}, "task": {"type": "worker", "index": 0}}' \
#     python -m models.train
