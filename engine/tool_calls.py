"""Tool calls: how tools reach the prompt, how forced calls are constrained, how calls are
read back out of the generated text.

A `ToolCallParser` stands for one output format, named as vLLM's `--tool-call-parser`:

- `hermes`: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one block a
  call (Qwen2.5, Hermes and most ChatML models);
- `llama3_json`: `{"name": ..., "parameters": {...}}`, calls separated by `; ` (Llama 3.x).

A chat template that takes tools (it names `tools`, as Qwen2.5's, Llama 3.x's and
Hermes' do) renders them itself. Any other template gets the default rendering
(`render_messages`): the tools and the format listed in a system message put first, the
assistant's earlier calls written in the parser's format, and tool results sent as user
messages wrapped in `<tool_response>` tags, which every template can render.

`tool_choice` "required" or a named function constrains the output with a grammar of the
parser's format (`ToolCallParser.grammar`), so that even a small model answers a valid call
whose arguments match the function's schema; "auto" leaves the model free and parses what
it wrote.
"""

from __future__ import annotations

import abc
import contextlib
import copy
import json
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from engine.structured_output import JSON_OPTIONS

ToolChoice = str | dict[str, Any]  # "none" | "auto" | "required" | {"type": "function", ...}
TOOL_RESPONSE_ROLE = "user"


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON object's text, as OpenAI sends it
    id: str = ""

    def __post_init__(self) -> None:
        self.id = self.id or f"call_{uuid.uuid4().hex[:24]}"


def strict_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """`schema` as OpenAI's strict mode reads it: an object schema that does not say
    otherwise allows no properties beyond the ones it lists (strict mode demands
    `additionalProperties: false`; a client that leaves it out means the same)."""
    schema = copy.deepcopy(schema)

    def close(node: Any) -> None:
        if isinstance(node, dict):
            if node.get("type") == "object" and "properties" in node:
                node.setdefault("additionalProperties", False)
            for value in node.values():
                close(value)
        elif isinstance(node, list):
            for value in node:
                close(value)

    close(schema)
    return schema


def function_of(tool: dict[str, Any]) -> dict[str, Any]:
    return tool["function"]


def arguments_schema(function: dict[str, Any]) -> dict[str, Any]:
    """The JSON schema of a function's arguments (any object when it gives none)."""
    schema = function.get("parameters") or {"type": "object"}
    return strict_schema(schema) if function.get("strict") else schema


def template_takes_tools(chat_template: Any) -> bool:
    """Whether a chat template renders `tools` itself."""
    return isinstance(chat_template, str) and "tools" in chat_template


class ToolCallParser(abc.ABC):
    """One tool-call output format: its grammar, its parsing, its default rendering."""

    name = ""
    arguments_key = "arguments"
    separator = ""  # between parallel calls

    def call_text(self, name: str, arguments: Any) -> str:
        """One call as the model writes it (`arguments`: an object, or its JSON text)."""
        args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
        return self.wrap(f'{{"name": {json.dumps(name)}, "{self.arguments_key}": {args}}}')

    def wrap(self, call_json: str) -> str:
        """A call's JSON text as it stands in the output."""
        return call_json

    def call_rule(self, json_rule: str) -> str:
        """The Lark rule of one call around its JSON rule, as `wrap` writes it."""
        return json_rule

    def calls_rule(self, call_rule: str, parallel: bool) -> str:
        return f'{call_rule} ({json.dumps(self.separator)} {call_rule})*' if parallel else call_rule

    @abc.abstractmethod
    def split(self, text: str) -> tuple[str, list[str]]:
        """The content of `text` outside calls, and each call's JSON text."""

    @abc.abstractmethod
    def stream(self) -> ToolCallStream:
        """A reader of this format's calls out of a streamed output."""

    def grammar(self, tools: Sequence[dict[str, Any]], parallel: bool) -> str:
        """A Lark grammar (llguidance's, with `%json`) of one call, or with `parallel` one or
        more, of the given tools, each with arguments valid for its schema."""
        options = []
        for tool in tools:
            function = function_of(tool)
            options.append({
                "type": "object",
                "properties": {"name": {"const": function["name"]},
                               self.arguments_key: arguments_schema(function)},
                "required": ["name", self.arguments_key],
                "additionalProperties": False,
            })
        schema = options[0] if len(options) == 1 else {"anyOf": options}
        return f"start: {self.calls_rule('call', parallel)}\ncall: {self.call_rule(lark_json(schema))}\n"

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """The content (None if blank) and the tool calls of a whole output. A block that is
        not a call (not JSON, or without a name) stays in the content as written."""
        content, blocks = self.split(text)
        calls = []
        for block in blocks:
            call = self.parse_call(block)
            if call is None:
                content += block
            else:
                calls.append(call)
        return (content.strip() or None), calls

    def parse_call(self, block: str) -> ToolCall | None:
        try:
            value = json.loads(block)
        except ValueError:
            return None
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            return None
        arguments = value.get(self.arguments_key, value.get("arguments", {}))
        if isinstance(arguments, str):
            return ToolCall(value["name"], arguments)
        return ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))

    def system_prompt(self, tools: Sequence[dict[str, Any]]) -> str:
        """The default rendering of `tools`, for templates that do not take them."""
        listed = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
        example = self.call_text("<function-name>", "<arguments-json-object>")
        return (
            "You may call one or more functions to help with the user's request. The functions "
            f"are listed in <tools></tools> as JSON schemas:\n<tools>\n{listed}\n</tools>\n"
            f"To call a function, answer with:\n{example}"
        )


class HermesParser(ToolCallParser):
    name = "hermes"
    separator = "\n"
    open_tag = "<tool_call>"
    close_tag = "</tool_call>"

    def wrap(self, call_json: str) -> str:
        return f"{self.open_tag}\n{call_json}\n{self.close_tag}"

    def call_rule(self, json_rule: str) -> str:
        return f"{json.dumps(self.open_tag + chr(10))} {json_rule} {json.dumps(chr(10) + self.close_tag)}"

    def split(self, text: str) -> tuple[str, list[str]]:
        content, blocks, position = "", [], 0
        while (start := text.find(self.open_tag, position)) >= 0:
            content += text[position:start]
            body = start + len(self.open_tag)
            end = self.close_at(text, body)
            if end < 0:  # no complete call: the first closing tag, or the end, closes it
                end = text.find(self.close_tag, body)
            end = len(text) if end < 0 else end
            blocks.append(text[body:end].strip())
            position = min(end + len(self.close_tag), len(text))
        return content + text[position:], blocks

    def close_at(self, text: str, body: int) -> int:
        """Where the call whose block starts at `body` closes: the first closing tag after
        which the block is whole JSON (a tag inside one of its strings closes nothing);
        -1 if there is none yet."""
        end = text.find(self.close_tag, body)
        while end >= 0:
            try:
                json.loads(text[body:end])
                return end
            except ValueError:
                end = text.find(self.close_tag, end + 1)
        return -1

    def stream(self) -> ToolCallStream:
        return HermesStream(self)


class Llama3JsonParser(ToolCallParser):
    name = "llama3_json"
    arguments_key = "parameters"
    separator = "; "
    python_tag = "<|python_tag|>"

    def split(self, text: str) -> tuple[str, list[str]]:
        body = text.strip().removeprefix(self.python_tag).strip()
        if not body.startswith("{"):
            return text, []
        blocks, decoder, position = [], json.JSONDecoder(), 0
        while position < len(body):
            try:
                _, end = decoder.raw_decode(body, position)
            except ValueError:
                return text, []  # not calls after all: the whole text is content
            blocks.append(body[position:end])
            position = end
            while position < len(body) and body[position] in "; \n\t":
                position += 1
        return "", blocks

    def stream(self) -> ToolCallStream:
        return Llama3JsonStream(self)


PARSERS: dict[str, type[ToolCallParser]] = {p.name: p for p in (HermesParser, Llama3JsonParser)}


def lark_json(schema: dict[str, Any]) -> str:
    """A Lark rule body matching JSON documents of `schema` (llguidance's `%json`), for
    grammars that embed JSON in other text."""
    compact = {**schema, "x-guidance": JSON_OPTIONS}  # as structured outputs' JSON: no padding
    return "%json " + json.dumps(compact, ensure_ascii=False)


def get_parser(name: str) -> ToolCallParser:
    return PARSERS[name]()


@dataclass
class CallDelta:
    """A piece of a streamed call, as OpenAI streams them: the first piece of call `index`
    carries its id and name, the ones after it more of its arguments' JSON text."""

    index: int
    arguments: str
    name: str | None = None
    id: str | None = None


class ToolCallStream(abc.ABC):
    """Reads calls out of a streamed output: `feed` takes the next text and returns the
    content that can be sent now and the pieces of calls that can; `finish` returns the rest."""

    def __init__(self, parser: ToolCallParser) -> None:
        self.parser = parser
        self.text = ""
        self.sent = 0  # characters of `text` dealt with (sent as content, or read as calls)
        self.calls = 0  # calls begun

    @abc.abstractmethod
    def feed(self, delta: str) -> tuple[str, list[CallDelta]]:
        """The content sendable now and the pieces of calls that `delta` made sendable."""

    @abc.abstractmethod
    def finish(self) -> tuple[str, list[CallDelta]]:
        """What is left once the output ended."""

    def _begin(self, name: str, arguments: str = "") -> CallDelta:
        """The first piece of a new call."""
        self.calls += 1
        return CallDelta(self.calls - 1, arguments, name=name, id=ToolCall(name, arguments).id)

    def _whole(self, calls: list[ToolCall]) -> list[CallDelta]:
        return [self._begin(call.name, call.arguments) for call in calls]


class HermesStream(ToolCallStream):
    """Content streams until a `<tool_call>` opens (text that could be the start of the tag
    is held back). A call that opens with its name, `{"name": ..., "arguments": {`, is
    sent as it is written: its name first, then its arguments' text, holding back the
    closing braces and blanks that may be the end of the call's own object. A call written
    in another shape is parsed and sent whole once its closing tag arrives."""

    def __init__(self, parser: HermesParser) -> None:
        super().__init__(parser)
        self.open_tag, self.close_tag = parser.open_tag, parser.close_tag
        self.header = re.compile(
            r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"' + re.escape(parser.arguments_key) + r'"\s*:\s*(?=\{)')
        self.in_call = False
        self.arguments_at: int | None = None  # where the open call's arguments begin, once its name is sent

    def feed(self, delta: str) -> tuple[str, list[CallDelta]]:
        self.text += delta
        return self._advance(final=False)

    def finish(self) -> tuple[str, list[CallDelta]]:
        return self._advance(final=True)

    def _advance(self, final: bool) -> tuple[str, list[CallDelta]]:
        """Deal with the text not dealt with yet; `final`: the output has ended, so a call
        with no whole-JSON close ends at its first closing tag or at the end, and nothing
        is held back."""
        content, calls = "", []
        while True:
            if self.in_call:
                end = self.parser.close_at(self.text, self.sent)
                if end < 0 and final:
                    end = self.text.find(self.close_tag, self.sent)
                    end = len(self.text) if end < 0 else end
                if end < 0:
                    # Arguments stream up to the first closing tag: past it only once the
                    # JSON shows that tag was inside a string.
                    tag = self.text.find(self.close_tag, self.sent)
                    limit = tag if tag >= 0 else len(self.text) - _partial_suffix(self.text, self.close_tag, self.sent)
                    not_a_call, pieces = self._stream_call(limit, closed=False)
                    return self._content(content + not_a_call), calls + pieces
                not_a_call, pieces = self._stream_call(end, closed=True)
                content, calls = content + not_a_call, calls + pieces
                self.sent, self.in_call = min(end + len(self.close_tag), len(self.text)), False
                continue
            start = self.text.find(self.open_tag, self.sent)
            if start >= 0:
                content += self.text[self.sent:start]
                self.sent, self.in_call, self.arguments_at = start + len(self.open_tag), True, None
                continue
            keep = 0 if final else _partial_suffix(self.text, self.open_tag, self.sent)
            content += self.text[self.sent:len(self.text) - keep]
            self.sent = len(self.text) - keep
            return self._content(content), calls

    def _stream_call(self, limit: int, closed: bool) -> tuple[str, list[CallDelta]]:
        """The pieces of the open call (its block runs from `self.sent`) sendable with the
        text up to `limit` (`closed`: the block ends there), and, for a closed block that
        is no call after all, the block as content."""
        pieces = []
        if self.arguments_at is None:
            match = self.header.match(self.text, self.sent, limit)
            if match is None:
                if closed:
                    block = self.text[self.sent:limit]
                    call = self.parser.parse_call(block.strip())
                    return ("", self._whole([call])) if call else (self.open_tag + block, [])
                return "", []
            pieces.append(self._begin(json.loads(match.group(1))))
            self.arguments_at = self.arguments_sent = match.end()
        # Closed: drop the brace that ends the call's own object; open: hold back every
        # brace and blank at the end, any of which may be it.
        arguments = self.text[self.arguments_at:limit].rstrip()
        arguments = arguments.removesuffix("}").rstrip() if closed else arguments.rstrip("} \t\r\n")
        end = self.arguments_at + len(arguments)
        if end > self.arguments_sent:
            more = self.text[self.arguments_sent:end]
            if pieces:  # the call began in this text: one piece with its name and arguments
                pieces[0].arguments += more
            else:
                pieces.append(CallDelta(self.calls - 1, more))
            self.arguments_sent = end
        return "", pieces

    def _content(self, content: str) -> str:
        """Blank text around calls is no content (OpenAI sends none beside calls)."""
        return "" if self.calls and not content.strip() else content


class Llama3JsonStream(ToolCallStream):
    """An output that starts (after blanks) with `{` or the python tag is calls, parsed and
    sent whole at its end; any other output is content, streamed as it comes."""

    def __init__(self, parser: Llama3JsonParser) -> None:
        super().__init__(parser)
        self.mode: str | None = None  # "content" or "calls", once the first character decides

    def feed(self, delta: str) -> tuple[str, list[CallDelta]]:
        self.text += delta
        if self.mode is None:
            head = self.text.lstrip()
            if not head or (len(head) < len(Llama3JsonParser.python_tag) and Llama3JsonParser.python_tag.startswith(head)):
                return "", []
            self.mode = "calls" if head.startswith(("{", Llama3JsonParser.python_tag)) else "content"
        if self.mode == "calls":
            return "", []
        content, self.sent = self.text[self.sent:], len(self.text)
        return content, []

    def finish(self) -> tuple[str, list[CallDelta]]:
        rest = self.text[self.sent:]
        self.sent = len(self.text)
        if self.mode != "calls":
            return rest, []
        content, calls = self.parser.parse(rest)
        return content or "", self._whole(calls)


def _partial_suffix(text: str, tag: str, start: int) -> int:
    """The length of the longest end of `text[start:]` that is a proper start of `tag`."""
    for length in range(min(len(tag) - 1, len(text) - start), 0, -1):
        if tag.startswith(text[len(text) - length:]):
            return length
    return 0


def render_messages(
    messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None, parser: ToolCallParser,
    template_tools: bool,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The messages and the `tools` argument to give the chat template. A template that
    takes tools gets them and the calls as they are (arguments as objects, as templates
    expect); any other gets the default rendering (see the module docstring)."""
    if template_tools:
        rendered = []
        for message in messages:
            message = dict(message)
            if message.get("tool_calls"):
                message["tool_calls"] = [_template_call(c) for c in message["tool_calls"]]
            rendered.append(message)
        return rendered, list(tools) if tools else None
    rendered = []
    for message in messages:
        content = message.get("content") or ""
        if message["role"] == "tool":
            rendered.append({"role": TOOL_RESPONSE_ROLE, "content": f"<tool_response>\n{content}\n</tool_response>"})
            continue
        if message.get("tool_calls"):
            calls = [parser.call_text(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]
            content = "\n".join(([content] if content else []) + calls)
        rendered.append({"role": message["role"], "content": content})
    if tools:
        system = parser.system_prompt(tools)
        if rendered and rendered[0]["role"] == "system":
            rendered[0] = {"role": "system", "content": rendered[0]["content"] + "\n\n" + system}
        else:
            rendered.insert(0, {"role": "system", "content": system})
    return rendered, None


def _template_call(call: dict[str, Any]) -> dict[str, Any]:
    """An assistant's earlier call as chat templates read it: arguments as an object."""
    function = dict(call["function"])
    with contextlib.suppress(TypeError, ValueError):  # not JSON text: the template gets it as it came
        function["arguments"] = json.loads(function["arguments"])
    return {**call, "function": function}


def forced_tools(tools: Sequence[dict[str, Any]], tool_choice: ToolChoice) -> list[dict[str, Any]] | None:
    """The tools one of which the output must call: all for "required", the named one for a
    named choice, None when the model is free ("auto", "none")."""
    if tool_choice == "required":
        return list(tools)
    if isinstance(tool_choice, dict):
        name = tool_choice["function"]["name"]
        return [t for t in tools if function_of(t)["name"] == name]
    return None
