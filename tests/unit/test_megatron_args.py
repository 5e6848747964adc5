"""The job spec's `megatron:` section: Megatron's config fields pass through to the configs the backend builds."""

from __future__ import annotations

import pytest
import torch

from services.common.errors import InvalidArgument
from services.trainer.backends.megatron import args, model
from services.trainer.models.arch import ModelArch
from services.trainer.settings.train import TrainConfig

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # megatron-core: no TE/Apex on CPU

ARCH = ModelArch.from_hf_config({"model_type": "qwen3", "vocab_size": 300, "hidden_size": 64, "intermediate_size": 96,
                                 "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                                 "head_dim": 24, "max_position_embeddings": 64, "rms_norm_eps": 1e-6})


def test_keys_go_to_the_config_classes_that_have_them():
    split = args.split({"attention_dropout": 0.1, "recompute_granularity": "full", "recompute_method": "uniform",
                        "recompute_num_layers": 1, "optimizer": "sgd", "sgd_momentum": 0.5,
                        "overlap_grad_reduce": True, "bucket_size": 4096, "overlap_param_gather": False})
    assert split.transformer == {"attention_dropout": 0.1, "recompute_granularity": "full",
                                 "recompute_method": "uniform", "recompute_num_layers": 1}
    # overlap_param_gather is a field of both OptimizerConfig and DistributedDataParallelConfig: it goes to both
    assert split.optimizer == {"optimizer": "sgd", "sgd_momentum": 0.5, "overlap_param_gather": False}
    assert split.ddp == {"overlap_grad_reduce": True, "bucket_size": 4096, "overlap_param_gather": False}
    assert split.dropout and not args.split({"hidden_dropout": 0.0}).dropout and not args.split(None).dropout


def test_configs_are_built_with_the_overrides():
    split = args.split({"attention_dropout": 0.25, "recompute_granularity": "selective", "optimizer": "sgd",
                        "grad_reduce_in_fp32": False})
    config = model.transformer_config(ARCH, tp_size=1, pp_size=1, overrides=split.transformer)
    assert (config.attention_dropout, config.recompute_granularity) == (0.25, "selective")
    assert (config.hidden_dropout, config.num_layers, config.kv_channels) == (0.0, 2, 24)  # the rest as before
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig

    optimizer = args.build(OptimizerConfig, "OptimizerConfig", {"lr": 1e-3, "params_dtype": torch.float32},
                           split.optimizer)
    assert (optimizer.optimizer, optimizer.lr) == ("sgd", 1e-3)
    ddp = args.build(DistributedDataParallelConfig, "DistributedDataParallelConfig", {"grad_reduce_in_fp32": True},
                     split.ddp)
    assert ddp.grad_reduce_in_fp32 is False


@pytest.mark.parametrize(("section", "message"), [
    ({"attention_dropuot": 0.1}, r"megatron.attention_dropuot: not a field of megatron-core's TransformerConfig"),
    ({"hidden_size": 128}, r"megatron.hidden_size: is read from hf_checkpoint's config.json"),
    ({"tensor_model_parallel_size": 2}, r"megatron.tensor_model_parallel_size: is the job spec's own key"),
    ({"lr": 1e-3}, r"megatron.lr: is the job spec's own key: set `lr` at the top level"),
    ({"bf16": True}, r"megatron.bf16: is set from the job spec.s .bf16."),
    ({"fp8": "e4m3"}, r"megatron.fp8: FP8/FP4 training is not supported: the backends train in bf16 or float32"),
    ({"hidden_dropout": "0.1"}, r"megatron.hidden_dropout: expected float \(default 0.1\), got '0.1'"),
    ({"recompute_num_layers": 1.5}, None),  # default None: Megatron's own check decides (below)
    ({"overlap_grad_reduce": 1}, r"megatron.overlap_grad_reduce: expected bool"),
])
def test_bad_keys_and_values_are_refused_naming_the_key(section, message):
    if message is None:
        args.split(section)
        return
    with pytest.raises(InvalidArgument, match=message):
        args.split(section)


def test_megatron_refusals_name_the_section_keys():
    with pytest.raises(InvalidArgument, match=r"megatron.recompute_granularity: megatron-core's TransformerConfig "
                                              r"refused them: .*recompute_method must be"):
        model.transformer_config(ARCH, tp_size=1, pp_size=1,
                                 overrides=args.split({"recompute_granularity": "full"}).transformer)


def test_the_backend_checks_the_section_before_joining_any_process_group():
    from services.trainer.backends.megatron.backend import MegatronBackend

    with pytest.raises(InvalidArgument, match="megatron.num_layers"):
        MegatronBackend("/nonexistent", TrainConfig(), megatron_args={"num_layers": 4})


def test_make_vocab_size_divisible_by_sets_the_padded_vocab_as_megatron_lm_does():
    split = args.split({"make_vocab_size_divisible_by": 64})
    assert (split.model, split.transformer, split.vocab_size_divisible_by) == (
        {"make_vocab_size_divisible_by": 64}, {}, 64)
    assert args.split(None).vocab_size_divisible_by == 128
    import dataclasses

    # vocab 300: the next multiple of 128 × TP 2 is 512, of 64 × TP 2 is 384
    assert ARCH.padded_vocab_size(2) == 512
    assert dataclasses.replace(ARCH, vocab_size_divisible_by=64).padded_vocab_size(2) == 384
    for bad in (0, "64", 6.4):
        with pytest.raises(InvalidArgument, match="megatron.make_vocab_size_divisible_by: expected"):
            args.split({"make_vocab_size_divisible_by": bad})


FIRST_SUBMITS = """
import threading
from services.trainer.backends.megatron import args

start, errors = threading.Barrier(6), []

def submit(optimizer_first):
    start.wait()
    try:  # the two checks import megatron-core's modules in different orders
        if optimizer_first:
            args.check_optimizer({}, use_distributed_optimizer=True)
        args.split({"attention_dropout": 0.1})
        args.check_optimizer({}, use_distributed_optimizer=True)
    except Exception as err:  # the failure this guards against is an ImportError mid-import
        errors.append(repr(err))

threads = [threading.Thread(target=submit, args=(i % 2 == 0,)) for i in range(6)]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
print(errors)
"""


def test_concurrent_first_submits_each_see_megatron_core_whole():
    """The job API checks specs in worker threads; the first ones to arrive import megatron-core together (a fresh
    interpreter, so nothing is imported yet)."""
    import os
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", FIRST_SUBMITS], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"
