"""A joining engine's weights when the latest snapshot is a LoRA job's (adapters/<name>/ only, no model file):
SGLang's /update_weights_from_disk reads no adapter, so the engine's version is set (/update_weight_version) and the
latest adapter of every LoRA job on the pool loaded with /load_lora_adapter under its name; the base model is the one
the engine started with.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from pathlib import Path

from services.common.errors import FailedPrecondition, PhysarumError
from services.common.sglang import AsyncSGLangClient
from services.rollout.client import ADAPTERS_DIR


def snapshot_adapters(path: str) -> list[tuple[str, str]]:
    """(name, directory) of each adapter of a LoRA job's snapshot at `path`; [] for a snapshot of full weights."""
    root = Path(path)
    if not path or not (root / ADAPTERS_DIR).is_dir() or any(root.glob("*.safetensors")):
        return []
    return [(d.name, str(d)) for d in sorted((root / ADAPTERS_DIR).iterdir()) if d.is_dir()]


def pool_adapters(latest: str, job_snapshots: Iterable[str]) -> list[tuple[str, str]]:
    """What an engine joining the pool loads: [] when the latest snapshot (`latest`) is of full weights, else the
    adapters of each LoRA job's latest snapshot (`job_snapshots`: the pool's, one per job) and of `latest`."""
    if not snapshot_adapters(latest):
        return []
    adapters = dict(snapshot_adapters(latest))
    for path in job_snapshots:
        adapters.update((name, directory) for name, directory in snapshot_adapters(path) if name not in adapters)
    return sorted(adapters.items())


async def load_adapters(engines: AsyncSGLangClient, url: str, adapters: list[tuple[str, str]], version: str,
                        timeout_s: float) -> None:
    """Bring the engine at `url` to `version` of a LoRA job's snapshot (`snapshot_adapters`). A name the engine holds
    already (an earlier try's: SGLang refuses to load it again) is unloaded and loaded afresh."""
    await engines.update_weight_version(url, version, timeout_s)
    for name, directory in adapters:
        try:
            await engines.load_lora_adapter(url, name, directory, timeout_s)
        except FailedPrecondition:
            with contextlib.suppress(PhysarumError):
                await engines.unload_lora_adapter(url, name, timeout_s)
            await engines.load_lora_adapter(url, name, directory, timeout_s)
