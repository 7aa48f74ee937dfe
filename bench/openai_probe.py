"""Timings of any OpenAI-compatible server, taken through its HTTP API by one client.

The same requests go to kvtier and to another engine (vLLM's CPU build), so prompts are
token ids (`/v1/completions` takes them in both): each server sees exactly the same
tokens, however its tokenizer would have split a text. Generation ignores EOS so a
request decodes as many tokens as asked.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass

import httpx

REQUEST_TIMEOUT_S = 900


@dataclass
class StreamTiming:
    """One streamed completion: time to its first token and between the later chunks."""

    ttft_s: float
    inter_token_s: list[float]
    output_tokens: int  # as asked: generation ignores EOS

    @property
    def tpot_s(self) -> float:
        """Mean time per output token after the first (vLLM's TPOT). Unlike the median
        gap, it cannot look faster when a server delivers its tokens in bursts."""
        return sum(self.inter_token_s) / max(1, self.output_tokens - 1)


def _body(model: str, prompt: list[int], max_tokens: int, stream: bool) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": stream}


def stream_completion(url: str, model: str, prompt: list[int], max_tokens: int) -> StreamTiming:
    """Stream one completion of `prompt`; each chunk with text counts as a token arriving
    (a chunk that carries several, when a detokenizer held back a partial character,
    counts once: the median of the gaps does not move)."""
    arrivals: list[float] = []
    start = time.perf_counter()
    with httpx.stream("POST", f"{url}/v1/completions", json=_body(model, prompt, max_tokens, True),
                      timeout=REQUEST_TIMEOUT_S) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choices = json.loads(line[6:]).get("choices") or []
            if choices and choices[0].get("text"):
                arrivals.append(time.perf_counter())
    if not arrivals:
        raise RuntimeError(f"{url}: the stream carried no text")
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    return StreamTiming(arrivals[0] - start, gaps, max_tokens)


def concurrent_output_rate(url: str, model: str, prompts: Sequence[list[int]], max_tokens: int) -> float:
    """Output tokens per second of all `prompts` sent at once (one connection each)."""
    async def run() -> tuple[int, float]:
        limits = httpx.Limits(max_connections=len(prompts))
        async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S, limits=limits) as client:
            async def one(prompt: list[int]) -> int:
                response = await client.post(f"{url}/v1/completions", json=_body(model, prompt, max_tokens, False))
                response.raise_for_status()
                return response.json()["usage"]["completion_tokens"]

            start = time.perf_counter()
            counts = await asyncio.gather(*(one(p) for p in prompts))
            return sum(counts), time.perf_counter() - start

    tokens, seconds = asyncio.run(run())
    return tokens / seconds
