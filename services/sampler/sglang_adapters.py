"""The adapters an SGLang server holds for one sampler pool: published as PEFT directories, loaded by name, evicted
least recently used.

    key (tenant, path, version)  ->  lora name "lathe-<hash of the key>", loaded in the server from
                                     <adapter_dir>/<name>/ (adapter_model.safetensors, adapter_config.json,
                                     lathe_export.json: ``lathe.export.write_peft``, as ``lathe checkpoint export``
                                     writes them)

``acquire`` fetches a checkpoint through the ``AdapterSource`` (the checkpoints service; refused when overwritten
since the sampling client was bound), writes its directory (into a temporary sibling, then renamed: the server never
sees half a directory), and ``POST /load_lora_adapter {lora_name, lora_path}``; ``release`` ends one request's use;
``reload`` loads a held adapter again when the server lost it (a restarted SGLang container forgets its adapters).
Past ``capacity`` loaded adapters, the least recently used one that no request is using is unloaded (``POST
/unload_lora_adapter {lora_name}``) and its directory removed; adapters in use are never unloaded, so the server may
briefly hold more. Loads and unloads run one at a time (concurrent requests for one adapter share its load). Owned by
``sglang.SGLangEngine``; runs on its event loop only.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import shutil
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from lathe.errors import InvalidArgument, LatheError, NotFound
from lathe.export import write_peft
from lathe.sampler.adapters import AdapterSource, fetch_checkpoint, peft_config
from lathe.sampler.intake import Ask

Key = tuple[str, str, float]
Post = Callable[[str, dict], Awaitable[object]]
log = logging.getLogger("lathe.sampler")


@dataclass(slots=True)
class _Loaded:
    name: str
    directory: Path
    users: int = 0


def lora_name(key: Key) -> str:
    """The name an adapter is loaded under: a hash of (tenant, path, version), so an overwritten checkpoint is a
    new adapter and no tenant can name another's."""
    return "lathe-" + hashlib.sha256(repr(key).encode()).hexdigest()[:24]


class ServerAdapters:
    """LRU of the adapters loaded in one SGLang server; ``post(route, body)`` calls the server."""

    def __init__(self, source: AdapterSource | None, directory: Path, capacity: int, post: Post,
                 on_event: Callable[[str], None] = lambda event: None) -> None:
        self.source, self.directory, self.capacity = source, directory, capacity
        self._post, self._on_event = post, on_event
        self._loaded: OrderedDict[Key, _Loaded] = OrderedDict()
        self._lock = asyncio.Lock()  # one load or unload at a time: the server's list and ours stay alike

    def __len__(self) -> int:
        return len(self._loaded)

    async def acquire(self, ask: Ask) -> str:
        """The lora name of ``ask``'s adapter, loaded in the server and held until ``release``."""
        key = (ask.tenant, ask.model_path, ask.model_version)
        async with self._lock:
            entry = self._loaded.get(key)
            if entry is None:
                entry = self._loaded[key] = await self._load(key, ask.base_model)
            self._loaded.move_to_end(key)
            entry.users += 1
            await self._evict()
        return entry.name

    async def release(self, name: str) -> None:
        """One request done with adapter ``name``; unloads past ``capacity`` once nobody uses them."""
        async with self._lock:
            for entry in self._loaded.values():
                if entry.name == name:
                    entry.users -= 1
            await self._evict()

    async def reload(self, name: str) -> bool:
        """Load adapter ``name`` (held by the caller) into the server again, for when the server lost it (it
        restarted); False when the server refuses because it still holds it."""
        async with self._lock:
            entry = next(e for e in self._loaded.values() if e.name == name)
            try:
                await self._post("/load_lora_adapter", {"lora_name": name, "lora_path": str(entry.directory)})
            except InvalidArgument:
                return False
            self._on_event("load")
            return True

    async def _load(self, key: Key, base_model: str) -> _Loaded:
        files = await asyncio.to_thread(fetch_checkpoint, self.source, *key)
        name = lora_name(key)
        directory = self.directory / name
        await asyncio.to_thread(self._publish, files, directory, base_model, key)
        try:
            await self._post("/load_lora_adapter", {"lora_name": name, "lora_path": str(directory)})
        except BaseException:
            await asyncio.to_thread(shutil.rmtree, directory, True)
            raise
        self._on_event("load")
        return _Loaded(name, directory)

    @staticmethod
    def _publish(files: dict[str, bytes], directory: Path, base_model: str, key: Key) -> None:
        config = peft_config(files, base_model)
        staging = directory.with_name(directory.name + ".partial")
        shutil.rmtree(staging, ignore_errors=True)
        write_peft(files, staging, base_model=config.get("base_model_name_or_path") or base_model,
                   metadata={"export": "sglang", "tinker_path": key[1], "version": key[2], "base_model": base_model})
        shutil.rmtree(directory, ignore_errors=True)
        staging.rename(directory)

    async def _evict(self) -> None:
        """Unload the least recently used idle adapters past ``capacity``; never fails the request that made room.
        An unload the server refuses (400/404: it does not hold the adapter, say after a restart) drops the adapter
        all the same; one it cannot answer (``Unavailable``) is logged and tried again at the next call."""
        while len(self._loaded) > self.capacity:
            idle = next((k for k, e in self._loaded.items() if e.users == 0), None)
            if idle is None:
                return
            entry = self._loaded[idle]
            try:
                await self._post("/unload_lora_adapter", {"lora_name": entry.name})
                self._on_event("unload")
            except (InvalidArgument, NotFound) as e:
                log.warning("the SGLang server did not hold adapter %s: %s", entry.name, e.message)
            except LatheError as e:
                log.warning("the SGLang server kept adapter %s: %s", entry.name, e.message)
                return
            del self._loaded[idle]
            await asyncio.to_thread(shutil.rmtree, entry.directory, True)
