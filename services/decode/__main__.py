"""`python -m services.decode --model M.gguf --device cuda:0 --gateway tcp://host:5555`

Starts a worker hosting the decode role. It also prefills what it is given (one copy of the
weights, one KV pool, one scheduler interleaving prompt chunks with decode steps), so alone it
serves whole requests; beside prefill workers (`python -m services.prefill`) it goes on with the
prompts they hand on, restoring their KV blocks from the kvcache's RAM tier (`--kvcache`).
"""

import sys

from shared.worker.config import parse_worker_args

if __name__ == "__main__":
    config = parse_worker_args(None, __doc__)  # --help answers before torch is imported
    from shared.worker.worker import run_worker

    sys.exit(run_worker(config))
