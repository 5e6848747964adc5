"""Serving LoRA adapters over one base model, as SGLang does (--enable-lora): the adapters loaded by name (from a
PEFT directory or from tensors the weight sync sends), each request naming its own, several in one batch.

Each targeted Linear of the model becomes a MultiLoRALinear that adds, to each row of the batch, the delta of that
row's adapter: scaling · B(A(x)); rows without an adapter get the base model alone. Knows nothing of HTTP or of how
tensors arrive.
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from services.common.errors import FailedPrecondition, InvalidArgument, NotFound

PEFT_PREFIX = "base_model.model."  # PEFT's names: base_model.model.<module>.lora_A.weight
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ALL_MODULES = "all"  # --lora-target-modules all: every Linear of the language model but lm_head
_VISION_PARTS = ("visual", "vision_tower", "vision_model")  # a VLM's image side keeps its base weights


@dataclass(frozen=True)
class AdapterConfig:
    """What an adapter's shape and scale are: PEFT's adapter_config.json fields that the engine reads."""

    rank: int
    alpha: float
    target_modules: tuple[str, ...]

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    @classmethod
    def from_peft(cls, config: dict, where: str) -> AdapterConfig:
        """From PEFT's adapter_config (a dict); InvalidArgument naming what this engine cannot serve."""
        if not isinstance(config, dict):
            raise InvalidArgument(f"{where}: the adapter config must be a JSON object")
        if config.get("peft_type", "LORA") != "LORA":
            raise InvalidArgument(f"{where}: peft_type {config.get('peft_type')!r} is not LORA")
        for key, plain in (("use_rslora", False), ("use_dora", False), ("bias", "none")):
            if config.get(key, plain) not in (plain, None):
                raise InvalidArgument(f"{where}: {key}={config[key]!r} is not served (only plain LoRA: {key}="
                                      f"{plain!r})")
        if config.get("modules_to_save"):
            raise InvalidArgument(f"{where}: modules_to_save is not served (the adapter may change only LoRA A/B)")
        rank, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise InvalidArgument(f"{where}: r must be an integer >= 1, got {rank!r}")
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or alpha <= 0:
            raise InvalidArgument(f"{where}: lora_alpha must be a number > 0, got {alpha!r}")
        targets = config.get("target_modules") or []
        targets = [targets] if isinstance(targets, str) else targets
        if not isinstance(targets, list) or not targets or not all(isinstance(t, str) for t in targets):
            raise InvalidArgument(f"{where}: target_modules must be a non-empty list of module names")
        return cls(rank=rank, alpha=float(alpha), target_modules=tuple(sorted(targets)))


@dataclass
class Adapter:
    """One loaded adapter: its A [r, in] and B [out, r] per module (the model's module names), on the model's
    device in its dtype."""

    name: str
    path: str  # where it came from: a directory, or "distributed" for the weight sync's push
    config: AdapterConfig
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]
    weight_version: str = ""
    num_bytes: int = field(default=0)


class MultiLoRALinear(nn.Module):
    """A Linear with per-row adapters. It holds the wrapped Linear's `weight` and `bias`, so the base weights keep
    their Hugging Face names (full weight syncs load them as before)."""

    def __init__(self, linear: nn.Linear, name: str, serving: LoRAServing) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self.module_name = name
        self.serving = serving

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight, self.bias)
        for adapter, rows in self.serving.active:
            pair = adapter.weights.get(self.module_name)
            if pair is None:
                continue
            a, b = pair
            if rows is None:  # every row of the batch has this adapter
                out = out + F.linear(F.linear(x, a), b) * adapter.config.scaling
            else:
                delta = F.linear(F.linear(x.index_select(0, rows), a), b) * adapter.config.scaling
                out = out.index_add(0, rows, delta)
        return out

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"


def _language_linears(model: nn.Module) -> Iterator[tuple[str, nn.Linear]]:
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and name.split(".")[-1] != "lm_head" and \
                not any(part in name.split(".") for part in _VISION_PARTS):
            yield name, module


def _matches(name: str, target: str) -> bool:
    """PEFT's rule: the module's last name component, or a dotted suffix of its name."""
    return name == target or name.endswith("." + target)


class LoRAServing:
    """The engine's adapters: which Linear layers can take one (`target_modules`), the loaded adapters by name, and
    the adapters of the batch being computed (`active`, set by `batch` around each forward)."""

    def __init__(self, model: nn.Module, *, max_loras_per_batch: int, max_lora_rank: int,
                 target_modules: Sequence[str]) -> None:
        self.max_loras_per_batch = max_loras_per_batch
        self.max_lora_rank = max_lora_rank  # 0: any rank
        self.adapters: dict[str, Adapter] = {}
        self.unloading: set[str] = set()  # names no new request may take: their requests drain, then they go
        self.active: list[tuple[Adapter, torch.Tensor | None]] = []
        self.lock = threading.Lock()  # the adapter table: the scheduler reads it while HTTP calls change it
        wanted = list(target_modules) or [ALL_MODULES]
        self.layers: dict[str, MultiLoRALinear] = {}
        for name, linear in list(_language_linears(model)):
            if ALL_MODULES in wanted or any(_matches(name, t) for t in wanted):
                parent_name, _, child = name.rpartition(".")
                parent = model.get_submodule(parent_name) if parent_name else model
                layer = MultiLoRALinear(linear, name, self)
                setattr(parent, child, layer)
                self.layers[name] = layer
        if ALL_MODULES not in wanted:
            missing = [t for t in wanted if not any(_matches(n, t) for n in self.layers)]
            if missing:
                raise ValueError(f"lora_target_modules: {', '.join(missing)} match no Linear layer of the model "
                                 f"(lm_head and a vision tower take no adapter)")
        self.target_modules = tuple(sorted({n.split(".")[-1] for n in self.layers}))

    # -- the adapter table -----------------------------------------------------------------------------------

    def loaded(self) -> dict[str, str]:
        """SGLang's loaded_adapters: name -> where it was loaded from."""
        with self.lock:
            return {name: adapter.path for name, adapter in self.adapters.items()}

    def get(self, name: str) -> Adapter:
        with self.lock:
            adapter = self.adapters.get(name)
        if adapter is None:
            loaded = ", ".join(sorted(self.adapters)) or "none"
            raise NotFound(f"LoRA adapter {name!r} is not loaded (loaded: {loaded})")
        return adapter

    def check_name(self, name: str, where: str) -> None:
        """A request's lora_path: InvalidArgument unless an adapter of that name is loaded."""
        with self.lock:
            if name in self.adapters and name not in self.unloading:
                return
            loaded = ", ".join(sorted(set(self.adapters) - self.unloading)) or "none"
        raise InvalidArgument(f"{where}: lora_path {name!r} names no loaded LoRA adapter (loaded: {loaded}); "
                              f"load it with /load_lora_adapter")

    def build(self, name: str, path: str, config: AdapterConfig, tensors: dict[str, torch.Tensor]) -> Adapter:
        """An Adapter from tensors named `<module>.lora_A.weight` / `.lora_B.weight` (PEFT's prefix allowed), checked
        against this engine's layers, rank limit and the config; moved to the model's device and dtype."""
        where = f"LoRA adapter {name!r}"
        if self.max_lora_rank and config.rank > self.max_lora_rank:
            raise InvalidArgument(f"{where}: rank {config.rank} is over --max-lora-rank {self.max_lora_rank}")
        pairs: dict[str, dict[str, torch.Tensor]] = {}
        for key, tensor in tensors.items():
            module, _, kind = key.removeprefix(PEFT_PREFIX).rpartition(".lora_")
            if kind not in ("A.weight", "B.weight"):
                raise InvalidArgument(f"{where}: tensor {key!r} is not a LoRA A or B weight")
            pairs.setdefault(module, {})[kind[0]] = tensor
        weights = {}
        for module, pair in sorted(pairs.items()):
            layer = self.layers.get(module)
            if layer is None:
                raise InvalidArgument(f"{where}: module {module!r} takes no adapter on this engine (its "
                                      f"--lora-target-modules: {', '.join(self.target_modules)})")
            if set(pair) != {"A", "B"}:
                raise InvalidArgument(f"{where}: module {module!r} has lora_{''.join(pair)} without its pair")
            a, b = pair["A"], pair["B"]
            if tuple(a.shape) != (config.rank, layer.in_features) or tuple(b.shape) != (layer.out_features,
                                                                                       config.rank):
                raise InvalidArgument(f"{where}: module {module!r}: lora_A {list(a.shape)} and lora_B "
                                      f"{list(b.shape)} do not fit rank {config.rank} and the layer's "
                                      f"[{layer.out_features}, {layer.in_features}]")
            weight = layer.weight
            weights[module] = (a.to(weight.device, weight.dtype).contiguous(),
                               b.to(weight.device, weight.dtype).contiguous())
        if not weights:
            raise InvalidArgument(f"{where}: no LoRA tensors")
        num_bytes = sum(t.numel() * t.element_size() for pair in weights.values() for t in pair)
        return Adapter(name=name, path=path, config=config, weights=weights, num_bytes=num_bytes)

    def close_name(self, name: str) -> None:
        """Refuse new requests naming `name` from now on (it is being unloaded); the ones it serves go on."""
        with self.lock:
            if name in self.adapters:
                self.unloading.add(name)

    def add(self, adapter: Adapter, *, replace: bool = False) -> None:
        """Make `adapter` servable under its name; a name already loaded is refused unless `replace` (the weight
        sync's new version of an adapter)."""
        with self.lock:
            if adapter.name in self.adapters and not replace:
                raise FailedPrecondition(f"LoRA adapter {adapter.name!r} is already loaded (from "
                                         f"{self.adapters[adapter.name].path}); unload it first")
            self.adapters[adapter.name] = adapter

    def remove(self, name: str) -> Adapter:
        with self.lock:
            adapter = self.adapters.pop(name, None)
            self.unloading.discard(name)
        if adapter is None:
            raise NotFound(f"LoRA adapter {name!r} is not loaded")
        return adapter

    # -- a batch's adapters ----------------------------------------------------------------------------------

    @contextlib.contextmanager
    def batch(self, names: Sequence[str | None], device: torch.device) -> Iterator[None]:
        """The adapters of a forward over rows named `names` (None: the base model). A name no longer loaded
        (unloaded while its request was aborted) adds nothing."""
        groups: dict[str, list[int]] = {}
        for row, name in enumerate(names):
            if name is not None:
                groups.setdefault(name, []).append(row)
        with self.lock:
            found = [(self.adapters[name], rows) for name, rows in groups.items() if name in self.adapters]
        self.active = [(adapter, None if len(rows) == len(names) else
                        torch.tensor(rows, dtype=torch.long, device=device)) for adapter, rows in found]
        try:
            yield
        finally:
            self.active = []


def read_peft_dir(path: str | Path) -> tuple[AdapterConfig, dict[str, torch.Tensor]]:
    """PEFT's adapter directory: adapter_config.json and adapter_model.safetensors."""
    from safetensors.torch import load_file

    path = Path(path)
    config_file, weights_file = path / ADAPTER_CONFIG, path / ADAPTER_WEIGHTS
    if not config_file.is_file():
        raise NotFound(f"lora_path {str(path)!r}: no {ADAPTER_CONFIG} (a PEFT adapter directory holds "
                       f"{ADAPTER_CONFIG} and {ADAPTER_WEIGHTS})")
    if not weights_file.is_file():
        raise NotFound(f"lora_path {str(path)!r}: no {ADAPTER_WEIGHTS}")
    try:
        raw = json.loads(config_file.read_text())
    except ValueError as err:
        raise InvalidArgument(f"{config_file}: not valid JSON: {err}") from err
    return AdapterConfig.from_peft(raw, str(config_file)), load_file(str(weights_file))


def parse_lora_paths(entries: Sequence[str]) -> list[tuple[str, str]]:
    """SGLang's --lora-paths entries: NAME=PATH, or PATH (named by itself)."""
    pairs = []
    for entry in entries:
        name, sep, path = entry.partition("=")
        pairs.append((name, path) if sep else (entry, entry))
    return pairs
