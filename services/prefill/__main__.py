"""`python -m services.prefill --model M.gguf --device cuda:0 --gateway tcp://host:5555 --kvcache
tcp://host:5557`

Starts a prefill worker: it computes the prompts the gateway sends it (in chunks, with the
prefix cache and the kvcache's tiers like every worker), sends each one's first token, and hands
the request on to a decode worker (`python -m services.decode`), which finds the prompt's KV
blocks in the kvcache's RAM tier (handoff.py). While no decode worker is connected, the gateway
sends it whole requests and it serves them alone.
"""

import sys

from shared.worker.config import parse_worker_args

if __name__ == "__main__":
    config = parse_worker_args(None, __doc__, roles=("prefill",))  # --help before torch
    from services.prefill.handoff import HandOff
    from shared.worker.worker import run_worker

    sys.exit(run_worker(config, HandOff))
