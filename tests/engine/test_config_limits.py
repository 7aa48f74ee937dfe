"""The config file and the options against hostile or careless input (issue 44, items 6
and 10): YAML aliases and duplicate keys refused, an upper bound on every count, size
and duration, `~` and `$VAR` expanded in every path option from flags and files, and
errors of the file's options saying "(set in FILE)". Each error is one line."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from engine.arg_utils import load_options, read_config_file
from engine.cli import build_parser
from engine.config import ConfigError, EngineConfig, ServerConfig
from kvstore.options import parse_size

REPO_ROOT = Path(__file__).resolve().parents[2]

# 364 bytes that expand to 9**9 strings (the 442-byte bomb took 125 s and 10.9 GiB)
ALIAS_BOMB = "a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n" + "".join(
    f"{b}: &{b} [{', '.join(['*' + a] * 9)}]\n" for a, b in zip("abcdefgh", "bcdefghi", strict=True)
) + "served-model-name: *i\n"


def serve_options(*argv: str) -> tuple[EngineConfig, ServerConfig]:
    engine, server = load_options(build_parser().parse_args(["serve", *argv]), EngineConfig, ServerConfig)
    return engine, server


def write(tmp_path: Path, text: str, name: str = "kvtier.yaml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def one_line(exc: pytest.ExceptionInfo) -> str:
    text = str(exc.value)
    assert "\n" not in text and len(text) < 300, text
    return text


# ---- item 6: the loader -------------------------------------------------------------------


def test_an_alias_bomb_is_refused_before_it_expands(tmp_path):
    path = write(tmp_path, ALIAS_BOMB)
    with pytest.raises(ConfigError, match=r"^--config: .* aliases \(\*name\) are not allowed .*line 2") as exc:
        read_config_file(path)
    one_line(exc)


def test_even_one_alias_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="aliases"):
        serve_options("--config", write(tmp_path, "port: &p 9000\nmax-waiting-requests: *p\n"))


@pytest.mark.parametrize("text", ["port: 9000\nport: 9001\n", "port: 9000\n--port: 9001\n",
                                  "max-num-seqs: 4\nmax_num_seqs: 8\n"])
def test_a_key_given_twice_is_refused(tmp_path, text):
    with pytest.raises(ConfigError, match=r"^--config: .*(duplicate key|is set twice)") as exc:
        serve_options("--config", write(tmp_path, text))
    one_line(exc)


def test_yaml_syntax_errors_are_one_line_with_the_place(tmp_path):
    with pytest.raises(ConfigError, match=r"is not valid YAML: .*\(line 2, column 1\)") as exc:
        serve_options("--config", write(tmp_path, "port: [9000\n"))
    one_line(exc)


def test_a_huge_or_deep_file_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="larger than 1 MiB"):
        serve_options("--config", write(tmp_path, "# pad\n" * (1024**2 // 6 + 1)))
    with pytest.raises(ConfigError, match=r"^--config: .* nested too deeply"):
        serve_options("--config", write(tmp_path, "served-model-name: " + "[" * 50_000 + "]" * 50_000 + "\n"))


# ---- item 6: bounds -----------------------------------------------------------------------


def _bounded_fields() -> list[tuple[type, str]]:
    """Every option that takes a number or a size (not a flag, not a choice)."""
    fields = []
    for section in (EngineConfig, ServerConfig):
        for name, field in section.model_fields.items():
            text = str(field.annotation)
            if field.annotation is bool or "Literal" in text:
                continue
            if re.search(r"\bint\b|\bfloat\b", text):
                fields.append((section, name))
    return fields


def test_the_bounded_options_are_all_the_numeric_ones():
    names = {name for _, name in _bounded_fields()}
    assert {"max_num_seqs", "num_kv_blocks", "kv_offload_cpu_size", "kv_offload_disk_size",
            "max_request_bytes", "kv_load_timeout", "seed", "max_waiting_requests", "port"} <= names


@pytest.mark.parametrize(("section", "name"), _bounded_fields())
@pytest.mark.parametrize("value", [10**32, "1e32", 1e32, float("inf")])
def test_every_count_size_and_duration_has_an_upper_bound(section, name, value):
    with pytest.raises(ConfigError) as exc:
        section(**{name: value})
    assert exc.value.option == name
    one_line(exc)


def test_max_num_seqs_1e32_from_a_file_is_one_line_naming_the_file(tmp_path):
    path = write(tmp_path, "max_num_seqs: 100000000000000000000000000000000\n")
    with pytest.raises(ConfigError, match=r"^--max-num-seqs: .*less than or equal to \d+.*\(set in .*kvtier.yaml\)"):
        serve_options("--config", path)


def test_sizes_have_an_upper_bound():
    assert parse_size("1024TiB") == 1024**5
    with pytest.raises(ValueError, match="more than the largest size"):
        parse_size("1025TiB")


def test_the_defaults_are_within_the_bounds():
    EngineConfig(**EngineConfig().model_dump())
    ServerConfig(**ServerConfig().model_dump())


# ---- item 10: paths -----------------------------------------------------------------------


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    home = tmp_path / "home"
    (home / "models" / "Qwen2.5-0.5B-Instruct").mkdir(parents=True)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("KV_ROOT", str(tmp_path / "kv"))
    return home


def test_the_readme_config_example_loads(home, tmp_path):
    readme = (REPO_ROOT / "README.md").read_text()
    example = re.search(r"```yaml\n(# kvtier\.yaml\n.*?)```", readme, re.S).group(1)
    config, server = serve_options("--config", write(tmp_path, example))
    assert config.model == str(home / "models" / "Qwen2.5-0.5B-Instruct")
    assert config.kv_offload == ("cpu", "disk") and server.port == 8001


def test_tilde_and_variables_expand_in_every_path_option_of_a_file(home, tmp_path):
    (home / "secret").write_text("s3cret\n")
    (home / "t.jinja").write_text("{{ messages }}")
    path = write(tmp_path, (
        "model: ~/models/Qwen2.5-0.5B-Instruct\ntokenizer: $HOME/models/Qwen2.5-0.5B-Instruct\n"
        "chat-template: ~/t.jinja\nkv-secret-file: ${HOME}/secret\nkv-offload: disk\n"
        "kv-offload-disk-path: $KV_ROOT/shared\n"
    ))
    config, _ = serve_options("--config", path)
    assert config.model == config.tokenizer == str(home / "models" / "Qwen2.5-0.5B-Instruct")
    assert config.chat_template == "{{ messages }}" and config.kv_secret == "s3cret"
    assert config.kv_offload_disk_path == str(tmp_path / "kv" / "shared")


def test_tilde_expands_in_flags_and_keywords_too(home, tmp_path):
    (home / "kvtier.yaml").write_text("port: 9001\n")
    config, server = serve_options("~/models/Qwen2.5-0.5B-Instruct", "--config", "~/kvtier.yaml",
                                   "--kv-offload", "disk", "--kv-offload-disk-path", "~/kv")
    assert config.model == str(home / "models" / "Qwen2.5-0.5B-Instruct") and server.port == 9001
    assert config.kv_offload_disk_path == str(home / "kv")
    assert EngineConfig(model="$HOME/models/Qwen2.5-0.5B-Instruct").model == config.model


def test_a_missing_model_in_the_file_says_set_in_file(home, tmp_path):
    path = write(tmp_path, "model: ~/models/nope\n")
    with pytest.raises(ConfigError, match=r"^--model: .*/home/models/nope: no such local directory or GGUF "
                                          r"file \(set in .*kvtier.yaml\)$") as exc:
        serve_options("--config", path)
    one_line(exc)
    with pytest.raises(ConfigError, match=r"^--model: org/model: .*a model hub id\?"):
        serve_options("org/model")

