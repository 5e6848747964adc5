"""Several LoRA jobs on one base model in one trainer: the base is loaded once, each job trains its own adapter on it
(its own A and B, its own optimizer), and the jobs take turns: a job's backend call runs with the base to itself and
its adapter in the layers (`TakingTurns`). What the jobs share of the engines (the base they serve, one weight sync at
a time) is here too, for the jobs' weight pushes. Knows nothing of how a backend is built or what a job is."""

from __future__ import annotations

import collections
import functools
import inspect
import logging
import threading
from collections.abc import Callable, Hashable, Iterator
from typing import Any

from torch import nn

from services.trainer.lora import layers

log = logging.getLogger(__name__)


class SharedBase:
    """One base model and the LoRA jobs training on it. `turn` is held through each backend call of a job (so one
    job's forward, step or save at a time); `base_pushed` is set once the engines hold the base; `sync_lock` keeps the
    jobs' weight syncs one after another (the pool tracks one sync at a time)."""

    def __init__(self, key: Hashable) -> None:
        self.key = key
        self.model: nn.Module | None = None  # the first job's, with its LoRA layers
        self.turn = threading.RLock()
        self.installed: str = ""  # the job whose adapter the layers hold
        self.adapters: dict[str, layers.Adapter] = {}  # by job id
        self.base_pushed = threading.Event()
        self.sync_lock = threading.Lock()

    def use(self, job_id: str) -> None:
        """Put job `job_id`'s adapter into the layers (the turn held)."""
        if self.installed != job_id:
            layers.install(self.model, self.adapters[job_id])
            self.installed = job_id


class TakingTurns:
    """A job's backend on a shared base: each method call takes the base's turn and puts the job's adapter in first;
    an iterator a call returns is read whole inside the turn (its tensors are the job's own afterwards). Attributes
    that are no methods (config, model_path, the shared model) read through."""

    def __init__(self, backend: Any, base: SharedBase, job_id: str) -> None:
        self._backend, self._base, self._job_id = backend, base, job_id

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._backend, name)
        if not inspect.ismethod(value):  # the model itself (a callable module) reads through too
            return value

        @functools.wraps(value)
        def in_turn(*args, **kwargs):
            with self._base.turn:
                self._base.use(self._job_id)
                result = value(*args, **kwargs)
                return iter(list(result)) if isinstance(result, Iterator) else result
        return in_turn


class SharedBases:
    """The trainer's shared bases by key: the first job of a key builds the base, the later ones attach to it while
    it is in use; the base is dropped when its last job ends."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._bases: dict[Hashable, SharedBase] = {}
        self._users: collections.Counter[Hashable] = collections.Counter()

    def attach(self, key: Hashable, job_id: str, build: Callable[[nn.Module | None], Any]) -> tuple[TakingTurns,
                                                                                                   SharedBase]:
        """Job `job_id`'s backend on the base of `key`: `build(None)` loads it (the first job), `build(model)` puts
        a fresh adapter on the loaded one; both in the base's turn."""
        with self._lock:
            base = self._bases.setdefault(key, SharedBase(key))
            self._users[key] += 1
        try:
            with base.turn:
                backend = build(base.model)
                if base.model is None:
                    base.model = backend.model
                base.adapters[job_id] = layers.adapter_of(base.model)
                base.installed = job_id
        except BaseException:
            self.detach(key, job_id)
            raise
        log.info("job %s trains its adapter on the shared base %s (%d jobs on it)", job_id, key, self._users[key])
        return TakingTurns(backend, base, job_id), base

    def detach(self, key: Hashable, job_id: str) -> None:
        """Job `job_id` ended: its adapter leaves the base; the base goes with its last job."""
        with self._lock:
            base = self._bases.get(key)
            if base is None:
                return
            base.adapters.pop(job_id, None)
            self._users[key] -= 1
            if self._users[key] <= 0:
                del self._bases[key], self._users[key]

    def __len__(self) -> int:
        with self._lock:
            return len(self._bases)
