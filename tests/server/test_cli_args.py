"""`kvtier serve` flags: help text, one-line errors naming the flag, checks before loading."""

from __future__ import annotations

import socket

import pytest

from engine.cli import main
from engine.config import ADMIN_TOKEN_ENV

SERVER_FLAGS = ["--host", "--port", "--served-model-name", "--enable-kv-admin", "--admin-token",
                "--max-waiting-requests", "--max-prompts-per-request", "--max-request-bytes", "--body-read-timeout", "--max-body-reads-per-client", "--retry-after", "--shutdown-timeout",
                "--log-level"]


def fail(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    return err


def test_help_explains_every_server_flag(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = capsys.readouterr().out
    for flag in SERVER_FLAGS:
        assert flag in out


@pytest.mark.parametrize(("argv", "flag"), [
    (["--enable-kv-admin"], "--admin-token"),
    (["--enable-kv-admin", "--admin-token", "short"], "--admin-token"),
    (["--port", "70000"], "--port"),
    (["--max-waiting-requests", "-1"], "--max-waiting-requests"),
    (["--max-prompts-per-request", "0"], "--max-prompts-per-request"),
    (["--body-read-timeout", "0"], "--body-read-timeout"),
    (["--max-body-reads-per-client", "0"], "--max-body-reads-per-client"),
    (["--max-request-bytes", "lots"], "--max-request-bytes"),
    (["--max-request-bytes", "10B"], "--max-request-bytes"),
    (["--log-level", "loud"], "--log-level"),
])
def test_bad_server_flag_is_one_line_naming_it(argv, flag, capsys, monkeypatch):
    monkeypatch.delenv(ADMIN_TOKEN_ENV, raising=False)
    assert flag in fail(["serve", *argv], capsys)


def test_busy_port_fails_before_the_model_loads(capsys, tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        # a directory that exists (the options pass) but holds no checkpoint (loading fails)
        err = fail(["serve", "--port", str(port), "--model", str(tmp_path)], capsys)
    assert "--port" in err and str(port) in err


def test_admin_token_can_come_from_the_environment(monkeypatch):
    from engine.arg_utils import load_options
    from engine.cli import build_parser
    from engine.config import ServerConfig

    monkeypatch.setenv(ADMIN_TOKEN_ENV, "t" * 20)
    args = build_parser().parse_args(["serve", "--enable-kv-admin"])
    (settings,) = load_options(args, ServerConfig)
    assert settings.admin_token == "t" * 20
