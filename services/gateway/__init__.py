"""Gateway role: the OpenAI-compatible HTTP API (aiohttp) in front of the workers.

It tokenizes and renders chat templates, validates requests, routes each to the least-loaded
live worker over ZMQ (shared/protocol.py), streams tokens back as text (SSE), cancels requests
whose clients leave, and serves /health, /metrics, /tokenize and /detokenize. It reads only the
GGUF header and never imports torch, triton or model code.

Run: `python -m services.gateway --model MODEL.gguf` (see config.py for flags and SKIFF_* env).
"""
