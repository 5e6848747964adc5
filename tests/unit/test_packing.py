"""Packed micro-batches (one row per micro-batch, THD): the row, its positions and cumulative lengths by hand; and
TorchBackend packed against padded on one process: log-probs, entropy, values, every loss and every gradient within
1e-5 in float32, on fixed and token-budget micro-batches."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from services.common.samples import Sample
from services.trainer.backends.fsdp.backend import TorchBackend
from services.trainer.batching import packing, varlen
from services.trainer.batching.batch import build_rollout_batch
from services.trainer.settings.train import TrainConfig
from services.trainer.step import rl_step
from tests.tiny_samples import samples_of

TOLERANCE = 1e-5


def _samples() -> list[Sample]:
    return [Sample(tokens=[5, 6, 7, 8, 9], response_length=2), Sample(tokens=[5, 6, 7], response_length=2),
            Sample(tokens=[4, 5], response_length=1)]


def test_a_micro_batch_packs_into_one_row_with_restarting_positions():
    batch = build_rollout_batch(_samples(), pad_token_id=0)
    row = packing.pack(batch)
    assert row.input_ids.tolist() == [[5, 6, 7, 8, 9, 5, 6, 7, 4, 5]]  # no padding
    assert row.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 0, 1]]
    assert row.cu_seqlens.tolist() == [0, 5, 8, 10] and row.cu_seqlens.dtype == torch.int32
    assert row.max_seqlen == 5 and row.num_tokens == 10


def test_response_index_points_at_the_logits_of_each_response_token():
    batch = build_rollout_batch(_samples(), pad_token_id=0)
    # padded [3, 5] flattened: sample 1's prompt has 1 token, so its response tokens come from positions 0, 1
    assert packing.response_index(batch, packed=False).tolist() == [[2, 3], [5, 6], [10, 11]]
    # packed: the sequences start at 0, 5 and 8
    assert packing.response_index(batch, packed=True).tolist() == [[2, 3], [5, 6], [8, 9]]
    logits = torch.arange(10.0).view(1, 10, 1)
    assert packing.gather_response(logits, batch)[..., 0].tolist() == [[2, 3], [5, 6], [8, 9]]
    assert packing.is_packed(logits, batch) and not packing.is_packed(torch.zeros(3, 5, 1), batch)


def test_a_micro_batch_is_packed_only_where_that_saves_tokens():
    def lengths(*totals: int):
        return build_rollout_batch([Sample(tokens=[5] * n, response_length=1) for n in totals], pad_token_id=0)

    assert not packing.worth_packing(lengths(6, 6, 6, 6))  # equal lengths: the rectangle holds no padding
    assert not packing.worth_packing(lengths(8, 7, 7, 8))  # 32 padded, 30 real: 7 % padding
    assert packing.worth_packing(lengths(16, 2, 3, 4, 2, 5))  # long-tailed: 96 padded, 32 real
    # the threshold: 4 × 10 = 40 padded over 32 real is 25 % padding, packed only above it (over 31 real)
    assert not packing.worth_packing(lengths(10, 10, 10, 2)) and packing.worth_packing(lengths(10, 10, 9, 2))
    assert packing.worth_packing(lengths(8, 7, 7, 8), min_padding=0.0)
    assert not packing.worth_packing(lengths(9), min_padding=0.0)  # one sample: nothing to save


def test_the_backend_packs_a_long_tailed_micro_batch_and_leaves_an_even_one_padded(tiny_model_dir):
    backend = TorchBackend(tiny_model_dir, TrainConfig(n_samples_per_prompt=2), num_threads=1)
    even = build_rollout_batch([Sample(tokens=[5, 6, 7, 8], response_length=2)] * 4, pad_token_id=0)
    tail = build_rollout_batch([Sample(tokens=[5] * 12, response_length=8)] + [Sample(tokens=[5, 6],
                                                                                       response_length=1)] * 3,
                               pad_token_id=0)
    assert not backend._packs(even) and "attention_mask" in backend._model_inputs(even, backend._packs(even))
    assert backend._packs(tail) and "cu_seq_lens_q" in backend._model_inputs(tail, backend._packs(tail))


@pytest.mark.parametrize("packed", [False, True])
def test_the_model_projects_the_response_positions_alone(tiny_model_dir, samples, packed):
    """Only the positions that predict a response token become logits (no prompt's, no padding's): the same rows
    as every position's logits gathered there, and the same log-probs and entropy on every response token."""
    backend = _backend(tiny_model_dir, packed)
    batch = build_rollout_batch(samples, pad_token_id=backend.pad_token_id)
    mb = batch.take(range(batch.size))
    valid = packing.response_valid(mb)
    assert backend._packs(mb) == packed
    with torch.no_grad():
        rows = backend._logits(backend.model, mb)
        full = backend._logits(backend.model, mb, response_only=False)
        stats = backend._token_stats(rows, mb)
        full_stats = rl_step.response_log_probs(full, mb, backend.config)
    assert tuple(full.shape[:2]) == ((1, sum(mb.total_lengths)) if packed else tuple(mb.tokens.shape))
    assert rows.shape == (sum(s.response_length for s in samples), full.shape[-1])
    torch.testing.assert_close(rows, packing.gather_response(full, mb)[valid], atol=1e-6, rtol=0)
    for mine, theirs in zip(stats, full_stats, strict=True):
        torch.testing.assert_close(mine[valid], theirs[valid], atol=1e-6, rtol=0)
        assert not mine[~valid].any()  # the padding columns hold zeros


def _backend(model_dir, packed: bool, **overrides) -> TorchBackend:
    """Packed: every micro-batch with any padding runs packed (the parity tests hold the packed path to the
    padded one wherever it could run)."""
    config = TrainConfig(**{"n_samples_per_prompt": 2, "lr": 1e-3, "clip_grad": 0.0, **overrides})
    return TorchBackend(model_dir, config, num_threads=1, pack_sequences=packed, min_padding_to_pack=0.0)


ROLLOUT = [("12+34=", "46", 1.0), ("12+34=", "5", 0.0), ("1+2=", "3", 0.0), ("1+2=", "40", 1.0),
           ("7+8=", "15", 1.0), ("7+8=", "", 0.0)]
CONFIGS = {  # each policy-loss term live; the critic; a user loss on the packed logits; a token budget
    "grpo": {"use_kl_loss": True, "kl_loss_coef": 0.1, "entropy_coef": 0.01, "use_tis": True, "micro_batch_size": 4},
    "ppo_dynamic": {"advantage_estimator": "ppo", "kl_coef": 0.05, "use_dynamic_batch_size": True,
                    "max_tokens_per_gpu": 20},
    "custom": {"loss_type": "custom_loss", "custom_loss_function_path": "tests.plugins.loss_fns.mean_nll",
               "micro_batch_size": 3},
}


@pytest.fixture
def samples(tiny_model_dir) -> list[Sample]:
    out = samples_of(tiny_model_dir, ROLLOUT)
    for sample in out:
        sample.rollout_log_probs = [-1.0] * sample.response_length
    out[0].loss_mask = [1, 0, 1]
    return out


def _token_stats(backend: TorchBackend, samples: list[Sample]) -> tuple[torch.Tensor, torch.Tensor]:
    batch = build_rollout_batch(samples, pad_token_id=backend.pad_token_id)
    mb = batch.take(range(batch.size))
    with torch.no_grad():
        return backend._token_stats(backend._logits(backend.model, mb), mb)


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_packed_trains_as_padded(tiny_model_dir, samples, name):
    padded, packed = (_backend(tiny_model_dir, flag, **CONFIGS[name]) for flag in (False, True))
    lengths = torch.tensor([s.response_length for s in samples])
    valid = torch.arange(int(lengths.max())) < lengths.unsqueeze(-1)  # every response column of every sample
    (lp_pad, ent_pad), (lp_pack, ent_pack) = _token_stats(padded, samples), _token_stats(packed, samples)
    torch.testing.assert_close(lp_pack[valid], lp_pad[valid], atol=TOLERANCE, rtol=0)
    torch.testing.assert_close(ent_pack[valid], ent_pad[valid], atol=TOLERANCE, rtol=0)
    if padded.critic is not None:
        batch = build_rollout_batch(samples, pad_token_id=padded.pad_token_id)
        with torch.no_grad():
            values = [b._values(batch) for b in (padded, packed)]
        torch.testing.assert_close(values[1][valid], values[0][valid], atol=TOLERANCE, rtol=0)
    (want,), (got,) = padded.train_rollout(samples), packed.train_rollout(samples)
    assert got.keys() == want.keys()
    for key, value in want.items():
        if not key.startswith("perf/"):
            assert got[key] == pytest.approx(value, abs=TOLERANCE), key
    models = [(padded.model, packed.model)] + ([(padded.critic.model, packed.critic.model)] if padded.critic else [])
    for want_model, got_model in models:
        want_grads, got_grads = _grads(want_model), _grads(got_model)
        assert got_grads.keys() == want_grads.keys() and want_grads
        for param, grad in want_grads.items():
            torch.testing.assert_close(got_grads[param], grad, atol=TOLERANCE, rtol=0, msg=param)


def test_an_empty_micro_batch_adds_nothing(tiny_model_dir, samples):
    """Over several ranks a rank short of samples runs a zero-weighted forward: its step equals the one without."""
    backends = [_backend(tiny_model_dir, True) for _ in range(2)]
    batch = build_rollout_batch(samples, pad_token_id=backends[0].pad_token_id).with_advantages(
        torch.ones(len(samples), max(s.response_length for s in samples)))

    metrics = [b._train_step(b.model, b.optimizer, batch, schedule, b._actor_loss)
               for b, schedule in zip(backends, ([[0, 1, 2], [3, 4, 5]], [[0, 1, 2], [], [3, 4, 5]]), strict=True)]
    assert metrics[1]["loss"] == pytest.approx(metrics[0]["loss"], abs=1e-7)
    for param, grad in _grads(backends[0].model).items():
        torch.testing.assert_close(_grads(backends[1].model)[param], grad, atol=1e-7, rtol=0, msg=param)


FLASH_CALLS: list[int] = []


def _flash_stand_in(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, return_aux=None, scale=None,
                    window_size=(-1, -1)):
    """torch 2.11's varlen_attn signature (no enable_gqa), computed one sequence at a time on the CPU."""
    FLASH_CALLS.append(query.shape[0])
    assert cu_seq_q.dtype == torch.int32 and window_size == (-1, 0) and key.shape[1] == query.shape[1]
    lengths = (cu_seq_q[1:] - cu_seq_q[:-1]).tolist()
    return torch.cat([F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                                     is_causal=True, scale=scale).transpose(0, 1)
                      for q, k, v in zip(query.split(lengths), key.split(lengths), value.split(lengths), strict=True)])


@pytest.fixture
def flash_stand_in(monkeypatch):
    """Route packed rows as on a GPU in half precision (varlen flash attention), to a CPU stand-in."""
    monkeypatch.setattr(varlen, "flash_applies", lambda query, dropout_p=0.0: True)
    monkeypatch.setattr(varlen, "_flash_varlen", lambda: _flash_stand_in)


def test_varlen_attention_keeps_each_sequence_to_itself(monkeypatch):
    gen = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(9, heads, 4, generator=gen) for heads in (4, 2, 2))
    cu_seqlens = torch.tensor([0, 2, 7, 9], dtype=torch.long)
    mask = varlen.block_causal_mask(cu_seqlens, 9)
    assert mask[2:7, :8].int().tolist() == [
        [0, 0, 1, 0, 0, 0, 0, 0], [0, 0, 1, 1, 0, 0, 0, 0], [0, 0, 1, 1, 1, 0, 0, 0], [0, 0, 1, 1, 1, 1, 0, 0],
        [0, 0, 1, 1, 1, 1, 1, 0]]  # the second sequence sees only itself, causally
    # the whole row under the mask (CUDA without flash) = one call per sequence (CPU) = varlen flash (stand-in)
    want = F.scaled_dot_product_attention(*(t.transpose(0, 1)[None] for t in (query, key, value)), attn_mask=mask,
                                          enable_gqa=True)[0].transpose(0, 1)
    torch.testing.assert_close(varlen.varlen_causal_attention(query, key, value, cu_seqlens, 5), want, atol=1e-6,
                               rtol=0)
    monkeypatch.setattr(varlen, "flash_applies", lambda query, dropout_p=0.0: True)
    monkeypatch.setattr(varlen, "_flash_varlen", lambda: _flash_stand_in)
    FLASH_CALLS.clear()
    flash = varlen.varlen_causal_attention(query, key, value, cu_seqlens, 5)  # GQA heads repeated for torch 2.11
    assert FLASH_CALLS == [9]
    torch.testing.assert_close(flash, want, atol=1e-6, rtol=0)


def test_packed_rows_reach_varlen_flash_through_hf(tiny_model_dir, samples, flash_stand_in):
    """The GPU path's plumbing on the CPU: HF passes the cumulative lengths to the attention function, whose
    output layout the model reads back; the step equals the padded one."""
    FLASH_CALLS.clear()
    test_packed_trains_as_padded(tiny_model_dir, samples, "grpo")
    assert FLASH_CALLS and sum(len(s.tokens) for s in samples) in FLASH_CALLS  # a whole micro-batch in one row


def test_hf_builds_no_mask_for_a_packed_rows_full_attention(tiny_model_dir):
    """Under `packed_row` the attention function keeps the sequences apart by their cumulative lengths, so the
    [T, T] block mask HF would build from the restarting positions is skipped; outside it HF builds that mask, and a
    sliding window's mask is built in either case (its layers run HF's sdpa under it)."""
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    model = _backend(tiny_model_dir, True).model
    assert varlen.active(model)
    positions = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2]])
    embeds = torch.zeros(1, 8, model.config.hidden_size)

    def mask(make=create_causal_mask, config=model.config):
        return make(config=config, inputs_embeds=embeds, attention_mask=None, cache=None, position_ids=positions)

    block = varlen.block_causal_mask(torch.tensor([0, 5, 8]), 8)
    assert torch.equal(mask()[0, 0], block)
    windowed = copy.copy(model.config)
    windowed.sliding_window = 2
    with varlen.packed_row():
        assert mask() is None
        window = mask(create_sliding_window_causal_mask, windowed)[0, 0]
    assert torch.equal(window, block & torch.ones(8, 8, dtype=torch.bool).triu(-1))  # a key at most 1 back
    assert torch.equal(mask()[0, 0], block)  # the context ends with the forward


def test_a_packed_row_that_would_reach_sdpa_without_a_mask_is_refused():
    """A packed row without its cumulative lengths would go to HF's sdpa, which with no mask attends across the
    row's sequences: refused with the reason, not computed."""
    query = key = value = torch.zeros(1, 2, 4, 8)
    module = torch.nn.Module()
    with varlen.packed_row(), pytest.raises(RuntimeError, match="packed row reached sdpa without a mask"):
        varlen.hf_attention(module, query, key, value, None)
    out, _ = varlen.hf_attention(module, query, key, value, None)  # outside: a causal sdpa over one sequence
    assert out.shape == (1, 4, 2, 8)


def test_a_compiled_layers_unmasked_sdpa_call_compiles_whole():
    """The check above reads a ContextVar, which torch.compile cannot trace: a compiled decoder layer (compile_layers)
    skips it rather than breaking its graph there."""
    query, key, value = (torch.randn(1, 2, 4, 8, generator=torch.Generator().manual_seed(n)) for n in range(3))
    module = torch.nn.Module()
    torch._dynamo.reset()
    compiled = torch.compile(varlen.hf_attention, backend="eager", fullgraph=True)  # fullgraph: a break raises
    torch.testing.assert_close(compiled(module, query, key, value, None)[0],
                               varlen.hf_attention(module, query, key, value, None)[0], atol=1e-6, rtol=0)


def test_a_model_without_attention_functions_stays_padded(tiny_model_dir, monkeypatch, caplog):
    """Packing relies on the model's attention keeping sequences apart: one that cannot take `varlen`'s attention
    function (a model outside transformers' AttentionInterface) trains on padded micro-batches."""
    assert _backend(tiny_model_dir, True).pack_sequences
    monkeypatch.setattr(varlen, "use_in", lambda model: None)
    with caplog.at_level("WARNING"):
        assert not _backend(tiny_model_dir, True).pack_sequences
    assert "micro-batches stay padded" in caplog.text


def test_a_model_with_token_mixing_layers_outside_attention_stays_padded():
    """Qwen3.5's gated-delta-net layers run over the whole row, so its sequences would meet there: not packable, as
    a model whose layers are all full attention is; a multimodal config's text_config decides."""
    import types

    def model(layer_types, nested=False):
        config = types.SimpleNamespace(_attn_implementation=varlen.HF_ATTENTION, layer_types=layer_types)
        if nested:
            config = types.SimpleNamespace(_attn_implementation=varlen.HF_ATTENTION, text_config=config)
        return types.SimpleNamespace(config=config)

    assert varlen.packable(model(["full_attention", "full_attention"]))
    assert varlen.packable(model(None))  # no layer_types (llama): attention only
    assert not varlen.packable(model(["linear_attention", "full_attention"]))
    assert not varlen.packable(model(["linear_attention", "full_attention"], nested=True))
