"""The weight broadcast's settings (Physarum's own, and slime's update_weight_* names where they have one)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from services.common import weight_delta
from services.common.config import POSITIVE, check_fields, field


@dataclass(frozen=True)
class DeltaSettings:
    """How a delta is encoded and checked (slime's --update-weight-delta-encoding / --update-weight-delta-checksum)."""

    encoding: str = "xor"
    checksum: str = "xxh3-128"

    def __post_init__(self) -> None:
        weight_delta.check_choice("update_weight_delta_encoding", self.encoding, weight_delta.ENCODINGS)
        weight_delta.check_choice("update_weight_delta_checksum", self.checksum, weight_delta.CHECKSUMS)


@dataclass(frozen=True, kw_only=True)
class SyncConfig:
    update_weight_buffer_size: int = field(512 << 20, "bytes per broadcast bucket (slime's default)", POSITIVE)
    weight_sync_backend: Literal["auto", "gloo", "nccl", "shm", "disk"] = field(
        "auto", "how weights reach the engines: nccl, gloo (torch.distributed groups), shm (engines on the trainer's "
                "host load a snapshot from /dev/shm), disk (published to update_weight_disk_dir, shared storage the "
                "engines pull from), auto (shm for engines on the trainer's host, nccl from CUDA ranks to GPU "
                "engines on other hosts, else gloo)")
    weight_sync_timeout_s: float = field(60.0, "seconds one weight sync may take", POSITIVE)
    update_weight_mode: Literal["full", "delta"] = field(
        "full", "full: every sync sends every tensor; delta: only the elements whose served-precision bits changed "
                "since the engines' version (a full copy to an engine at another version), over weight_sync_backend "
                "gloo, nccl, auto (never shm) or disk")
    update_weight_delta_encoding: Literal["xor", "overwrite"] = field(
        "xor", "a delta's encoding: xor of the old and new bits, or the changed positions with their new values")
    update_weight_delta_checksum: Literal["xxh3-128", "adler32"] = field(
        "xxh3-128", "the checksum of each tensor's new bits; a mismatch gets the tensor a full copy")
    update_weight_disk_dir: str = field(
        "", "weight_sync_backend disk: the directory shared by the trainer and the engines (a volume) where full "
            "snapshots and deltas are published")
    lora_sync: Literal["auto", "push", "disk"] = field(
        "auto", "how a LoRA job's adapter reaches the engines after each step: push (over the weight-update group, "
                "the CPU engine's /load_lora_adapter_from_distributed), disk (a PEFT directory per version, in the "
                "pool's snapshot directory or update_weight_disk_dir, loaded by SGLang's /load_lora_adapter under "
                "a versioned name), auto (push when every engine is a Physarum CPU engine, else disk)")

    def __post_init__(self) -> None:
        check_fields(self)
        if self.weight_sync_backend == "disk" and not self.update_weight_disk_dir:
            raise ValueError("weight_sync_backend disk needs update_weight_disk_dir (a directory the engines share)")
        if self.update_weight_mode == "delta" and self.weight_sync_backend == "shm":
            raise ValueError("update_weight_mode delta goes over weight_sync_backend gloo, nccl, auto or disk, not shm "
                             "(an engine on the trainer's host reads the whole snapshot from memory anyway)")

    def broadcaster_options(self) -> dict:
        """make_broadcaster's keyword arguments for the delta and disk settings."""
        return {"update_weight_mode": self.update_weight_mode, "disk_dir": self.update_weight_disk_dir,
                "delta": DeltaSettings(self.update_weight_delta_encoding, self.update_weight_delta_checksum)}
