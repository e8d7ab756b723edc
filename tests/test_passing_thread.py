"""Only a pool's compute thread keeps OpenMP workers: work that touches large tensors off it (loading a model,
creating an adapter) runs on a passing thread that ends with it (``lathe.models.pool.on_passing_thread``)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from lathe.models.catalog import ModelCatalog
from lathe.models.decoder import Decoder
from lathe.models.pool import on_passing_thread
from lathe.trainer import bank
from lathe.trainer.engine import TrainerConfig, TrainerEngine
from lathe.v1 import lathe_pb2 as pb

BASE = "lathe/tiny-llama"


def test_passing_thread_returns_and_raises_on_a_thread_that_has_ended() -> None:
    seen: list[threading.Thread] = []

    def work(x: int) -> int:
        seen.append(threading.current_thread())
        return x + 1

    assert on_passing_thread(work, 41) == 42
    assert seen[0] is not threading.current_thread()
    assert not seen[0].is_alive()

    def fail() -> None:
        raise ValueError("bad adapter")

    with pytest.raises(ValueError, match="bad adapter"):
        on_passing_thread(fail)


def test_engine_loads_models_and_creates_adapters_off_the_callers_thread(
        model_cache: Path, tiny_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    where: dict[str, threading.Thread] = {}
    load, fresh = Decoder.from_dir, bank.Adapter.fresh

    def spy_load(*args: object, **kwargs: object) -> object:
        where["load"] = threading.current_thread()
        return load(*args, **kwargs)

    def spy_fresh(*args: object, **kwargs: object) -> object:
        where["create"] = threading.current_thread()
        return fresh(*args, **kwargs)

    monkeypatch.setattr(Decoder, "from_dir", spy_load)
    monkeypatch.setattr(bank.Adapter, "fresh", spy_fresh)
    eng = TrainerEngine(TrainerConfig(models=BASE, cache_root=model_cache), ModelCatalog.from_spec(BASE, model_cache))
    info = eng.create_adapter(pb.CreateAdapterRequest(model_id="m", tenant="t", base_model=BASE,
                                                      lora_config=pb.LoraConfig(rank=4, train_attn=True)))
    assert info.model_id == "m" and eng.bank.get("m").spec.rank == 4
    for what in ("load", "create"):
        assert where[what] is not threading.current_thread(), what
        assert not where[what].is_alive(), what
    with pytest.raises(Exception, match="lora rank"):  # an error raised there is still the caller's
        eng.create_adapter(pb.CreateAdapterRequest(model_id="bad", tenant="t", base_model=BASE,
                                                   lora_config=pb.LoraConfig(rank=0, train_attn=True)))
    assert "bad" not in eng.bank
