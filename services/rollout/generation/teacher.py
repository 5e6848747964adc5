"""On-policy distillation's teacher log-probs (opd_type sglang): each finished sample's tokens go to the teacher's
SGLang /generate as a prefill-only call (max_new_tokens 0, return_logprob, logprob_start_len at the response), and
the teacher's log-prob of every response token becomes the sample's teacher_log_probs. This is slime's
on_policy_distillation reward function and reward post-process in one step; the trainer folds the log-probs into
the advantages. Knows nothing of the buffer or the trainer.
"""

from __future__ import annotations

import asyncio
import logging
import math
from typing import Any

from services.common.errors import FailedPrecondition, InvalidArgument, Unavailable
from services.common.samples import Sample
from services.rollout.engine_calls.router_http import Poster, PostError

log = logging.getLogger(__name__)

MAX_ATTEMPTS = 3  # a teacher restarting gets this many tries per sample (idempotent: it only reads)
RETRY_DELAY_S = 1.0


def teacher_request(sample: Sample, temperature: float) -> dict[str, Any]:
    """The prefill-only /generate body: the teacher scores the sample's own tokens from its first response token,
    at the rollout's temperature (as slime's reward function asks it)."""
    return {"input_ids": list(sample.tokens), "return_logprob": True,
            "logprob_start_len": len(sample.tokens) - sample.response_length,
            "sampling_params": {"temperature": temperature, "max_new_tokens": 0, "skip_special_tokens": False}}


def response_log_probs(reply: Any, sample: Sample, where: str) -> list[float]:
    """The teacher's log-probs of the sample's response tokens from SGLang's meta_info.input_token_logprobs
    ([logprob, token_id, ...] per scored input token; a teacher that scored from the start gives more, as slime's
    logprob_start_len 0 does: the last response_length are the response's)."""
    num = sample.response_length
    entries = (reply.get("meta_info") or {}).get("input_token_logprobs") if isinstance(reply, dict) else None
    if not isinstance(entries, list) or len(entries) < num:
        raise FailedPrecondition(f"{where}: the reply holds no input_token_logprobs for the {num} response tokens "
                                 "(the teacher must answer SGLang's return_logprob with logprob_start_len)")
    entries = entries[len(entries) - num:]
    if [int(entry[1]) for entry in entries] != list(sample.tokens[-num:]):
        raise FailedPrecondition(f"{where}: the teacher scored other tokens than the sample's response (a teacher "
                                 "with another tokenizer or vocabulary?)")
    values = [entry[0] for entry in entries]
    if not all(isinstance(v, (int, float)) and math.isfinite(v) for v in values):
        raise FailedPrecondition(f"{where}: the teacher gave a log-prob that is not a finite number")
    return [float(v) for v in values]


async def score_with_teacher(http: Poster, url: str, sample: Sample, *, temperature: float, what: str) -> None:
    """Set sample.teacher_log_probs from the teacher at `url`; bounded retries while it is unreachable or failing
    (5xx), InvalidArgument when it rejects the request (4xx: a misconfigured job), Unavailable after the last try."""
    where = f"{what}: teacher {url}"
    if sample.response_length == 0:
        sample.teacher_log_probs = []
        return
    last = ""
    for attempt in range(1, MAX_ATTEMPTS + 1):
        try:
            reply = await http.post(url, teacher_request(sample, temperature))
            if 400 <= reply.status_code < 500:
                raise InvalidArgument(f"{where} rejected the request: HTTP {reply.status_code}: {reply.text[:300]}")
            if reply.status_code < 300:
                sample.teacher_log_probs = response_log_probs(reply.json(), sample, where)
                return
            last = f"HTTP {reply.status_code}: {reply.text[:200]}"
        except PostError as err:
            last = str(err)
        if attempt < MAX_ATTEMPTS:
            log.warning("%s: attempt %d/%d failed (%s); retrying", where, attempt, MAX_ATTEMPTS, last)
            await asyncio.sleep(RETRY_DELAY_S * attempt)
    raise Unavailable(f"{where}: no answer after {MAX_ATTEMPTS} attempts; last: {last}")


async def score_group_with_teacher(http: Poster, url: str, samples: list[Sample], *, temperature: float,
                                   what: str) -> None:
    """Every sample of a group, concurrently; the first failure fails the group."""
    try:
        async with asyncio.TaskGroup() as tasks:
            for j, sample in enumerate(samples):
                tasks.create_task(score_with_teacher(http, url, sample, temperature=temperature,
                                                     what=f"{what} sample {j}"))
    except ExceptionGroup as group_err:
        raise group_err.exceptions[0] from None


def distillation_only(samples: list[Sample]) -> None:
    """opd_only: reward 0 for every sample, no reward call; the teacher's log-probs are the only signal (what
    slime's on_policy_distillation reward post-process returns)."""
    for sample in samples:
        sample.reward, sample.reward_scores, sample.reward_error = 0.0, {}, ""
