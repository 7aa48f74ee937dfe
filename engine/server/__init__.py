"""The OpenAI-compatible HTTP server of `kvtier serve` (FastAPI + uvicorn).

Module map: api_server (app, routes, process lifecycle), serving (completions and chat),
prompts (tokenization off the engine thread, length check), request_body (big JSON bodies
decoded and validated off the event loop), body_decoder (the thread and resident memory they
are decoded in), protocol (request/response models), responses
(output shaping), streams (per-call engine requests, disconnects), errors, middleware
(body size, arrival time, slow bodies per client), auth (--api-key on /v1/), metrics,
admin (/kv/), state (what routes share).
"""
