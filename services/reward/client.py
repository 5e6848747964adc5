"""RewardClient: score samples through the Reward service's gRPC API; results come back as ScoreResult."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from services.common.gen.physarum.v1 import reward_pb2, reward_pb2_grpc, sample_pb2
from services.common.grpc_client import GrpcClient
from services.common.samples import Sample, dict_to_struct, sample_to_proto

_SERVER_MAX_CONCURRENCY = 64  # the server's default: it scores this many samples at once


@dataclass
class ScoreResult:
    """One sample's score: `reward` is the scalar (0.0 when not ok); `scores` a scorer's dict, when it gave one."""

    reward: float
    ok: bool
    error: str = ""
    scores: dict[str, float] = field(default_factory=dict)


class RewardClient(GrpcClient):
    service = "reward"

    def __init__(self, addr: str, timeout_s: float = 10.0, max_retries: int = 3) -> None:
        super().__init__(addr, timeout_s, max_retries)
        self.stub = reward_pb2_grpc.RewardStub(self.channel)

    def score(self, samples: list[Sample] | list[sample_pb2.Sample], *, rm_type: str = "math",
              custom_rm_path: str = "", reward_key: str = "", timeout_s: float = 10.0,
              args: dict[str, Any] | None = None) -> list[ScoreResult]:
        """Score each sample (per-sample timeout timeout_s); failures come back as ok=False with the reason.

        custom_rm_path ("pkg.mod.fn", slime's `async def f(args, sample)`) wins over rm_type; `args` is handed to
        it as a namespace. Raises InvalidArgument for an unknown rm_type or an unloadable custom_rm_path. A sample
        already converted to its proto is sent as it is.
        """
        request = reward_pb2.ScoreRequest(rm_type=rm_type, custom_rm_path=custom_rm_path, reward_key=reward_key,
                                          timeout_s=timeout_s, args=dict_to_struct(args))
        add = request.samples.add
        for sample in samples:  # a record is converted in place, in the request
            if isinstance(sample, sample_pb2.Sample):
                request.samples.append(sample)
            else:
                sample_to_proto(sample, add)
        # Every sample ends within its timeout once it gets a slot; cover the rounds a full server needs.
        num_rounds = max(1, math.ceil(len(samples) / _SERVER_MAX_CONCURRENCY))
        reply = self.call(self.stub.Score, request, timeout_s=self.timeout_s + timeout_s * num_rounds,
                          idempotent=True)
        return [ScoreResult(s.reward, s.ok, s.error, dict(s.scores) if s.scores else {}) for s in reply.scores]
