"""The wire: every message between Skiff processes, as msgspec structs. Imports no runtime code.

Sockets (DESIGN.md, "The wire"):
- gateway ROUTER <-> worker DEALER: `GatewayToWorker` down (requests, aborts), `WorkerToGateway`
  up (ready announcement, heartbeats, rejections, prefilled prompts handed on).
- worker PUSH -> gateway PULL: one `StepTokens` per engine step with every sequence's new token.
- worker DEALER <-> spec ROUTER: `WorkerToSpec` up (each step's new tokens of the sequences
  that speculate, and how many tokens to propose), `SpecToWorker` down (the proposals).
- worker DEALER <-> kvcache ROUTER: `WorkerToKV` up, `KVToWorker` down. The KV bytes never ride
  these messages: on one host they sit in the kvcache's shared-memory segment of fixed-size slots
  (one block each), which both processes map; a message names slots by number.
- pipeline stages of one worker, a ring of PUSH -> PULL: stage 0 (the worker) sends a `StageStep`
  to stage 1, each stage sends its layers' output on to the next, the last back to stage 0; the
  activations ride as raw frames after the header (x, then the residual stream if any). Stages
  report `StageReady` / `StageFailed` to stage 0's control PULL.
Each message is one msgpack frame; its tag (a short string) says which struct it is.
"""

from __future__ import annotations

from typing import Literal

import msgspec

PROTOCOL_VERSION = 1
HEARTBEAT_INTERVAL_S = 0.2
HEARTBEAT_TIMEOUT_S = 0.8  # the gateway declares a silent worker dead after this

FinishReason = Literal["stop", "length", "abort", "error"]
# a domain n-gram table's name (`Generate.domain`, `SpecSeq.domain`): letters, digits, '.', '_',
# '-', at most 64, starting with a letter or digit
DOMAIN_PATTERN = r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}"


class _Msg(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag_field="t"):
    pass


class Sampling(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, frozen=True):
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    logprobs: int | None = None  # None: none; k: the chosen token's plus the top k
    # structured output: llguidance's grammar the output must match ("": none); the worker
    # masks every step's tokens with it (shared/grammar)
    grammar: str = ""


# -- gateway -> worker ----------------------------------------------------------------------------


class Generate(_Msg, tag="gen"):
    request_id: str
    prompt_ids: list[int]
    max_tokens: int  # output tokens in all, those in `output_ids` included
    sampling: Sampling = Sampling()
    stop_ids: list[int] = []
    # disaggregated serving (a prefill worker hands a prompt on to a decode worker):
    # `prefill_only`: compute the prompt, send its first token, then a `Prefilled` instead of
    # decoding on. A resumed request carries the tokens generated so far (`output_ids`, sent to
    # the client already) and its seeded generator's state (`rng_state`: torch's bytes for
    # `rng_device`'s generator type; another type re-seeds from the seed and the output length).
    prefill_only: bool = False
    output_ids: list[int] = []
    rng_state: bytes = b""
    rng_device: str = ""
    domain: str = ""  # the spec service's domain n-gram table its drafts may come from


class Abort(_Msg, tag="abort"):
    request_id: str


# -- worker -> gateway ----------------------------------------------------------------------------


class WorkerReady(_Msg, tag="ready"):
    worker_id: str
    device: str  # "cpu", "cuda:0", ...
    device_name: str
    roles: list[str]  # "prefill", "decode"
    model: str
    kv_blocks_total: int
    block_size: int
    max_model_len: int
    pid: int
    instance: str = ""  # random per process start: a re-announcement keeps it, a restart not
    protocol: int = PROTOCOL_VERSION


class Histogram(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Observations (seconds) by bucket since the sender started: counts[i] of those in
    (le[i-1], le[i]], the last count those above every bound; their sum."""

    le: list[float]
    counts: list[int]
    sum: float = 0.0


class Heartbeat(_Msg, tag="hb"):
    worker_id: str
    kv_blocks_used: int
    kv_blocks_free: int
    running: int
    waiting: int
    # the KV tiers as this worker saw them, counts since it started: blocks stored (copied
    # out), restored, lookups, lookups timed out, found blocks not matching the prompt, blocks
    # not stored for want of a granted slot
    kv_tiers: dict[str, int] = {}
    # speculation, counts since it started: "steps" verified, and per proposer the tokens
    # "drafted:<source>" and "accepted:<source>"
    spec: dict[str, int] = {}
    # structured output, counts since it started: steps that masked logits ("steps"), masked
    # rows ("rows"), host microseconds filling the masks ("fill_us"), applying them
    # ("apply_us") and waiting first for the tokens of the step in flight ("catch_up_us")
    grammar: dict[str, int] = {}
    # the KV tiers' restores as this worker timed them: "latency" from the lookup sent to the
    # blocks in the pool, "copy" the RAM tier -> pool copies alone
    kv_restore: dict[str, Histogram] = {}


class Rejected(_Msg, tag="rej"):
    """A request the worker cannot take (e.g. too long for its KV pool); `status` is HTTP-like."""

    request_id: str
    status: int
    message: str


class Prefilled(_Msg, tag="prefilled"):
    """A `prefill_only` request's prompt is computed and its first token sent (on the token
    socket); its full KV blocks are in the kvcache's RAM tier (`stored` of them confirmed
    indexed), so a decode worker looks them up. The gateway sends the rest to one."""

    request_id: str
    output_ids: list[int]
    rng_state: bytes = b""
    rng_device: str = ""
    stored: int = 0


class TokenOut(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    request_id: str
    token_id: int
    logprob: float = 0.0
    top_ids: list[int] | None = None
    top_logprobs: list[float] | None = None
    finish_reason: FinishReason | None = None
    cached_tokens: int = 0  # on a sequence's first token: prompt tokens it did not compute


class StepTokens(_Msg, tag="step"):
    worker_id: str
    tokens: list[TokenOut]


# -- worker <-> kvcache ----------------------------------------------------------------------------
# Slots: the kvcache's RAM tier is one file of `slots` x `block_bytes` per model key (under
# /dev/shm), which a worker maps. A block's bytes are its K then V of every layer in order (then
# FP8 scales), `shared.kv.block_io`'s layout. A worker writes only into slots granted to it
# (`KVAttach.granted`, `KVGrant`) and reads only slots a `KVFound` pinned for it until its
# `KVRelease`. Every message after the attach carries the kvcache's `instance`: one from an
# earlier kvcache process is answered by `KVStale` (the worker attaches again).


class KVBlock(msgspec.Struct, array_like=True, gc=False):
    hash: int  # the chained block hash (BlockManager.commit), model key included
    slot: int
    tokens: list[int]  # the block's token ids: every hit is checked against them


class KVHello(_Msg, tag="kvhello"):
    worker_id: str
    model_key: str  # hex: model file identity, KV dtype and scales, block size, layer layout
    block_bytes: int
    want_slots: int  # free slots the worker asks to hold for writing


class KVPut(_Msg, tag="kvput"):
    """Blocks the worker wrote into granted slots (their copies have finished); the kvcache
    indexes them (or frees the slot of a hash it has) and answers with a `KVGrant`."""

    instance: str
    blocks: list[KVBlock]
    upto: int = 0  # the worker's count of blocks stored, this put's last included


class KVLookup(_Msg, tag="kvlookup"):
    """The hashes of a prompt's full blocks after those in the worker's VRAM, in order."""

    instance: str
    lookup_id: int
    hashes: list[int]


class KVRelease(_Msg, tag="kvrelease"):
    """Slots of a `KVFound` the worker has copied out of."""

    instance: str
    slots: list[int]


class KVAlive(_Msg, tag="kvalive"):
    """Sent by an attached worker that has sent nothing else for a while: the kvcache frees the
    grants and pins of a worker silent for longer than its timeout (a worker that died)."""

    instance: str


class KVAttach(_Msg, tag="kvattach"):
    instance: str  # random per kvcache process start
    segment: str  # path of the shared-memory file to map
    slots: int
    block_bytes: int
    granted: list[int]


class KVGrant(_Msg, tag="kvgrant"):
    instance: str
    slots: list[int]
    upto: int = 0  # the answered put's `upto`: every block stored up to it is indexed


class KVFound(_Msg, tag="kvfound"):
    """The leading run of the looked-up hashes that the RAM or disk tier holds, each in a RAM
    slot pinned for this worker (disk hits read, checksum-verified and copied into RAM first);
    empty when the first hash is unknown."""

    instance: str
    lookup_id: int
    blocks: list[KVBlock]


class KVStale(_Msg, tag="kvstale"):
    instance: str  # the kvcache's current one


# -- worker <-> spec ------------------------------------------------------------------------------
# The spec service keeps each sequence's tokens (keyed by the worker's socket identity and the
# sequence id) and proposes what may follow them. A proposal names the sequence length it
# continues (`at`): one for an older length is stale and not used. A worker never waits for a
# proposal beyond a short grace: a late one is dropped.


class SpecSeq(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    seq_id: int
    start: int  # position of tokens[0]: the service's copy is cut there and extended
    tokens: list[int]  # 0 first: the whole prompt (and output so far)
    k: int  # most tokens to propose (0: none now, the tokens are only recorded)
    domain: str = ""  # a persistent n-gram table to draw on too ("": prompt lookup alone)


class SpecAsk(_Msg, tag="specask"):
    seqs: list[SpecSeq]


class SpecEnd(_Msg, tag="specend"):
    """Sequences that finished: the service forgets them (their outputs may teach a table)."""

    seq_ids: list[int]


class SpecDraft(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    seq_id: int
    at: int  # the sequence length these tokens would follow
    tokens: list[int]
    source: str = "prompt"  # which proposer: "prompt" (lookup), "table", "draft"


class SpecDrafts(_Msg, tag="specdrafts"):
    drafts: list[SpecDraft]
    unknown: list[int] = []  # sequences asked about from start > 0 it has no copy of: resend


# -- pipeline stages ------------------------------------------------------------------------------


class StageBatch(msgspec.Struct, array_like=True, gc=False):
    """A step's ForwardBatch as host lists (``ForwardBatch.to_lists``), for every stage to
    rebuild on its own device."""

    token_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]
    logits_rows: list[int]
    block_tables: list[int]  # [sequences, width] flattened
    width: int
    query_start_loc: list[int]
    seq_lens: list[int]


class StageStep(_Msg, tag="stagestep"):
    """One micro-batch through the stages. Frames after this header: x, and the residual
    stream when there is one, each [tokens, d_model], C order, of the torch dtype `dtypes`
    names (each stage computes in its own)."""

    step: int  # stage 0's count: a reply answers the step it names
    batch: StageBatch
    dtypes: list[str]  # one per frame: x's, then the residual's


class StageStop(_Msg, tag="stagestop"):
    """Stage 0 stops: each stage passes it on and exits (a stage server waits for the next
    StageAssign instead)."""


class StageAssign(_Msg, tag="stageassign"):
    """Stage 0 to a stage server on another host (`python -m shared.pipeline.stage --serve
    ENDPOINT`), on the socket the ring's steps then arrive on: the part of the model it holds
    and where its ring goes. A server takes a new assignment whenever one comes (a restarted
    worker), dropping the part it held."""

    stage: int
    model: str  # the file's path on stage 0's host (the server may name its own copy)
    model_bytes: int  # the file's size: both ends must hold the same file
    layers: list[int]  # [first, last)
    kv_blocks: int
    block_size: int
    kv_dtype: str
    send: str  # the next stage's endpoint (stage 0's return endpoint after the last)
    lead: str  # stage 0's control endpoint (StageReady / StageFailed)
    max_seqs: int = 256
    max_model_len: int = 8192
    cuda_graphs: str = "all"
    dense_copies: str = "auto"
    cpu_weights: str = "native"


class StageReady(_Msg, tag="stageready"):
    stage: int
    device: str  # e.g. "cpu", "cuda:1"
    kind: str  # the device's name
    layers: list[int]  # [first, last)
    kv_blocks: int
    choices: str = ""  # the kernels this stage chose (its device's profile), for the start table


class StageFailed(_Msg, tag="stagefailed"):
    stage: int
    error: str


StageToStage = StageStep | StageStop | StageAssign
StageToLead = StageReady | StageFailed

WorkerToKV = KVHello | KVPut | KVLookup | KVRelease | KVAlive
KVToWorker = KVAttach | KVGrant | KVFound | KVStale
WorkerToSpec = SpecAsk | SpecEnd
SpecToWorker = SpecDrafts

GatewayToWorker = Generate | Abort
WorkerToGateway = WorkerReady | Heartbeat | Rejected | Prefilled
WorkerTokens = StepTokens

ALL_MESSAGES = (
    Generate, Abort, WorkerReady, Heartbeat, Rejected, Prefilled, StepTokens,
    KVHello, KVPut, KVLookup, KVRelease, KVAlive, KVAttach, KVGrant, KVFound, KVStale,
    SpecAsk, SpecEnd, SpecDrafts, StageStep, StageStop, StageAssign, StageReady, StageFailed,
)  # fmt: skip


def encoder() -> msgspec.msgpack.Encoder:
    return msgspec.msgpack.Encoder()


def decoder(kind: type) -> msgspec.msgpack.Decoder:
    """A decoder for one direction, e.g. `decoder(GatewayToWorker)`."""
    return msgspec.msgpack.Decoder(kind)
