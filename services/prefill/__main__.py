"""`python -m services.prefill --model M.gguf --device cuda:0 --gateway tcp://host:5555`

Starts a worker hosting the prefill role. Until KV blocks can move between workers (the kvcache
service), a prefill worker also decodes what it prefilled: both roles share the process, as
they do on one device.
"""

import sys

from shared.worker.config import parse_worker_args

if __name__ == "__main__":
    config = parse_worker_args(None, __doc__)  # --help answers before torch is imported
    from shared.worker.worker import run_worker

    sys.exit(run_worker(config))
