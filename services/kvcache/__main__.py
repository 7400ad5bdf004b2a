"""`python -m services.kvcache --endpoint tcp://127.0.0.1:5599 [--ram-gb G] [--disk-dir D]
[--disk-gb G] [--shm-dir S] [--metrics-port P]`

Starts the kvcache service: a ROUTER that workers attach to, a shared-memory RAM tier of block
slots and an LMDB disk tier that outlives restarts. Exits cleanly on SIGTERM or SIGINT.
"""

import sys

from services.kvcache.config import parse_kvcache_args

if __name__ == "__main__":
    config = parse_kvcache_args(None, __doc__)
    from services.kvcache.service import serve

    sys.exit(serve(config))
