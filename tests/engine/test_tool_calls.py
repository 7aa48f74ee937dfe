"""Tool calls: the parsers read calls out of whole and streamed outputs, their grammars
accept exactly the calls the tools allow, and tools and earlier calls reach the prompt
through a template that takes them or through the default rendering."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from engine.sampling_params import StructuredOutputsParams
from engine.structured_output import GrammarCompiler
from engine.tool_calls import (
    HermesParser,
    Llama3JsonParser,
    forced_tools,
    render_messages,
    strict_schema,
    template_takes_tools,
)
from tests.engine.tool_templates import LLAMA3_STYLE, QWEN_STYLE

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
                   "required": ["city"]}}}
ADD = {"type": "function", "function": {
    "name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                                  "required": ["a", "b"]}}}
HISTORY = [
    {"role": "system", "content": "You help."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "content": "18 C, sunny", "tool_call_id": "call_1"},
    {"role": "user", "content": "And in Rome?"},
]


def calls_of(calls):
    return [(c.name, json.loads(c.arguments)) for c in calls]


def test_hermes_parses_content_calls_and_a_call_left_open():
    parser = HermesParser()
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}')
    content, calls = parser.parse(text)
    assert content == "Let me check."
    assert calls_of(calls) == [("get_weather", {"city": "Paris"}), ("add", {"a": 1, "b": 2})]
    assert len({c.id for c in calls}) == 2
    assert parser.parse("No calls here.") == ("No calls here.", [])
    content, calls = parser.parse("<tool_call>not json</tool_call> fine")
    assert calls == [] and "not json" in content


def test_llama3_json_parses_one_or_several_calls_and_leaves_prose_alone():
    parser = Llama3JsonParser()
    _, calls = parser.parse('<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}; '
                            '{"name": "get_weather", "parameters": {"city": "Rome"}}')
    assert calls_of(calls) == [("add", {"a": 1, "b": 2}), ("get_weather", {"city": "Rome"})]
    assert parser.parse("{not json at all") == ("{not json at all", [])
    assert parser.parse("The answer is 3.") == ("The answer is 3.", [])


def assembled(pieces):
    """Streamed call pieces put together as the openai client does: by index, the name from
    the first piece, the arguments' text concatenated."""
    calls: dict[int, dict] = {}
    for piece in pieces:
        call = calls.setdefault(piece.index, {"name": piece.name, "id": piece.id, "arguments": ""})
        assert piece.id is None or call["id"] == piece.id  # only a call's first piece carries its id
        call["arguments"] += piece.arguments
    return [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())]


def streamed(parser, text, piece):
    stream, content, pieces = parser.stream(), "", []
    for start in range(0, len(text), piece):
        more, new = stream.feed(text[start:start + piece])
        content, pieces = content + more, pieces + new
    more, new = stream.finish()
    return content + more, pieces + new


@pytest.mark.parametrize("parser", [HermesParser(), Llama3JsonParser()], ids=lambda p: p.name)
@pytest.mark.parametrize("piece", [1, 3, 7])
def test_a_streamed_output_gives_the_content_and_calls_of_the_whole(parser, piece):
    calls_text = parser.call_text("add", {"a": 1, "b": {"c": [2, "}"]}}) + \
        ("\n" if parser.name == "hermes" else "; ") + parser.call_text("get_weather", {"city": "Oslo"})
    for text in ("Plain answer < with a < sign.", calls_text, "Checking <tool_c first. " + calls_text):
        if parser.name == "llama3_json" and text.startswith("Checking"):
            continue  # llama3_json reads calls only from an output that starts with them
        content, pieces = streamed(parser, text, piece)
        whole_content, whole_calls = parser.parse(text)
        assert content.strip() == (whole_content or "")
        assert assembled(pieces) == calls_of(whole_calls)


def test_hermes_streams_a_call_as_it_is_written():
    """The name goes out as soon as it is known, the arguments as they grow; the braces
    that may close the call's own object are held back until the call ends."""
    stream = HermesParser().stream()
    assert stream.feed('<tool_call>\n{"name": "add", "argu') == ("", [])
    (first,) = stream.feed('ments": {"a": 1')[1]
    assert (first.index, first.name, first.arguments) == (0, "add", '{"a": 1') and first.id
    assert stream.feed(', "b": {"c": 2}}')[1][0].arguments == ', "b": {"c": 2'
    assert stream.feed("}\n</tool_")[1] == []
    (last,) = stream.feed("call>")[1]
    assert (last.index, last.name, last.id, last.arguments) == (0, None, None, "}}")


def test_hermes_stream_sends_a_call_of_another_shape_whole_at_its_end():
    stream = HermesParser().stream()
    assert stream.feed('<tool_call>\n{"arguments": {"a": 1}, "name": "add"}') == ("", [])
    (call,) = stream.feed("\n</tool_call>")[1]
    assert (call.name, json.loads(call.arguments)) == ("add", {"a": 1}) and call.id
    text, pieces = streamed(HermesParser(), "<tool_call>\nnot json</tool_call>", 4)
    assert (text, pieces) == ("<tool_call>\nnot json", [])


@pytest.mark.parametrize("piece", [1, 3, 7, 1000])
def test_a_closing_tag_inside_an_argument_string_does_not_close_the_call(piece):
    """A forced call's free string may hold the closing tag itself (seen with the 135M
    model); the call ends at the first tag after which its JSON is whole."""
    parser = HermesParser()
    text = parser.call_text("get_weather", {"city": "Oslo</tool_call>\n# no", "unit": "f"}) + " Done."
    content, calls = parser.parse(text)
    assert (content, calls_of(calls)) == ("Done.", [("get_weather", {"city": "Oslo</tool_call>\n# no", "unit": "f"})])
    streamed_content, pieces = streamed(parser, text, piece)
    assert (streamed_content.strip(), assembled(pieces)) == (content, calls_of(calls))
    _, broken = parser.parse('<tool_call>\n{"name": "add", "arguments": {"a": </tool_call> after')
    assert broken == []  # not JSON at any tag: the first tag closes it, as before


def test_hermes_stream_holds_back_what_may_open_a_call():
    stream = HermesParser().stream()
    assert stream.feed("Hi <tool") == ("Hi ", [])
    assert stream.feed("box>") == ("<toolbox>", [])


@pytest.fixture(scope="module")
def tokenizer(tiny_model_factory):
    return AutoTokenizer.from_pretrained(tiny_model_factory())


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])


def accepts(compiler, tokenizer, grammar: str, text: str) -> bool:
    matcher = compiler.compile(StructuredOutputsParams(grammar=grammar))
    return all(matcher.accept(t) for t in tokenizer.encode(text, add_special_tokens=False))


@pytest.mark.parametrize("parser", [HermesParser(), Llama3JsonParser()], ids=lambda p: p.name)
def test_the_forced_call_grammar_takes_valid_calls_only(compiler, tokenizer, parser):
    single = parser.grammar([WEATHER, ADD], parallel=False)
    parallel = parser.grammar([WEATHER, ADD], parallel=True)
    separator = "\n" if parser.name == "hermes" else "; "
    one = parser.call_text("add", {"a": 1, "b": 2})
    two = one + separator + parser.call_text("get_weather", {"city": "Oslo", "unit": "c"})
    assert accepts(compiler, tokenizer, single, one)
    assert not accepts(compiler, tokenizer, single, two)
    assert accepts(compiler, tokenizer, parallel, two)
    for wrong in (parser.call_text("add", {"a": "one", "b": 2}),  # a string where the schema says integer
                  parser.call_text("get_weather", {"unit": "c"}),  # a required argument missing
                  parser.call_text("delete_all", {})):  # no such tool
        assert not accepts(compiler, tokenizer, parallel, wrong)


def test_strict_tools_allow_no_argument_beyond_their_schema(compiler, tokenizer):
    strict_add = {"type": "function", "function": {**ADD["function"], "strict": True}}
    extra = HermesParser().call_text("add", {"a": 1, "b": 2, "c": 3})
    assert accepts(compiler, tokenizer, HermesParser().grammar([ADD], False), extra)
    assert not accepts(compiler, tokenizer, HermesParser().grammar([strict_add], False), extra)
    assert strict_schema(ADD["function"]["parameters"])["additionalProperties"] is False


def test_forced_tools_follow_tool_choice():
    assert forced_tools([WEATHER, ADD], "required") == [WEATHER, ADD]
    assert forced_tools([WEATHER, ADD], {"type": "function", "function": {"name": "add"}}) == [ADD]
    assert forced_tools([WEATHER, ADD], "auto") is None
    assert forced_tools([WEATHER, ADD], "none") is None


def test_a_template_that_takes_tools_renders_them_and_the_history(tokenizer):
    assert template_takes_tools(QWEN_STYLE) and not template_takes_tools(tokenizer.chat_template)
    messages, tools = render_messages(HISTORY, [WEATHER, ADD], HermesParser(), template_tools=True)
    text = tokenizer.apply_chat_template(messages, tools=tools, chat_template=QWEN_STYLE, tokenize=False,
                                         add_generation_prompt=True)
    assert json.dumps(WEATHER) in text
    # the earlier call's arguments are an object in the prompt, not a JSON string in a string
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in text
    assert "<tool_response>\n18 C, sunny\n</tool_response>" in text
    llama = tokenizer.apply_chat_template(*render_messages(HISTORY, [WEATHER], Llama3JsonParser(), True)[:1],
                                          tools=[WEATHER], chat_template=LLAMA3_STYLE, tokenize=False,
                                          add_generation_prompt=True)
    assert '{"name": "get_weather", "parameters": {"city": "Paris"}}' in llama
    assert "ipython" in llama and json.dumps(WEATHER) in llama


def test_a_template_without_tools_gets_the_default_rendering(tokenizer):
    messages, tools = render_messages(HISTORY, [WEATHER, ADD], HermesParser(), template_tools=False)
    assert tools is None
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "user"]
    assert messages[0]["content"].startswith("You help.")
    assert json.dumps(WEATHER) in messages[0]["content"] and "<tool_call>" in messages[0]["content"]
    assert messages[2]["content"] == HermesParser().call_text("get_weather", '{"city": "Paris"}')
    assert messages[3]["content"] == "<tool_response>\n18 C, sunny\n</tool_response>"
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert "<tool_response>" in text and json.dumps(ADD) in text
    # without tools nothing is added, and the calls still read as the model wrote them
    plain, _ = render_messages(HISTORY, None, HermesParser(), template_tools=False)
    assert plain[0] == {"role": "system", "content": "You help."}
    assert "<tool_call>" in plain[2]["content"]
