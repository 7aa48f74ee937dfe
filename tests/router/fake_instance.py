"""A stand-in for a `kvtier serve` instance on a loopback port, for the router's HTTP tests:
a real asyncio server speaking HTTP/1.1 byte by byte, so a test controls what an instance
does on the wire (when each chunk goes out, a connection closed mid-answer or before
any) and sees what reaches it (requests, connections, a client gone).

GET /health, /load, /instance and /metrics answer as an instance does (an idle one); every other request goes
to `handler(request, writer)`, which writes the answer itself (`answer_json`,
`start_chunked`, `chunk`, `end_chunked`) or closes the connection.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

WORDS = ["[UNK]", "<s>", "</s>", *(f"w{i}" for i in range(100))]


def save_tokenizer(path: Path) -> str:
    """A word-level tokenizer (w0 ... w99) with a chat template, saved as a checkpoint's."""
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", bos_token="<s>", eos_token="</s>",
                                   chat_template="{% for m in messages %}{{ m['content'] }} {% endfor %}")
    fast.save_pretrained(path)
    return str(path)


@dataclass
class Request:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    reader: asyncio.StreamReader = field(repr=False)

    async def client_gone(self) -> None:
        """Returns once the client closed the connection (for a handler that keeps answering)."""
        while await self.reader.read(1024):
            pass

    def json(self) -> object:
        return json.loads(self.body)


Handler = Callable[[Request, asyncio.StreamWriter], Awaitable[None]]


async def answer(writer: asyncio.StreamWriter, content: bytes, status: int = 200,
                 content_type: bytes = b"application/json", close: bool = False) -> None:
    connection = b"connection: close\r\n" if close else b""
    writer.write(b"HTTP/1.1 %d X\r\ncontent-type: %s\r\ncontent-length: %d\r\n%s\r\n%s"
                 % (status, content_type, len(content), connection, content))
    await writer.drain()


async def answer_json(writer: asyncio.StreamWriter, body: object, status: int = 200, close: bool = False) -> None:
    await answer(writer, json.dumps(body).encode(), status, close=close)


async def start_chunked(writer: asyncio.StreamWriter, content_type: bytes = b"text/event-stream") -> None:
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: %s\r\ntransfer-encoding: chunked\r\n\r\n" % content_type)
    await writer.drain()


async def chunk(writer: asyncio.StreamWriter, data: bytes) -> None:
    writer.write(b"%x\r\n%s\r\n" % (len(data), data))
    await writer.drain()


async def end_chunked(writer: asyncio.StreamWriter) -> None:
    writer.write(b"0\r\n\r\n")
    await writer.drain()


def gated_stream(gate: asyncio.Event, wait_s: float) -> Handler:
    """Answers a stream of two events, the second only once `gate` is set: a client that
    waits for more than what arrived before passing it on never sees the first."""

    async def handler(request: Request, writer: asyncio.StreamWriter) -> None:
        await start_chunked(writer)
        await chunk(writer, b"data: one\n\n")
        await asyncio.wait_for(gate.wait(), wait_s)
        await chunk(writer, b"data: two\n\n")
        await end_chunked(writer)

    return handler


async def completion(request: Request, writer: asyncio.StreamWriter) -> None:
    """What an instance answers a completion: streamed in two events, or whole."""
    body = request.json()
    if isinstance(body, dict) and body.get("stream"):
        await start_chunked(writer)
        await chunk(writer, b'data: {"choices":[{"index":0,"text":"a"}]}\n\n')
        await chunk(writer, b"data: [DONE]\n\n")
        await end_chunked(writer)
    else:
        await answer_json(writer, {"choices": [{"index": 0, "text": "a"}],
                                   "usage": {"prompt_tokens": 3, "prompt_tokens_details": {"cached_tokens": 2}}})


@dataclass
class FakeInstance:
    tokenizer_dir: str
    handler: Handler = completion
    model: str = "m"
    connections: int = 0  # accepted so far
    requests: list[Request] = field(default_factory=list)  # every request but the router's checks
    url: str = ""
    _server: asyncio.Server | None = None
    _writers: set[asyncio.StreamWriter] = field(default_factory=set)
    _instance_id: str = field(default_factory=lambda: uuid.uuid4().hex)

    async def start(self) -> FakeInstance:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        return self

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            for writer in list(self._writers):
                writer.close()
            await self._server.wait_closed()

    def abort_connections(self) -> None:
        """Drop every open connection at once, without a word (a reset)."""
        for writer in list(self._writers):
            writer.transport.abort()

    def info(self) -> dict:
        return {"instance_id": self._instance_id, "model": self.model, "model_path": self.tokenizer_dir,
                "tokenizer": None, "chat_template": None, "max_model_len": 4096, "kv_blend_separator": None,
                "tool_call_parser": "hermes", "block_size": 4, "fingerprint": "ab" * 32, "tiers": [],
                "shared_store": None, "kv_events": None}

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self._writers.add(writer)
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                lines = head.decode("latin-1").split("\r\n")
                method, path, _ = lines[0].split(" ")
                headers = {}
                for line in lines[1:]:
                    if line:
                        name, _, value = line.partition(":")
                        headers[name.strip().lower()] = value.strip()
                body = await reader.readexactly(int(headers.get("content-length", 0)))
                request = Request(method, path, headers, body, reader)
                if path == "/health":
                    await answer_json(writer, {})
                elif path == "/instance":
                    await answer_json(writer, self.info())
                elif path == "/load":
                    await answer_json(writer, {"instance_id": self._instance_id, "server_load": 0,
                                               "num_requests_running": 0, "num_requests_waiting": 0,
                                               "kv_cache_usage_perc": 0.0})
                elif path == "/metrics":
                    await answer(writer, b"vllm:num_requests_waiting 0\n", content_type=b"text/plain")
                else:
                    self.requests.append(request)
                    await self.handler(request, writer)
                if writer.is_closing():
                    return
        finally:
            self._writers.discard(writer)
            writer.close()
