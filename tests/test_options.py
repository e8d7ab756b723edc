"""Flags generated from config dataclasses (``lathe.runtime.options``): each field's flag, type, default and help come
from the field; the services' real configs give every field a flag with help, or none on purpose."""

from __future__ import annotations

import argparse
import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import pytest

from lathe.gateway.config import DB_ENV, GatewayConfig
from lathe.gateway.limits import HttpLimits, RequestLimits
from lathe.gateway.store import StoreConfig
from lathe.runtime.options import add_options, field_docs, options
from lathe.sampler.config import SamplerConfig
from lathe.trainer.config import TrainerConfig


@dataclass(frozen=True)
class Inner:
    every: int = 10
    """how often"""
    keep: bool = True
    """keep them"""

    def __post_init__(self) -> None:
        if self.every < 0:
            raise ValueError(f"every must be >= 0, got {self.every}")


@dataclass(frozen=True)
class Config:
    name: str = "x"
    """the name, 100% of it"""
    root: Path = Path("store/r")
    """where"""
    ratio: float = 0.5
    fast: bool = False
    """go fast"""
    exact: bool = True
    """exact ops"""
    mode: Literal["a", "b"] = "a"
    """which mode"""
    dtype: str = field(default="float32", metadata={"default": "auto", "choices": ("auto", "float32")})
    """the dtype"""
    renamed: int = field(default=3, metadata={"flag": "--other-name"})
    """spelled otherwise"""
    hidden: tuple[int, ...] = field(default=(1, 2), metadata={"cli": False})
    inner: Inner = field(default_factory=Inner, metadata={"flags": {"every": "--inner-every"}})


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    add_options(ap, Config)
    return ap


def test_each_field_is_one_flag_with_its_type_default_and_docstring() -> None:
    ap = _parser()
    assert options(ap.parse_args([]), Config) == Config(dtype="auto")  # the flag's own default
    got = options(ap.parse_args(["--name", "y", "--root", "data/r", "--ratio", "2", "--fast", "--no-exact", "--mode",
                                 "b", "--dtype", "float32", "--other-name", "7", "--inner-every", "4"]), Config)
    assert got == Config(name="y", root=Path("data/r"), ratio=2.0, fast=True, exact=False, mode="b", renamed=7,
                         inner=Inner(every=4))
    assert isinstance(got.root, Path) and isinstance(got.ratio, float)
    helps = {a.option_strings[0]: a.help for a in ap._actions if a.option_strings}
    assert helps["--name"] == "the name, 100%% of it (default x)" and helps["--ratio"] == "(default 0.5)"
    assert helps["--no-exact"] == "turns off: exact ops" and helps["--inner-every"] == "how often (default 10)"
    assert "--hidden" not in helps and "--inner-keep" not in helps
    for bad in (["--mode", "c"], ["--dtype", "float16"], ["--ratio", "fast"], ["--exact"]):
        with pytest.raises(SystemExit):
            ap.parse_args(bad)
    with pytest.raises(ValueError, match="every must be >= 0, got -1"):  # the config's own check names it
        options(ap.parse_args(["--inner-every", "-1"]), Config)


def test_a_field_of_an_unflaggable_type_must_say_so() -> None:
    @dataclass
    class Bad:
        sizes: tuple[int, ...] = (1,)

    with pytest.raises(TypeError, match="sizes: .* gets no flag; give it metadata cli=False"):
        add_options(argparse.ArgumentParser(), Bad)


@pytest.mark.parametrize("config", [TrainerConfig, SamplerConfig, RequestLimits, HttpLimits, GatewayConfig])
def test_the_services_configs_document_every_field_and_flag_all_but_the_chosen(config: type) -> None:
    docs, ap = field_docs(config), argparse.ArgumentParser()
    add_options(ap, config)
    dests = {a.dest for a in ap._actions}
    for f in dataclasses.fields(config):
        assert docs.get(f.name), f"{config.__name__}.{f.name} has no docstring"
        if f.metadata.get("cli", True):
            assert f.name in dests or any(d.startswith(f"{f.name}.") for d in dests), f.name
    given = {"device": "cpu", "dtype": "float32"} if "device" in dests else {}
    given |= {"checkpoints": "127.0.0.1:1"} if "checkpoints" in dests else {}
    assert options(ap.parse_args([f"--{k}={v}" for k, v in given.items()]), config) == config(**given)


def test_the_gateway_takes_its_database_from_the_environment_and_never_prints_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``--db`` defaults to $LATHE_DB_URL (a password stays out of argv), and its help names the variable, not the
    value; a value the gateway's config refuses is a usage error naming it."""
    monkeypatch.setenv(DB_ENV, "postgresql+psycopg://lathe:s3cret@db/lathe")
    ap = argparse.ArgumentParser()
    add_options(ap, GatewayConfig)
    cfg = options(ap.parse_args(["--checkpoints", "c:1", "--ledger-keep", "5", "--max-samples", "3"]), GatewayConfig)
    assert cfg.store == StoreConfig("postgresql+psycopg://lathe:s3cret@db/lathe", keep_done=5)
    assert cfg.limits.max_samples == 3
    assert "s3cret" not in ap.format_help() and "$LATHE_DB_URL" in ap.format_help()
    for bad, message in ((["--session-idle-s", "0"], "session_idle_s must be > 0, got 0.0"),
                         (["--http-public-url", "ftp://x"], "is not http(s)://host"),
                         (["--tls-cert", "c.pem"], "--tls-cert and --tls-key go together")):
        with pytest.raises(ValueError, match=re.escape(message)):
            options(ap.parse_args(["--checkpoints", "c:1", *bad]), GatewayConfig)
