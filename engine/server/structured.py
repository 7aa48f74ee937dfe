"""A chat or completion request's output constraint, read from its body: OpenAI's
`response_format`, vLLM's `structured_outputs` and older `guided_*` extras, or the grammar
of a forced tool call (tool_choice "required" or a named function). At most one may be
given. The grammar is compiled here, in a worker thread, so that a schema the engine
cannot compile is a 400 naming the field, and the engine thread finds it compiled."""

from __future__ import annotations

import asyncio

from engine.sampling_params import SamplingParamsError, StructuredOutputsParams
from engine.server.errors import APIError
from engine.server.protocol import ChatCompletionRequest, CompletionRequest
from engine.structured_output import GrammarCompiler, GrammarError
from engine.tool_calls import ToolCallParser, forced_tools, strict_schema

Body = CompletionRequest | ChatCompletionRequest


def requested_constraint(body: Body) -> tuple[StructuredOutputsParams, str] | None:
    """The body's output constraint and the field that gave it; None when it gives none."""
    given = []
    rf = body.response_format
    if rf is not None and rf.type == "json_object":
        given.append(("response_format", {"json_object": True}))
    elif rf is not None and rf.type == "json_schema":
        schema = rf.json_schema.json_schema
        given.append(("response_format", {"json": strict_schema(schema) if rf.json_schema.strict else schema}))
    if body.structured_outputs is not None:
        fields = body.structured_outputs.model_dump(by_alias=True, exclude_none=True)
        if fields.get("json_object") is False:
            del fields["json_object"]
        given.append(("structured_outputs", fields))
    for name, key in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                      ("guided_grammar", "grammar")):
        if getattr(body, name) is not None:
            given.append((name, {key: getattr(body, name)}))
    if not given:
        return None
    if len(given) > 1:
        names = ", ".join(name for name, _ in given)
        raise APIError(400, f"give at most one output constraint; this request gives {names}",
                       param=given[1][0], code="invalid_value")
    param, fields = given[0]
    try:
        return StructuredOutputsParams(**fields), param
    except SamplingParamsError as exc:
        raise APIError(400, f"{param}: {str(exc).removeprefix('structured_outputs: ')}",
                       param=param, code="invalid_value") from None


def chat_constraint(
    body: ChatCompletionRequest, tools: list[dict] | None, parser: ToolCallParser
) -> tuple[StructuredOutputsParams, str] | None:
    """`requested_constraint`, or the grammar of the tool calls the request forces."""
    choice = body.effective_tool_choice
    must_call = forced_tools(tools or [], choice if isinstance(choice, str) else choice.model_dump())
    requested = requested_constraint(body)
    if must_call is None:
        return requested
    if requested is not None:
        forcing = repr(choice) if isinstance(choice, str) else "naming a function"
        raise APIError(400, f"{requested[1]} cannot be combined with tool_choice {forcing}",
                       param=requested[1], code="invalid_value")
    grammar = parser.grammar(must_call, body.parallel_tool_calls and choice == "required")
    return StructuredOutputsParams(grammar=grammar), "tools"


async def compiled(grammars: GrammarCompiler, constraint: tuple[StructuredOutputsParams, str] | None) -> None:
    """Compile the constraint in a worker thread (into the compiler's cache); a 400 naming
    its field if it cannot be compiled."""
    if constraint is None:
        return
    params, param = constraint
    try:
        await asyncio.to_thread(grammars.compile, params, param)
    except GrammarError as exc:
        raise APIError(400, str(exc), param=param, code="invalid_value") from None
