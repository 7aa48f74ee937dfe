"""Every answer the README shows (`# -> ANSWER` under an example) is what that example
gives with the built-in model, run as the README writes it (issue 44, item 12): the
`kvtier generate` command, the openai client snippet and the curl body against
`kvtier serve --kv-offload cpu,disk`."""

from __future__ import annotations

import contextlib
import io
import json
import re
import shlex
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.timeout(900)
README = (Path(__file__).resolve().parents[2] / "README.md").read_text()
SHOWN = re.compile(r"^# -> (.+?\.)(?: \(.*\))?$", re.M)


def shown_after(marker: str) -> str:
    """The answer the README shows on the first `# -> ` line after `marker`."""
    start = README.index(marker)
    return SHOWN.search(README, start).group(1)


def test_every_shown_answer_is_checked_here():
    """Three examples show an answer; a new one needs its check below."""
    assert len(SHOWN.findall(README)) == 3


def test_the_generate_example(smollm2_dir, capsys):
    """`kvtier`'s own entry point, in this process: a fresh interpreter would import torch
    and compile the fused ops again, for the same output."""
    from engine.cli import main

    line = next(line for line in README.splitlines() if line.startswith("kvtier generate --prompt"))
    argv = shlex.split(line.split("#")[0])[1:]
    assert main(argv) == 0
    assert capsys.readouterr().out.splitlines()[1] == shown_after(line)


def test_the_openai_client_example(server):
    marker = "print(reply.choices[0].message.content)"
    start = README.rindex("```python", 0, README.index(marker))
    code = README[start + len("```python"):README.index("```", start + 3)]
    code = code.replace("http://127.0.0.1:8000/v1", server.url + "/v1")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code, "README.md", "exec"), {})  # the snippet as the README writes it
    assert printed.getvalue().strip() == shown_after(marker)


def test_the_curl_example(server):
    marker = "curl -s http://127.0.0.1:8000/v1/chat/completions"
    start = README.index(marker)
    body = json.loads(README[README.index("-d '", start) + 4:README.index("}'", start) + 1])
    text, events = "", []
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=300) as stream:
        for line in stream.iter_lines():
            if line:
                events.append(line)
            if line.startswith("data: {"):
                text += "".join(c["delta"].get("content") or "" for c in json.loads(line[6:])["choices"])
    assert events[-1] == "data: [DONE]"
    assert text == shown_after(marker)
