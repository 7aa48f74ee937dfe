"""`kvtier serve --config FILE.yaml` in a real server process: the file's options apply,
a bare size is GiB, and a flag on the command line overrides the file."""

from __future__ import annotations

import httpx

from tests.server.server_helpers import ServerProcess, server_flags


def test_serve_reads_a_yaml_config_and_flags_override_it(model_path, tmp_path):
    config = tmp_path / "kvtier.yaml"
    config.write_text(
        "kv-offload: cpu\n"
        "kv-offload-cpu-size: 0.0625   # GiB: 64 MiB\n"
        "kv_chunk_tokens: 32\n"
        "max-num-seqs: 8\n"
        "served-model-name: [from-file, alias]\n"
    )
    flags = [f for f in server_flags(model_path) if f not in ("--served-model-name", "tiny")]
    server = ServerProcess(*flags, "--config", str(config), "--max-num-seqs", "4")
    try:
        assert "offload  cpu 64.0 MiB" in server.output
        assert "queue    4 running" in server.output
        models = httpx.get(server.url + "/v1/models", timeout=10).json()
        assert [m["id"] for m in models["data"]] == ["from-file", "alias"]
    finally:
        assert server.stop() == 0
