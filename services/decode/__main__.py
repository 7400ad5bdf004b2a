"""`python -m services.decode --model M.gguf --device cuda:0 --gateway tcp://host:5555`

Starts a worker hosting the decode role; on one device it also hosts the prefill role in the
same process (one copy of the weights, one KV pool, one scheduler interleaving both).
"""

import sys

from shared.worker.config import parse_worker_args

if __name__ == "__main__":
    config = parse_worker_args(None, __doc__)  # --help answers before torch is imported
    from shared.worker.worker import run_worker

    sys.exit(run_worker(config))
