"""llama-server's /tokenize and /detokenize: text <-> token ids with the served model's tokenizer.

/tokenize parses special-token text (e.g. "<|im_start|>") into those tokens unless
`parse_special` is false, and adds BOS/EOS only when `add_special` is true.
"""

from __future__ import annotations

from aiohttp import web

from services.gateway.errors import invalid
from services.gateway.request_params import Fields, decode_body
from services.gateway.state import GATEWAY


async def tokenize(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    tok = gw.model.tokenizer
    f = Fields(decode_body(await request.read()))
    content = f.get("content")
    if not isinstance(content, str):
        raise invalid("'content' must be a string", "content")
    ids = await gw.prompts.encode(
        content,
        add_special=f.boolean("add_special", False),
        special=f.boolean("parse_special", True),
    )
    if not f.boolean("with_pieces", False):
        return web.json_response({"tokens": ids})
    pieces = []
    for i in ids:
        raw = tok.token_to_piece(i)
        try:
            piece: str | list[int] = raw.decode("utf-8")
        except UnicodeDecodeError:  # part of a character: llama-server gives the bytes
            piece = list(raw)
        pieces.append({"id": i, "piece": piece})
    return web.json_response({"tokens": pieces})


async def detokenize(request: web.Request) -> web.Response:
    tok = request.app[GATEWAY].model.tokenizer
    ids = decode_body(await request.read()).get("tokens")
    if not isinstance(ids, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in ids
    ):
        raise invalid("'tokens' must be a list of token ids", "tokens")
    bad = next((t for t in ids if not 0 <= t < tok.vocab_size), None)
    if bad is not None:
        raise invalid(f"token id {bad} is outside the vocabulary ({tok.vocab_size})", "tokens")
    return web.json_response({"content": tok.decode(ids)})
