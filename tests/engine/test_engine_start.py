"""Building an LLMEngine with a store: the host memory a server asks to be resident is
faulted in on a thread of its own while the weights are packed, and the engine is
returned only once it is; a failure meanwhile closes the store it built."""

from __future__ import annotations

import threading
import time

import pytest

import engine.llm_engine as llm_engine
from connectors.kvstore_connector import KVStoreConnector
from engine.config import EngineConfig
from kvstore.errors import StoreClosedError


class _BrokenPacking(RuntimeError):
    pass


def _config(model: str, tmp_path) -> EngineConfig:
    return EngineConfig(model=model, kv_offload="cpu,disk", kv_offload_cpu_size="8MiB",
                        kv_offload_disk_path=str(tmp_path / "disk"), num_kv_blocks=32,
                        fuse_elementwise=False)


def test_resident_host_memory_is_faulted_in_beside_the_packing_and_waited_for(tiny_model_factory, tmp_path,
                                                                               monkeypatch):
    seen: dict[str, object] = {}
    original = KVStoreConnector.make_resident

    def slow_make_resident(self: KVStoreConnector) -> None:
        seen["thread"] = threading.current_thread()
        time.sleep(0.3)  # long enough that an engine not waiting for it returns first
        original(self)
        seen["done"] = True

    monkeypatch.setattr(KVStoreConnector, "make_resident", slow_make_resident)
    engine = llm_engine.LLMEngine(_config(tiny_model_factory(), tmp_path), resident_host_memory=True)
    try:
        assert seen.get("done") is True
        assert seen["thread"] is not threading.current_thread()
        cpu = engine.connector.store.host
        assert cpu.populated_bytes == cpu.num_slots * cpu.slot_bytes
    finally:
        engine.shutdown()


def test_an_engine_that_fails_while_packing_closes_its_store(tiny_model_factory, tmp_path, monkeypatch):
    built: list[KVStoreConnector] = []
    load_model, build_connector = llm_engine.load_model, llm_engine.build_connector

    def load_unpackable(*args, **kwargs):
        model, spec = load_model(*args, **kwargs)

        def pack_weights() -> bool:
            raise _BrokenPacking("packing failed")

        model.pack_weights = pack_weights
        return model, spec

    def build_and_note(*args, **kwargs):
        built.append(build_connector(*args, **kwargs))
        return built[-1]

    monkeypatch.setattr(llm_engine, "load_model", load_unpackable)
    monkeypatch.setattr(llm_engine, "build_connector", build_and_note)
    with pytest.raises(_BrokenPacking):
        llm_engine.LLMEngine(_config(tiny_model_factory(), tmp_path), resident_host_memory=True)
    assert len(built) == 1
    with pytest.raises(StoreClosedError):
        built[0].store.manager.lookup([])
