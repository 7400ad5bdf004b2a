"""`python -m services.spec --endpoint tcp://127.0.0.1:5598 [--max-seqs N] [--max-tokens T]
[--ngram-min A] [--ngram-max B] [--table-dir D] [--table-max-ngrams N] [--metrics-port P]
[--draft DRAFT.gguf [--target MODEL.gguf] [--draft-device cpu|cuda:N] [--draft-threads T]]`

Starts the spec service: a ROUTER that workers attach to, which keeps a copy of each speculating
sequence's tokens and answers each ask with the drafts its proposers find (prompt lookup, then
the persistent domain n-gram tables it learns from finished sequences, then a draft model's greedy
guesses when one is given). Exits cleanly on SIGTERM or SIGINT.
"""

import sys

from services.spec.config import parse_spec_args

if __name__ == "__main__":
    config = parse_spec_args(None, __doc__)
    from services.spec.service import serve

    sys.exit(serve(config))
