"""The generate plumbing: multi-turn token bookkeeping, replies to samples, the router helper (retries, session
routing key, abort), plugin arguments and the checks on what a generate function returns."""

from __future__ import annotations

import asyncio
import json
import types

import httpx
import pytest

from services.common.errors import FailedPrecondition, InvalidArgument, Unavailable
from services.common.plugin_sample import PluginSample as RolloutSample
from services.common.samples import Sample, Status
from services.rollout.engine_calls import generate as gen
from services.rollout.engine_calls.generate import GenerateContext
from services.rollout.engine_calls.router_http import HttpxPoster
from tests.unit.rollout_fakes import reply


def test_append_response_tokens_masks_tool_tokens_and_records_versions_per_segment():
    """slime's signature: append_response_tokens(args, *, tokens, log_probs, trainable, meta_info, text, ...)."""
    sample = RolloutSample(tokens=[1, 2, 3])
    sample.append_response_tokens(None, tokens=[7, 8], log_probs=[-0.5, -1.5], text="ab",
                                  meta_info={"weight_version": "3", "finish_reason": {"type": "stop"}})
    assert sample.status == Status.COMPLETED
    sample.append_response_tokens(None, tokens=[9, 9, 9], trainable=False, text="<t>")
    sample.append_response_tokens(None, tokens=[4], log_probs=[-0.25], text="c", update_terminal_info=False,
                                  meta_info={"weight_version": "4", "finish_reason": {"type": "length"}})
    assert sample.tokens == [1, 2, 3, 7, 8, 9, 9, 9, 4] and sample.response_length == 6 and sample.prompt_length == 3
    assert sample.loss_mask == [1, 1, 0, 0, 0, 1]
    assert sample.rollout_log_probs == [-0.5, -1.5, 0.0, 0.0, 0.0, -0.25]
    assert sample.response == "ab<t>c" and sample.weight_versions == ["3", "4"] and sample.status == Status.COMPLETED
    for kwargs, message in (({"tokens": [1, 2], "log_probs": [-0.1]}, "1 log_probs for 2 tokens"),
                            ({"tokens": [1]}, "trainable tokens need their log_probs"),
                            ({"tokens": [1], "log_probs": [-1.0], "trainable": False}, "take no log_probs")):
        with pytest.raises(InvalidArgument, match=message):
            sample.append_response_tokens(None, **kwargs)
    assert RolloutSample.Status is Status and sample.Status.TRUNCATED is Status.TRUNCATED


def test_append_reply_takes_tokens_from_output_token_logprobs_and_status_from_finish_reason():
    sample = RolloutSample(tokens=[1])
    for finish, status in (("length", Status.TRUNCATED), ("abort", Status.ABORTED), ("stop", Status.COMPLETED)):
        assert gen.append_reply(sample, reply([5, 6], "xy", finish=finish, weight_version="v2")) == finish
        assert sample.status == status
    assert sample.tokens == [1, 5, 6, 5, 6, 5, 6] and sample.rollout_log_probs == [-0.5, -1.5] * 3
    assert sample.weight_versions == ["v2"] * 3 and sample.response == "xy" * 3
    bad = reply([5, 6], "xy")
    bad["output_ids"] = [5, 7]
    with pytest.raises(FailedPrecondition, match="differ"):
        gen.append_reply(sample, bad)
    with pytest.raises(FailedPrecondition, match="output_token_logprobs"):
        gen.append_reply(sample, {"text": "", "meta_info": {"finish_reason": {"type": "stop"}}})


def context(handler, **overrides) -> GenerateContext:
    http = HttpxPoster(httpx.AsyncClient(transport=httpx.MockTransport(handler)))
    return GenerateContext(**{"http": http, "router_url": "http://router", "name": "rollout 0 of job j",
                              "rid_prefix": "j-0", "retry_delay_s": 0.0, "max_attempts": 3, **overrides})


async def call(ctx: GenerateContext, sample: Sample, payload: dict | None = None) -> dict:
    gen.use_context(ctx)
    try:
        return await gen.router_generate(sample, payload or {"input_ids": [1], "sampling_params": {}})
    finally:
        await ctx.http.aclose()


def test_router_generate_sets_rids_and_the_routing_key_only_under_sticky_policies():
    seen = []

    def handler(request):
        seen.append((json.loads(request.content), request.headers))
        return httpx.Response(200, json=reply([3], "a"))

    sample = RolloutSample(group_index=4, index=1, session_id="s-1")
    asyncio.run(call(context(handler, sticky_routing=True), sample, {"input_ids": [1], "rid": "mine"}))
    asyncio.run(call(context(handler, sticky_routing=False), sample))
    (body, headers), (_, plain_headers) = seen
    assert headers["X-SMG-Routing-Key"] == "s-1" and "X-SMG-Routing-Key" not in plain_headers
    assert body["rid"].startswith("j-0-4-1-") and body["input_ids"] == [1]


def test_router_generate_retries_engine_aborts_and_5xx_then_gives_up():
    answers = [httpx.Response(503, text="no workers"), httpx.Response(200, json=reply([3], "a", finish="abort")),
               httpx.Response(200, json=reply([3], "a"))]
    asyncio.run(call(context(lambda request: answers.pop(0)), RolloutSample()))
    assert not answers  # 503, an abort it did not ask for, then the answer
    with pytest.raises(Unavailable, match="failed 3 times; last: _RetryableError: HTTP 502"):
        asyncio.run(call(context(lambda request: httpx.Response(502, text="bad gateway")), RolloutSample()))
    with pytest.raises(InvalidArgument, match="rejected /generate: HTTP 400"):
        asyncio.run(call(context(lambda request: httpx.Response(400, text="bad")), RolloutSample()))


def test_router_generate_returns_aborts_once_the_rollout_is_aborting():
    calls = []
    ctx = context(lambda request: calls.append(1) or httpx.Response(200, json=reply([3, 4], "ab", finish="abort")))

    ctx.aborting = True
    unsent = asyncio.run(call(ctx, RolloutSample()))
    assert not calls and unsent["meta_info"]["finish_reason"]["type"] == "abort" and unsent["output_ids"] == []

    def abort_after_send(request):  # the manager aborts while the request is at the engine
        ctx2.aborting = True
        return httpx.Response(200, json=reply([3, 4], "ab", finish="abort"))

    ctx2 = context(abort_after_send)
    partial = asyncio.run(call(ctx2, RolloutSample()))
    assert partial["output_ids"] == [3, 4]  # the partial output, not retried
    with pytest.raises(FailedPrecondition, match="outside a rollout"):
        asyncio.run(gen.router_generate(RolloutSample(), {}))


def test_default_generate_continues_a_partial_sample_with_the_budget_left():
    bodies = []

    def handler(request):
        bodies.append(json.loads(request.content))
        return httpx.Response(200, json=reply([9, 9], "zz", finish="length", weight_version="v2"))

    sample = RolloutSample(tokens=[1, 2, 7, 8], response_length=2, loss_mask=[0, 0], rollout_log_probs=[-1, -2],
                           weight_versions=["v1"], status=Status.ABORTED)
    ctx = context(handler)

    async def run():
        gen.use_context(ctx)
        params = gen.sampling_params(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=4, stop=[],
                                     stop_token_ids=[])
        out = await gen.generate(None, sample, params)
        full = RolloutSample(tokens=[1], response_length=4, loss_mask=[1] * 4, rollout_log_probs=[0.0] * 4)
        await gen.generate(None, full, params)
        return out, full

    out, full = asyncio.run(run())
    (body,) = bodies  # the full sample made no request
    assert body["input_ids"] == [1, 2, 7, 8] and body["sampling_params"]["max_new_tokens"] == 2
    assert body["sampling_params"]["top_k"] == -1 and body["return_logprob"] is True
    assert out.tokens == [1, 2, 7, 8, 9, 9] and out.loss_mask == [0, 0, 1, 1] and out.weight_versions == ["v1", "v2"]
    assert out.status == Status.TRUNCATED and full.status == Status.TRUNCATED


def test_routed_experts_are_asked_for_under_r3_and_decoded_in_sglangs_layout():
    import array
    import base64

    assert gen.routed_experts_option(types.SimpleNamespace(use_rollout_routing_replay=True)) == {
        "return_routed_experts": True}
    assert gen.routed_experts_option(types.SimpleNamespace()) == {} == gen.routed_experts_option(None)
    # 3 prompt + 2 response tokens: 4 rows (the last token is never fed) × 2 layers × top-2
    experts = list(range(16))
    meta_reply = reply([5, 6], "xy")
    meta_reply["meta_info"]["routed_experts"] = base64.b64encode(array.array("i", experts).tobytes()).decode()
    sample = RolloutSample(tokens=[1, 2, 3])
    gen.append_reply(sample, meta_reply)
    assert sample.rollout_routed_experts == experts
    # a later turn's reply starts at token 2: the first 2 rows stay, the rest is the reply's
    sample.tokens.append(7)
    meta_reply = reply([8], "z")
    meta_reply["meta_info"].update(routed_experts=base64.b64encode(array.array("i", [9] * 16).tobytes()).decode(),
                                   routed_experts_start_len=2)
    gen.append_reply(sample, meta_reply)
    assert sample.rollout_routed_experts == experts[:8] + [9] * 16
    meta_reply["meta_info"]["routed_experts"] = base64.b64encode(array.array("i", [1] * 7).tobytes()).decode()
    with pytest.raises(FailedPrecondition, match="routed_experts has 7 entries, not a multiple of its 5"):
        gen.append_reply(sample, meta_reply)


def test_plugin_args_are_the_job_spec_plus_the_router_address():
    args = gen.plugin_args({"rollout_max_response_len": 8, "hf_checkpoint": "/m"}, "http://10.0.0.5:30000")
    assert (args.rollout_max_response_len, args.hf_checkpoint) == (8, "/m")
    assert (args.sglang_router_ip, args.sglang_router_port) == ("10.0.0.5", 30000)


def test_run_generate_passes_evaluation_and_checks_the_result():
    async def takes_evaluation(args, sample, sampling_params, evaluation=False):
        sample.metadata["evaluation"] = evaluation
        sample.append_response_tokens(args, tokens=[1], log_probs=[-0.1])
        return sample

    async def returns(value):
        async def fn(args, sample, sampling_params):
            return value
        return fn

    async def run():
        [ok] = await gen.run_generate(takes_evaluation, None, RolloutSample(tokens=[1]), {}, evaluation=True,
                                      what="w")
        assert ok.metadata["evaluation"] is True and ok.status == Status.COMPLETED  # PENDING -> COMPLETED
        for value, message in (([], "returned an empty list"), ("x", "returned str"),
                               (Sample(tokens=[1, 2], response_length=1), "response_length 1 with 0 loss_mask")):
            with pytest.raises(InvalidArgument, match=message):
                await gen.run_generate(await returns(value), None, RolloutSample(), {}, evaluation=False, what="w")

    asyncio.run(run())


def test_run_generate_takes_slimes_docs_function_a_list_and_none_log_probs():
    """slime's docs' generate sets tokens, response and response_length only: loss_mask becomes all ones,
    rollout_log_probs none (refused when the job trains on them); a list of samples joins the group."""
    async def docs_style(args, sample, sampling_params):
        sample.tokens, sample.response, sample.response_length = sample.tokens + [5, 6], "ab", 2
        return sample

    async def fan_out(args, sample, sampling_params):
        first = RolloutSample(tokens=[1, 5], response_length=1, loss_mask=[1], rollout_log_probs=[-0.5])
        second = RolloutSample(tokens=[1, 6], response_length=1, rollout_id=7)
        return [first, second]

    async def run():
        sample = RolloutSample(tokens=[1], group_index=3, index=1)
        [out] = await gen.run_generate(docs_style, types.SimpleNamespace(), sample, {}, evaluation=False, what="w")
        assert (out.loss_mask, out.rollout_log_probs, out.status) == ([1, 1], [], Status.COMPLETED)
        with pytest.raises(InvalidArgument, match="left rollout_log_probs None, but use_tis trains on"):
            await gen.run_generate(docs_style, types.SimpleNamespace(use_tis=True), RolloutSample(tokens=[1]), {},
                                   evaluation=False, what="w")
        outs = await gen.run_generate(fan_out, None, RolloutSample(tokens=[1], group_index=3, index=1), {},
                                      evaluation=False, what="w")
        assert [(o.group_index, o.index, o.rollout_id, o.loss_mask) for o in outs] == [(3, 1, None, [1]),
                                                                                       (3, 1, 7, [1])]

    asyncio.run(run())


def test_load_generate_function_checks_the_signature():
    assert gen.load_generate_function("") is gen.generate
    from tests.plugins.rollout_fns import model_tool_model

    assert gen.load_generate_function("tests.plugins.rollout_fns.model_tool_model") is model_tool_model
    with pytest.raises(InvalidArgument, match="custom_generate_function_path: .* must be an async function"):
        gen.load_generate_function("tests.plugins.rollout_fns.keep_even_prompts")


def test_attributes_a_generate_function_sets_reach_the_reward_function():
    from services.common.plugin_sample import PluginSample
    from services.common.samples import sample_from_proto, sample_to_proto

    async def counts_tools(args, sample, sampling_params):
        sample.append_response_tokens(args, tokens=[5], log_probs=[-0.1])
        sample.tool_call_count, sample.payload_text, sample.unsendable = 2, "text", object()
        return sample

    [out] = asyncio.run(gen.run_generate(counts_tools, None, RolloutSample(tokens=[1]), {}, evaluation=False,
                                         what="w"))
    at_reward = PluginSample.from_record(sample_from_proto(sample_to_proto(out)))  # as the reward service sees it
    assert (at_reward.tool_call_count, at_reward.payload_text) == (2, "text")
    assert not hasattr(at_reward, "unsendable") and "slime_sample_attrs" not in at_reward.metadata
