"""Weight updates of the CPU engine, done as SGLang does them: from a broadcast or from disk; and deltas (`delta.py`),
received over the group or pulled from shared storage (`pull.py`).

Join the trainer's separate process group (rendezvous, PrefixStore, _new_process_group_helper), receive one
broadcast per parameter from rank 0, load tensors by Hugging Face name; or reload safetensors from disk.
Knows nothing of HTTP: methods return a message or raise.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import threading
import urllib.parse
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from services.common.errors import DeadlineExceeded, FailedPrecondition, InvalidArgument, NotFound
from services.engine import safetensors_io
from services.engine.delta import apply_blob
from services.engine.generation import Engine
from services.engine.group_store import GroupStoreClient
from services.engine.lora import AdapterConfig, LoRAServing, read_peft_dir
from services.engine.pull import is_delta_store, plan, read_delta

log = logging.getLogger(__name__)

DEFAULT_GROUP_NAME = "weight_update_group"
ADAPTERS_DIR = "adapters"  # a LoRA job's snapshot: adapters/<lora_name>/, PEFT's adapter directory each


def init_custom_process_group(*, backend: str, init_method: str, world_size: int, rank: int, group_name: str,
                              timeout: datetime.timedelta) -> tuple[dist.ProcessGroup, dist.Store]:
    """SGLang's init_custom_process_group: a group apart from the default one, keyed by `group_name`. Returns the
    group and the store it joined through, to keep while the group lives. A gloo group joins through
    GroupStoreClient, which connects to the address as given (torch's client asks a reverse DNS lookup of it);
    other backends through torch's rendezvous, as SGLang does."""
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world, rendezvous

    if Backend(backend) == Backend.GLOO:
        try:
            address = urllib.parse.urlsplit(init_method)
            scheme, host, port = address.scheme, address.hostname, address.port
        except ValueError:
            scheme = host = port = None
        if scheme != "tcp" or not host or not port:
            raise InvalidArgument(f"init_method must be tcp://HOST:PORT (an IPv6 address in brackets), got "
                                  f"{init_method!r}")
        store: dist.Store = GroupStoreClient(host, port, timeout)
    else:
        store, rank, world_size = next(rendezvous(init_method, rank, world_size, timeout=timeout))
        store.set_timeout(timeout)
    try:
        group, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), PrefixStore(group_name, store),
                                             group_name=group_name, backend_options=None, timeout=timeout)
    except BaseException:
        if isinstance(store, GroupStoreClient):
            store.close()
        raise
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group, store


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype):
        raise InvalidArgument(f"unknown dtype {name!r} (expected a torch dtype name such as 'float32')")
    return dtype


class WeightUpdater:
    """The engine's weight-update groups, its begin/end update session, and loading tensors into the model."""

    def __init__(self, engine: Engine, timeout_s: float) -> None:
        self.engine = engine
        self.timeout_s = timeout_s
        # HF checkpoint names of every parameter and persistent buffer; a tied lm_head.weight shares the embedding
        self.params: dict[str, torch.Tensor] = language_model_aliases(engine.model.state_dict(keep_vars=True))
        # the checkpoint's multi-token-prediction layers, as the trainer last sent them: SGLang loads them into its
        # speculative draft model; this engine decodes without one and keeps them aside (`_draft_layer`)
        self.draft: dict[str, torch.Tensor] = self._checkpoint_draft(Path(engine.model.name_or_path or "."))
        self.groups: dict[str, dist.ProcessGroup] = {}
        self.stores: dict[str, dist.Store] = {}  # the store each group joined through, kept while it lives
        self.backends: dict[str, str] = {}  # each group's backend
        self.group_lock = threading.Lock()
        self.session_open = False
        self.delta_scratch: np.ndarray | None = None  # where each tensor's delta is decompressed
        self.stale: set[str] = set()  # tensors a failed delta left behind its version: only full values fix them
        # receive buffers by (name, dtype, shape), kept from one sync to the next: allocating (and faulting in) a
        # model's worth of fresh memory per sync cost more than the copy into the model
        self.buffers: dict[tuple[str, str, tuple[int, ...], str], torch.Tensor] = {}

    @contextlib.contextmanager
    def _groups_locked(self) -> Iterator[None]:
        if not self.group_lock.acquire(timeout=self.timeout_s):
            raise DeadlineExceeded(f"another weight-update call held the group for more than {self.timeout_s} s")
        try:
            yield
        finally:
            self.group_lock.release()

    def init_group(self, *, master_address: str, master_port: int, rank_offset: int, world_size: int,
                   group_name: str = DEFAULT_GROUP_NAME, backend: str = "nccl") -> str:
        """Join `group_name` as rank `rank_offset` (tp_size 1); returns once every rank joined."""
        with self._groups_locked():
            if group_name in self.groups:
                raise FailedPrecondition(f"weight update group {group_name!r} already exists; destroy it first")
            host = f"[{master_address}]" if ":" in master_address else master_address  # an IPv6 literal
            init_method = f"tcp://{host}:{master_port}"
            log.info("joining weight update group %s at %s as rank %d of %d (%s)", group_name, init_method,
                     rank_offset, world_size, backend)
            self.groups[group_name], self.stores[group_name] = init_custom_process_group(
                backend=backend, init_method=init_method, world_size=world_size, rank=rank_offset,
                group_name=group_name, timeout=datetime.timedelta(seconds=self.timeout_s))
            self.backends[group_name] = backend
        return "Succeeded to initialize custom process group."

    def destroy_group(self, group_name: str = DEFAULT_GROUP_NAME) -> str:
        with self._groups_locked():
            group = self.groups.pop(group_name, None)
            if group is None:
                raise NotFound(f"weight update group {group_name!r} does not exist")
            dist.destroy_process_group(group)
            # gloo's teardown closes the connection to every peer (0.65 s in a group of 65): not on the caller's time
            last, group = [group, self.stores.pop(group_name, None)], None
            threading.Thread(target=last.clear, name="weight-group-drop", daemon=True).start()
        return "Succeeded to destroy custom process group."

    def begin(self, selector: str = "all") -> str:
        if selector not in ("all", "target", "draft"):
            raise InvalidArgument(f"selector must be one of all, target, draft; got {selector!r}")
        self.session_open = True
        return "Weight update session started."

    def end(self) -> str:
        self.session_open = False
        return "Weight update session ended."

    def update_from_distributed(self, *, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                group_name: str = DEFAULT_GROUP_NAME, weight_version: str | None = None,
                                load_format: str | None = None, abort_all_requests: bool = False) -> str:
        """Receive one broadcast per name from rank 0, in order, then load them all (or none) into the model."""
        if not self.session_open:
            raise FailedPrecondition("update_weights_from_distributed must run between begin_weight_update() and "
                                     "end_weight_update()")
        if not (len(names) == len(dtypes) == len(shapes)):
            raise InvalidArgument(f"names, dtypes and shapes differ in length: {len(names)}, {len(dtypes)}, "
                                  f"{len(shapes)}")
        if load_format not in (None, "direct"):
            raise InvalidArgument(f"load_format {load_format!r} is not supported by the CPU engine (use null)")
        # NCCL receives on the model's GPU, gloo in host memory; _load copies into the parameters either way
        nccl = self.backends.get(group_name) == "nccl"
        device = self.engine.model.device if nccl else torch.device("cpu")
        keys = [(name, dtype, tuple(int(d) for d in shape), str(device))
                for name, dtype, shape in zip(names, dtypes, shapes, strict=True)]
        buffers = [self._buffer(key) for key in keys]
        if abort_all_requests:
            self.engine.abort(abort_all=True, message="Abort by update_weights_from_distributed")
        with self.engine.exclusive(self.timeout_s), self._groups_locked():
            self._receive(group_name, buffers)
            self._load(list(zip(names, buffers, strict=True)), weight_version, keys=keys)
        return "Succeeded to update parameter online."

    def _receive(self, group_name: str, buffers: list[torch.Tensor]) -> None:
        """One broadcast from rank 0 into each buffer, in order, under the caller's group lock."""
        group = self.groups.get(group_name)
        if group is None:
            raise NotFound(f"weight update group {group_name!r} does not exist; call init_weights_update_group")
        works = [dist.broadcast(tensor, src=0, group=group, async_op=True) for tensor in buffers]
        for work in works:
            work.wait()

    def update_delta_from_distributed(self, *, num_bytes: int, group_name: str = DEFAULT_GROUP_NAME) -> dict:
        """Receive one delta blob of `num_bytes` from rank 0 and apply it (`delta.apply_blob`): the tensors whose
        checksum fails keep their values and are named in the reply; the version moves only when none failed."""
        if not self.session_open:
            raise FailedPrecondition("update_weights_delta_from_distributed must run between begin_weight_update() "
                                     "and end_weight_update()")
        if num_bytes <= 0:
            raise InvalidArgument(f"num_bytes must be > 0, got {num_bytes}")
        nccl = self.backends.get(group_name) == "nccl"
        blob = torch.empty(num_bytes, dtype=torch.uint8, device=self.engine.model.device if nccl else "cpu")
        with self.engine.exclusive(self.timeout_s), self._groups_locked():
            group = self.groups.get(group_name)
            if group is None:
                raise NotFound(f"weight update group {group_name!r} does not exist; call init_weights_update_group")
            dist.broadcast(blob, src=0, group=group, async_op=True).wait()
            return self._apply_delta(blob.cpu().numpy())

    def _apply_delta(self, blob) -> dict:
        """Apply a delta blob under the caller's exclusive hold; the reply's fields."""
        if self.stale:
            raise FailedPrecondition(f"{len(self.stale)} tensors failed an earlier delta ({min(self.stale)}, ...): "
                                     f"a full copy is needed first")
        if self.delta_scratch is None:  # kept: fresh memory per sync costs page faults
            largest = max(p.numel() * p.element_size() for p in self.params.values())
            self.delta_scratch = np.empty(largest, dtype=np.uint8)
        result = apply_blob({**self.params, **self.draft}, blob, self.engine.weight_version, self.delta_scratch)
        self.stale |= set(result.failed)
        if not result.failed and result.version != self.engine.weight_version:
            log.info("weight_version %s -> %s (delta, %d tensors)", self.engine.weight_version, result.version,
                     len(result.applied))
            self.engine.weight_version = result.version
        return result.reply()

    def pull(self, source_dir: str, target_version: str) -> dict:
        """Bring the weights to `target_version` from shared storage: the deltas after this engine's version, or
        the newest full snapshot and the deltas after it (`pull.plan`). A delta failing its checksum raises,
        naming it; the engine then takes only full copies until one arrives (the trainer publishes one)."""
        steps = plan(source_dir, None if self.stale else self.engine.weight_version, target_version)
        with self.engine.exclusive(self.timeout_s):
            for step in steps:
                if step.full:
                    self._load_disk(self._disk_headers(step.path), step.version)
                    continue
                reply = self._apply_delta(read_delta(step.path))
                if reply["failed_names"]:
                    raise FailedPrecondition(f"pull_weights: the delta to {step.version} failed its checksum on "
                                             f"{', '.join(reply['failed_names'][:5])}: a full snapshot is needed")
        return {"weight_version": self.engine.weight_version, "steps": [s.describe() for s in steps]}

    def _buffer(self, key: tuple[str, str, tuple[int, ...], str]) -> torch.Tensor:
        if key not in self.buffers:
            self.buffers[key] = torch.empty(key[2], dtype=_dtype(key[1]), device=torch.device(key[3]))
        return self.buffers[key]

    def update_from_disk(self, model_path: str, weight_version: str | None = None,
                         abort_all_requests: bool = False) -> str:
        """Load every *.safetensors file of `model_path`; on any mismatch nothing changes. Each tensor is read
        (readinto, no mapping: page faults on a mapped file cost more than the copy) into this updater's receive
        buffer, which then becomes the parameter's storage, as for a broadcast. A directory of published full
        snapshots and deltas (the pull transport's, as the rollout manager hands a joining engine) is pulled from
        to `weight_version` instead."""
        if (Path(model_path) / ADAPTERS_DIR).is_dir() and not any(Path(model_path).glob("*.safetensors")):
            return self._load_adapter_snapshot(Path(model_path), weight_version)
        if weight_version is not None and is_delta_store(model_path):
            reply = self.pull(model_path, str(weight_version))
            return f"Succeeded to update model weights from {model_path}: {', '.join(reply['steps']) or 'no step'}."
        headers = self._disk_headers(model_path)
        if abort_all_requests:
            self.engine.abort(abort_all=True, message="Abort by update_weights_from_disk")
        with self.engine.exclusive(self.timeout_s):
            num_tensors = self._load_disk(headers, weight_version)
        return f"Succeeded to update model weights from {model_path} ({num_tensors} tensors)."

    def _load_adapter_snapshot(self, path: Path, weight_version: str | None) -> str:
        """A LoRA job's snapshot (what an engine joining later is handed): each PEFT directory under
        path/adapters/<name>/ becomes adapter <name> at `weight_version`, replacing one of that name."""
        lora = self._lora()
        adapters = []
        for directory in sorted(p for p in (path / ADAPTERS_DIR).iterdir() if p.is_dir()):
            config, tensors = read_peft_dir(directory)
            adapters.append(lora.build(directory.name, str(directory), config, tensors))
        with self.engine.exclusive(self.timeout_s):
            for adapter in adapters:
                adapter.weight_version = str(weight_version) if weight_version is not None else \
                    self.engine.weight_version
                lora.add(adapter, replace=True)
            if weight_version is not None:
                self.engine.weight_version = str(weight_version)
        return f"Succeeded to load LoRA adapters {', '.join(a.name for a in adapters)} from {path}."

    def _disk_headers(self, model_path: str | Path) -> list[tuple[Path, dict]]:
        """Each *.safetensors file of `model_path` with its header, checked against the model."""
        files = sorted(Path(model_path).glob("*.safetensors"))
        if not files:
            raise NotFound(f"update_weights_from_disk: no *.safetensors file in {str(model_path)!r}")
        headers = [(f, safetensors_io.read_header(f)[0]) for f in files]
        self._check([(name, shape) for _, entries in headers for name, (_, shape, _, _) in entries.items()])
        return headers

    def _load_disk(self, headers: list[tuple[Path, dict]], weight_version: str | None) -> int:
        """Read the files into receive buffers and load them, under the caller's exclusive hold."""
        keys = [(name, str(dtype).removeprefix("torch."), shape, "cpu")
                for _, entries in headers for name, (dtype, shape, _, _) in entries.items()]
        named = []
        for path, entries in headers:
            targets = {name: self._buffer((name, str(dtype).removeprefix("torch."), shape, "cpu"))
                       for name, (dtype, shape, _, _) in entries.items()}
            safetensors_io.read_into(path, targets)
            named += targets.items()
        self._load(named, weight_version, keys=keys)
        return len(named)

    def _load(self, named: list[tuple[str, torch.Tensor]], weight_version: str | None,
              keys: list[tuple[str, str, tuple[int, ...], str]] | None = None) -> None:
        """Check every tensor against the model, then load them all. With `keys` the tensors are this updater's
        receive buffers: one that matches its parameter's dtype and device becomes the parameter's storage and the
        parameter's old storage becomes the next sync's buffer (a swap: no model-sized copy per sync)."""
        self._check([(name, tuple(tensor.shape)) for name, tensor in named])
        self.stale -= {name for name, _ in named}
        swapped: set[int] = set()
        with torch.no_grad():
            for i, (name, tensor) in enumerate(named):
                if name not in self.params:  # a draft (MTP) weight (`_check`)
                    self.draft[name] = tensor.detach().clone()
                    continue
                param = self.params[name]
                if keys is None or id(tensor) in swapped or (param.dtype, param.device) != (tensor.dtype,
                                                                                           tensor.device):
                    param.copy_(tensor)
                    continue
                self.buffers[keys[i]], param.data = param.data, tensor
                swapped.add(id(tensor))
        if weight_version is not None and str(weight_version) != self.engine.weight_version:
            log.info("weight_version %s -> %s", self.engine.weight_version, weight_version)
            self.engine.weight_version = str(weight_version)

    def _check(self, shapes: list[tuple[str, tuple[int, ...]]]) -> None:
        """Every name is a parameter of the served model, of that shape."""
        for name, shape in shapes:
            param = self.params.get(name, self.draft.get(name))
            if param is None and self._draft_layer(name):  # a draft weight the checkpoint did not have: taken
                continue
            if param is None:
                raise InvalidArgument(f"unknown parameter {name!r}: not a parameter of the served model")
            if tuple(param.shape) != tuple(shape):
                raise InvalidArgument(f"parameter {name!r}: shape {list(shape)} does not match the model's "
                                      f"{list(param.shape)}")

    # -- LoRA adapters (SGLang's /load_lora_adapter, /unload_lora_adapter; the weight sync's adapter push) ----------

    def _lora(self) -> LoRAServing:
        if self.engine.lora is None:
            raise FailedPrecondition("the engine serves no LoRA adapters: start it with --enable-lora")
        return self.engine.lora

    def load_lora_adapter(self, lora_name: str, lora_path: str, pinned: bool = False,
                          weight_version: str | None = None) -> dict:
        """Load PEFT's adapter directory `lora_path` as `lora_name` (a name already loaded is refused, as SGLang
        does). `pinned` is accepted for SGLang's API: every adapter here stays loaded until unloaded."""
        lora = self._lora()
        config, tensors = read_peft_dir(lora_path)
        adapter = lora.build(lora_name, str(lora_path), config, tensors)
        adapter.weight_version = str(weight_version) if weight_version is not None else self.engine.weight_version
        lora.add(adapter)
        log.info("LoRA adapter %s loaded from %s (rank %d, %d modules, %.2f MB)", lora_name, lora_path,
                 config.rank, len(adapter.weights), adapter.num_bytes / 1e6)
        return {"loaded_adapters": lora.loaded()}

    def unload_lora_adapter(self, lora_name: str) -> dict:
        """Unload `lora_name` as SGLang does: refused to new requests at once, unloaded once the requests generated
        with it have finished. SGLang waits for them without bound; here those still unfinished after the weight
        sync timeout end as aborted (a paused engine finishes none)."""
        lora = self._lora()
        lora.get(lora_name)
        lora.close_name(lora_name)
        left = self.engine.drain_adapter(lora_name, self.timeout_s)
        if left:
            self.engine.abort_adapter(lora_name, f"LoRA adapter {lora_name} unloaded ({left} requests still "
                                                 f"generating with it after {self.timeout_s:.0f} s)")
        with self.engine.exclusive(self.timeout_s):
            lora.remove(lora_name)
        log.info("LoRA adapter %s unloaded", lora_name)
        return {"loaded_adapters": lora.loaded()}

    def load_lora_adapter_from_distributed(self, *, lora_name: str, config: dict, names: list[str],
                                           dtypes: list[str], shapes: list[list[int]],
                                           group_name: str = DEFAULT_GROUP_NAME,
                                           weight_version: str | None = None) -> dict:
        """The weight sync of a LoRA job: receive the adapter's tensors (one broadcast each from rank 0, in `names`'
        order) and serve them as `lora_name`, replacing its earlier version whole. `config` is PEFT's
        adapter_config (r, lora_alpha, target_modules). Sets the adapter's weight_version and the engine's."""
        if not (len(names) == len(dtypes) == len(shapes)) or not names:
            raise InvalidArgument(f"names, dtypes and shapes must be non-empty and of one length: {len(names)}, "
                                  f"{len(dtypes)}, {len(shapes)}")
        # the tensors are received before anything else is checked: the trainer and the other engines are in the
        # broadcast, which would hang on an engine that left it
        nccl = self.backends.get(group_name) == "nccl"
        device = self.engine.model.device if nccl else torch.device("cpu")
        buffers = [torch.empty(tuple(int(d) for d in shape), dtype=_dtype(dtype), device=device)
                   for dtype, shape in zip(dtypes, shapes, strict=True)]
        with self._groups_locked():
            self._receive(group_name, buffers)
        lora = self._lora()
        adapter_config = AdapterConfig.from_peft(config, f"LoRA adapter {lora_name!r} config")
        adapter = lora.build(lora_name, "distributed", adapter_config, dict(zip(names, buffers, strict=True)))
        with self.engine.exclusive(self.timeout_s):
            adapter.weight_version = str(weight_version) if weight_version is not None else \
                self.engine.weight_version
            lora.add(adapter, replace=True)
            if weight_version is not None:
                self.engine.weight_version = str(weight_version)
        log.info("LoRA adapter %s version %s received (%d tensors, %.2f MB)", lora_name, adapter.weight_version,
                 len(names), adapter.num_bytes / 1e6)
        return {"loaded_adapters": lora.loaded()}

    def _checkpoint_draft(self, model_dir: Path) -> dict[str, torch.Tensor]:
        """The draft (MTP) tensors of the checkpoint the model was loaded from, which transformers leaves out (a
        delta then has a base for them)."""
        from safetensors import safe_open

        draft = {}
        for path in sorted(model_dir.glob("*.safetensors")):
            with safe_open(str(path), framework="pt") as file:
                draft.update({name: file.get_tensor(name) for name in file.keys() if self._draft_layer(name)})
        return draft

    def _draft_layer(self, name: str) -> bool:
        """Whether `name` is a weight of one of the served checkpoint's multi-token-prediction layers
        (num_nextn_predict_layers, Qwen3-Next's and Qwen3.5's mtp_num_hidden_layers): MiMo's model.mtp_layers.{i}.*,
        DeepSeek-V3's and GLM-4.5's model.layers.{num_hidden_layers + i}.*, Qwen3-Next's and Qwen3.5's mtp.*."""
        config = self.engine.model.config.get_text_config()
        count = int(getattr(config, "num_nextn_predict_layers", 0) or getattr(config, "mtp_num_hidden_layers", 0)
                    or 0)
        if count and name.startswith("mtp."):
            return True
        for prefix, first in (("model.mtp_layers.", 0), ("model.layers.", config.num_hidden_layers)):
            index = name.removeprefix(prefix).split(".", 1)[0]
            if name.startswith(prefix) and index.isdigit() and first <= int(index) < first + count:
                return True
        return False

    def get_weights(self, name: str, truncate_size: int = 100) -> list[float]:
        param = self.params.get(name, self.draft.get(name))
        if param is None:
            raise NotFound(f"unknown parameter {name!r}")
        return param.detach().flatten()[: max(int(truncate_size), 0)].tolist()


LANGUAGE_MODEL = "model.language_model."


def language_model_aliases(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A vision-language model's tensors also under its language model's causal-LM names (model.language_model.X as
    model.X): a trainer that trains a Qwen3.5 checkpoint as text sends those to the engine serving it whole."""
    aliases = {"model." + name.removeprefix(LANGUAGE_MODEL): param for name, param in params.items()
               if name.startswith(LANGUAGE_MODEL)}
    return {**{name: param for name, param in aliases.items() if name not in params}, **params}
