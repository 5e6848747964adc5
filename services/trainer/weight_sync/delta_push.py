"""update_weight_mode delta over the weight-update group: the broadcast of `weight_sync.py` carrying, instead of
every tensor, one blob of what changed since the version the engines hold (`delta.DeltaTracker`).

Before each sync every engine is asked its version: when all hold the base, the delta goes in parts of about
PART_BYTES of the model, each a blob broadcast with one /update_weights_delta_from_distributed call per engine, the
next part encoded while one is on the wire; every part but the last keeps the base's version (the engines take the
new one with the last). The tensors any engine reports as failing their checksum, and the parts not sent after that,
are then sent in full (SGLang's /update_weights_from_distributed) to the group; when any engine holds another
version, or the tensors' names, shapes or dtypes changed, the whole model goes in full. A failed sync forgets the
base, so the next one is full.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Iterable

import torch
import torch.distributed as dist

from services.trainer.settings.weight_sync import DeltaSettings
from services.trainer.weight_sync import wire
from services.trainer.weight_sync.delta import DeltaStats, DeltaTracker
from services.trainer.weight_sync.weight_sync import WeightBroadcaster, WeightSyncError, _alongside, _on_all, buckets

log = logging.getLogger(__name__)

PART_BYTES = 64 << 20  # of the model in the served dtype: a 220 MB model goes in 4 parts


class DeltaBroadcaster(WeightBroadcaster):
    """set_engines / broadcast / close as WeightBroadcaster; a broadcast ships a delta where the engines allow."""

    def __init__(self, engine_urls: list[str], *, delta: DeltaSettings | None = None, **kwargs) -> None:
        super().__init__(engine_urls, **kwargs)
        self.tracker = DeltaTracker(delta)
        self.part_bytes = PART_BYTES

    def broadcast(self, named_tensors: Iterable[tuple[str, torch.Tensor]], weight_version: str) -> dict:
        """Pause, push a delta (or the full model where needed), set `weight_version`, continue. Returns stats with
        `mode` (delta or full), `bytes` shipped, `full_bytes`, `changed_fraction` and the `repaired` tensors."""
        start = time.monotonic()
        stats = self._begin_broadcast(weight_version, num_buckets=0)
        if not self.engine_urls:
            return stats
        staged_at = time.monotonic()
        copies = self.tracker.stage(named_tensors, self.dtype)
        stage_s = time.monotonic() - staged_at  # the copy in the served dtype, on the host: every sync's
        full_bytes = sum(t.numel() * t.element_size() for _, t in copies)
        try:
            versions = _on_all(self.clients, "model_info", lambda c: c.weight_version(), self.timeout_s + 1)
        except WeightSyncError as err:
            raise self._failed(err, weight_version, start) from err
        if not (self.tracker.usable(copies) and all(v == self.tracker.version for v in versions)):
            log.info("weights version %s in full: engines hold %s, the delta base is %s", weight_version,
                     sorted(set(versions)), self.tracker.version)
            self.tracker.reset()
            stats = super().broadcast(copies, weight_version)  # raises its own WeightSyncError
            self.tracker.commit(copies, weight_version)
            return {**stats, "mode": "full", "seconds": time.monotonic() - start, "stage_seconds": stage_s,
                    "full_bytes": full_bytes, "changed_fraction": 1.0, "repaired": []}
        try:
            repaired, delta, encode_s = self._push_delta(copies, weight_version)
        except Exception as err:
            raise self._failed(err, weight_version, start) from err
        self.tracker.commit(copies, weight_version)
        repaired_bytes = sum(t.numel() * t.element_size() for n, t in copies if n in repaired)
        stats.update(mode="delta", seconds=time.monotonic() - start, stage_seconds=stage_s, encode_seconds=encode_s,
                     bytes=delta.bytes + repaired_bytes,
                     full_bytes=full_bytes, num_tensors=delta.num_tensors, changed_fraction=delta.changed_fraction,
                     repaired=sorted(repaired))
        log.info("weights version %s as a delta: %.2f MB (%.1f MB in full), %.3f%% of elements changed, %d tensors "
                 "repaired, in %.2f s", weight_version, stats["bytes"] / 1e6, full_bytes / 1e6,
                 100 * delta.changed_fraction, len(repaired), stats["seconds"])
        return stats

    def _failed(self, err: Exception, weight_version: str, start: float) -> WeightSyncError:
        """After a failed delta sync: forget the base, resume the engines, drop the group; the error to raise."""
        self.tracker.reset()
        failed = self._recover(err)
        return WeightSyncError(f"delta weight sync of version {weight_version} to {self.engine_urls} failed after "
                               f"{time.monotonic() - start:.1f} s (the next sync is full): {err}", failed)

    def _push_delta(self, copies: list[tuple[str, torch.Tensor]],
                    weight_version: str) -> tuple[set[str], DeltaStats, float]:
        """Paused: the delta to every engine part by part, part k+1 encoded (in a thread of its own, its tensors
        side by side in the tracker's pool) while part k is on the wire and applied; then in full the tensors any
        engine failed, and the parts left unsent after a failure (an engine refuses deltas until it is repaired).
        Returns the names sent in full, the delta's stats and the seconds spent waiting for an encoding."""
        wait_s = self.timeout_s + 1
        _on_all(self.clients, "pause_generation, begin_weight_update",
                lambda c: (c.pause_generation(self.pause_mode), c.begin_weight_update()), wait_s)
        parts = list(buckets(copies, self.part_bytes)) or [[]]
        versions = [self.tracker.version] * (len(parts) - 1) + [weight_version]
        encoder = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="delta-part")
        failed: set[str] = set()
        unsent: list[tuple[str, torch.Tensor]] = []
        total, encode_wait_s = DeltaStats(), 0.0
        try:
            encoding = encoder.submit(self.tracker.encode, parts[0], versions[0])
            for k in range(len(parts)):
                waited_at = time.monotonic()
                blob, stats = encoding.result()
                encode_wait_s += time.monotonic() - waited_at
                if k + 1 < len(parts):
                    encoding = encoder.submit(self.tracker.encode, parts[k + 1], versions[k + 1])
                total += stats
                failed |= self._send_blob(blob, wait_s)
                if failed:
                    unsent = [item for part in parts[k + 1:] for item in part]
                    break
        finally:
            encoder.shutdown(wait=True, cancel_futures=True)
        if failed:
            log.warning("weights version %s: %d tensors failed their delta checksum on some engine (%s, ...): "
                        "sending them in full%s", weight_version, len(failed), min(failed),
                        f", and the {len(unsent)} tensors of the parts not sent yet" if unsent else "")
            for bucket in buckets([(n, t) for n, t in copies if n in failed] + unsent, self.bucket_bytes):
                self._push_bucket(bucket, weight_version)
        _on_all(self.clients, "end_weight_update, continue_generation",
                lambda c: (c.end_weight_update(), c.continue_generation()), wait_s)
        return failed | {name for name, _ in unsent}, total, encode_wait_s

    def _send_blob(self, blob: bytearray, wait_s: float) -> set[str]:
        """One delta blob to every engine (a broadcast beside each engine's call); the tensors any engine failed."""
        tensor = torch.frombuffer(blob, dtype=torch.uint8).to(wire.wire_device(self.backend))
        replies: list[dict] = [{} for _ in self.clients]

        def call(i: int, client) -> None:
            replies[i] = client.update_weights_delta_from_distributed(len(blob), self.group_name, self.timeout_s)

        def send() -> None:
            wire.wait_all([dist.broadcast(tensor, src=0, group=self.group, async_op=True)], [tensor])

        _alongside(self.clients, f"update_weights_delta_from_distributed of {len(blob)} bytes", call, send, wait_s,
                   on_stuck=self._abort_group)
        return {name for reply in replies for name in reply.get("failed_names", [])}
