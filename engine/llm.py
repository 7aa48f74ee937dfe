"""The offline API: `LLM(model=...).generate(prompts, sampling_params)`."""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any

from tqdm.auto import tqdm

from engine.blend import SegmentedTokens, Segments
from engine.config import ConfigError, EngineConfig, load_chat_template
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams

# text, token ids, or a segmented prompt (blended, engine/blend); text is segmented where
# --kv-blend-separator occurs in it
Prompt = str | list[int] | Segments | SegmentedTokens
Conversation = Sequence[Mapping[str, str]]


class LLM:
    """Offline batch generation. Keyword arguments are the engine options (CLI flag names
    with underscores), e.g. LLM(model=path, dtype="float32", num_kv_blocks=64); a bad one
    raises engine.config.ConfigError naming the keyword."""

    def __init__(self, model: str | None = None, **engine_options) -> None:
        try:
            self._start(EngineConfig(model=model, **engine_options))
        except ConfigError as exc:
            raise exc.as_keyword() from None

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLM:
        """An LLM of a built config (its errors name flags: the CLI's constructor)."""
        llm = cls.__new__(cls)
        llm._start(config)
        return llm

    def _start(self, config: EngineConfig) -> None:
        self.engine = LLMEngine(config)
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def get_tokenizer(self) -> Any:
        """The engine's tokenizer (a transformers fast tokenizer), as vLLM's `LLM.get_tokenizer`."""
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        cache_salt: str | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order."""
        prompt_list = _as_prompt_list(prompts)
        params = _as_params_list(sampling_params, len(prompt_list))
        ids = []
        for prompt, p in zip(prompt_list, params, strict=True):
            rid = f"offline-{next(self._ids)}"
            self.engine.add_request(rid, prompt, p, cache_salt=cache_salt)
            ids.append(rid)
        finished: dict[str, RequestOutput] = {}
        show = use_tqdm and len(ids) > 1
        with tqdm(total=len(ids), desc="generate", disable=not show) as bar:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        finished[out.request_id] = out
                        bar.update(1)
        return [finished[rid] for rid in ids]

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        cache_salt: str | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of {"role", "content"} messages)
        or to a list of conversations, as vLLM's `LLM.chat`: each goes through the chat
        template (`chat_template`, a template string, else the model's or the one given
        as the `chat_template` option) with the assistant's turn opened; one output per
        conversation, in order."""
        conversations = [messages] if messages and isinstance(messages[0], Mapping) else list(messages)
        if chat_template is not None:
            try:
                chat_template = load_chat_template(chat_template)
            except ConfigError as exc:
                raise exc.as_keyword() from None
        prompts = [
            self.engine.encode_chat(list(c), chat_template, add_generation_prompt) for c in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, cache_salt=cache_salt)

    def stats(self) -> dict:
        return self.engine.stats()

    def close(self) -> None:
        """Shut the engine down (writes out pending KV saves)."""
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str | Segments | SegmentedTokens):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]
    return prompts


def _as_params_list(
    params: SamplingParams | Sequence[SamplingParams] | None, count: int
) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams() for _ in range(count)]
    if isinstance(params, SamplingParams):
        return [params] * count
    params = list(params)
    if len(params) != count:
        raise ValueError(f"got {len(params)} sampling params for {count} prompts")
    return params
