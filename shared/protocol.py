"""The wire: every message between Skiff processes, as msgspec structs. Imports no runtime code.

Sockets (DESIGN.md, "The wire"):
- gateway ROUTER <-> worker DEALER: `GatewayToWorker` down (requests, aborts), `WorkerToGateway`
  up (ready announcement, heartbeats, rejections).
- worker PUSH -> gateway PULL: one `StepTokens` per engine step with every sequence's new token.
Each message is one msgpack frame; its tag (a short string) says which struct it is.
"""

from __future__ import annotations

from typing import Literal

import msgspec

PROTOCOL_VERSION = 1
HEARTBEAT_INTERVAL_S = 0.2
HEARTBEAT_TIMEOUT_S = 0.8  # the gateway declares a silent worker dead after this

FinishReason = Literal["stop", "length", "abort", "error"]


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


# -- gateway -> worker ----------------------------------------------------------------------------


class Generate(_Msg, tag="gen"):
    request_id: str
    prompt_ids: list[int]
    max_tokens: int
    sampling: Sampling = Sampling()
    stop_ids: list[int] = []


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


class Heartbeat(_Msg, tag="hb"):
    worker_id: str
    kv_blocks_used: int
    kv_blocks_free: int
    running: int
    waiting: int


class Rejected(_Msg, tag="rej"):
    """A request the worker cannot take (e.g. too long for its KV pool); `status` is HTTP-like."""

    request_id: str
    status: int
    message: str


class TokenOut(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    request_id: str
    token_id: int
    logprob: float = 0.0
    top_ids: list[int] | None = None
    top_logprobs: list[float] | None = None
    finish_reason: FinishReason | None = None


class StepTokens(_Msg, tag="step"):
    worker_id: str
    tokens: list[TokenOut]


GatewayToWorker = Generate | Abort
WorkerToGateway = WorkerReady | Heartbeat | Rejected
WorkerTokens = StepTokens

ALL_MESSAGES = (Generate, Abort, WorkerReady, Heartbeat, Rejected, StepTokens)


def encoder() -> msgspec.msgpack.Encoder:
    return msgspec.msgpack.Encoder()


def decoder(kind: type) -> msgspec.msgpack.Decoder:
    """A decoder for one direction, e.g. `decoder(GatewayToWorker)`."""
    return msgspec.msgpack.Decoder(kind)
