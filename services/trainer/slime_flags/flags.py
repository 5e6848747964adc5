"""Every flag of slime's own argument parser, with slime's default and what Physarum does with it.

- implemented: a job-spec key of the same name with slime's meaning (the spec holds it; `implemented()` lists them);
- mapped: accepted and turned into Physarum's setting (`to`: spec keys it sets, by a converter in args.py),
  or accepted and kept for plugins while Physarum's deployment does that job (`warn`: the conversion says so);
- refused: a submit with it fails, saying why and what to do instead.
Megatron's flags (the model, layout and optimizer flags slime forwards to Megatron) are in megatron_flags.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

Status = Literal["implemented", "mapped", "refused"]


@dataclass(frozen=True)
class Flag:
    status: Status
    default: Any  # slime's default (what plugins see in `args` when the flag is not given; JSON_FLAGS' parsed)
    note: str = ""  # mapped: the Physarum setting that does the job; refused: why, and what to do instead
    warn: bool = False  # mapped onto the deployment: the conversion reports it
    nargs: bool = False  # takes several values
    bare: bool = False  # a flag without a value (store_true / store_false)


def I(default: Any = None, *, nargs: bool = False, bare: bool = False) -> Flag:  # noqa: E743 - a table's shorthand
    return Flag("implemented", default, nargs=nargs, bare=bare)


def M(default: Any, note: str, *, warn: bool = False, nargs: bool = False, bare: bool = False) -> Flag:
    return Flag("mapped", default, note, warn=warn, nargs=nargs, bare=bare)


def R(default: Any, note: str, *, nargs: bool = False, bare: bool = False) -> Flag:
    return Flag("refused", default, note, nargs=nargs, bare=bare)


# slime's flags of type=json.loads: argparse parses a string default with the type too, so args hold the object
JSON_FLAGS = ("apply-chat-template-kwargs", "train-env-vars")
_RAY = "Physarum has no Ray cluster: "
_PLACE = ("Physarum runs the trainer and the engines as separate services; their GPUs come from the deployment "
          "(Helm values trainer.* / engine.*, locally `physarum up`); kept in args for plugins")
_POOL = ("the engine pool is the rollout service's (Helm engine.replicas, `physarum scale`); kept in args for "
         "plugins")
_MEGATRON_HOOK = "Physarum's trainer does not run slime's Megatron actor, so its hooks have no place to run; "
_DEBUG = "a slime developer's diagnostic with no counterpart here; "
_WANDB = "W&B logging (see use_wandb)"

FLAGS: dict[str, Flag] = {
    # cluster and placement
    "actor-num-nodes": M(1, _PLACE, warn=True),
    "actor-num-gpus-per-node": M(8, _PLACE, warn=True),
    "rollout-num-gpus": M(None, _POOL, warn=True),
    "rollout-num-gpus-per-engine": M(1, "each engine's tensor parallelism: the rollout service's engine option "
                                        "sglang_tp_size (Helm engine.gpus); kept in args for plugins", warn=True),
    "num-gpus-per-node": M(8, _PLACE, warn=True),
    "colocate": M(False, _PLACE + "; there is nothing to colocate or offload", warn=True, bare=True),
    "offload": M(False, _PLACE + "; there is nothing to offload", warn=True, bare=True),
    "offload-train": M(None, _PLACE + "; there is nothing to offload", warn=True, bare=True),
    "offload-rollout": M(None, _PLACE + "; there is nothing to offload", warn=True, bare=True),
    "distributed-backend": M("nccl", "torch.distributed uses NCCL on GPUs and gloo on CPU by itself", warn=True),
    "distributed-timeout-minutes": M(10, "the trainer's collectives time out on its own settings", warn=True),
    "train-env-vars": R("{}", "set environment variables on the trainer's deployment (Helm trainer.env)"),
    "use-fault-tolerance": R(False, "engines are health-checked and replaced by the rollout service always; "
                                    "drop the flag", bare=True),
    "rollout-health-check-first-wait": M(0, "the rollout service's engine health checks (its settings)", warn=True),
    "rollout-health-check-interval": M(30.0, "the rollout service's engine health checks (its settings)", warn=True),
    "rollout-health-check-timeout": M(30.0, "the rollout service's engine health checks (its settings)", warn=True),
    "rollout-external-engine-addrs": R(None, "start the rollout service with --engine-urls "
                                             "(PHYSARUM_ROLLOUT_ENGINE_URLS) naming the running servers instead",
                                       nargs=True),
    "use-distributed-post": R(False, _RAY + "generation requests go through the rollout service's router", bare=True),
    "http-proxy": R(None, "set HTTP(S)_PROXY on the rollout service's deployment"),
    "sglang-router-ip": M(None, "the router is the rollout service's; plugins get its address in args", warn=True),
    "sglang-router-port": M(None, "the router is the rollout service's; plugins get its address in args", warn=True),
    "sglang-router-request-timeout-secs": M(14400, "the rollout service's request timeout", warn=True),
    "sglang-server-concurrency": M(512, "kept in args for plugins (GenerateState's semaphore)"),
    # training backend and model
    "train-backend": I("megatron"),
    "qwen-gdn-backend": M("fla", "the megatron backend's gated delta-nets (Qwen3-Next, Qwen3.5) run fla's chunked scan "
                                 "on CUDA where fla is installed, megatron-core's PyTorch scan elsewhere"),
    "hf-checkpoint": I(),
    "model-name": M(None, "the model is read from hf_checkpoint's config.json; kept in args for plugins"),
    "padded-vocab-size": M(None, "the megatron backend pads the vocabulary itself (a multiple of 128 × TP)",
                           warn=True),
    "custom-model-provider-path": R(None, _MEGATRON_HOOK + "the backend builds the model from the HF config"),
    "custom-megatron-init-path": R(None, _MEGATRON_HOOK + "use a custom_loss_function_path instead"),
    "custom-megatron-before-log-prob-hook-path": R(None, _MEGATRON_HOOK + "use a custom_loss_function_path"),
    "custom-megatron-before-train-step-hook-path": R(None, _MEGATRON_HOOK + "use a custom_loss_function_path"),
    "megatron-config-path": R(None, "role-specific Megatron configs: put Megatron settings in the spec's "
                                    "`megatron:` section"),
    "megatron-deepgemm-forward-layers": R(None, "DeepGEMM FP8 kernels are not used by the backends", nargs=True),
    "megatron-deepgemm-forward-modules": R(None, "DeepGEMM FP8 kernels are not used by the backends", nargs=True),
    "megatron-deepgemm-moe-forward-layers": R(None, "DeepGEMM FP8 kernels are not used by the backends", nargs=True),
    "megatron-deepgemm-moe-forward-modules": R(None, "DeepGEMM FP8 kernels are not used by the backends", nargs=True),
    "enable-mtp-training": I(False, bare=True),
    "mtp-num-layers": I(),
    "mtp-loss-scaling-factor": I(0.2),
    "freeze-indexer": R(False, "DeepSeek's sparse-attention indexer: DeepSeek models are not supported", bare=True),
    "freeze-params-name-list": R(None, "freezing parameters is not implemented", nargs=True),
    "only-train-params-name-list": R(None, "freezing parameters is not implemented", nargs=True),
    "use-routing-replay": I(False, bare=True),
    "use-rollout-routing-replay": I(False, bare=True),
    "allgather-cp": R(False, "slime's all-gather CP layout is not implemented; context_parallel_size splits "
                             "sequences in Megatron's load-balanced chunks", bare=True),
    "use-stateless-adam": R(False, "the optimizer is Adam(W) (torch or megatron-core's)", bare=True),
    "recompute-loss-function": M(False, "the backends manage their activation memory (megatron: "
                                        "megatron.recompute_granularity)", warn=True, bare=True),
    "log-probs-chunk-size": I(-1),
    "log-probs-max-tokens-per-gpu": M(None, "the backends use max_tokens_per_gpu for log-probs too", warn=True),
    "data-pad-size-multiplier": M(128, "the backends pad batches themselves", warn=True),
    "balance-data": M(False, "micro-batches are always dealt to the data-parallel ranks by tokens, as many to "
                             "each", warn=True, bare=True),
    "balance-by-flops": M(False, "as balance_data", warn=True, bare=True),
    # checkpoints
    "load": I(),
    "save": I(),
    "save-interval": I(),
    "save-hf": I(),
    "async-save": M(False, "checkpoints are written synchronously (correct, slower)", warn=True, bare=True),
    "no-save-optim": R(False, "checkpoints always hold the optimizer (resumes are exact)", bare=True),
    "ref-load": I(),
    "ref-ckpt-step": I(),
    "ref-update-interval": I(),
    "keep-old-actor": R(False, "the old policy's log-probs are recomputed before each step", bare=True),
    "reset-optimizer-states": R(False, "not implemented: start from an HF export (save_hf) instead", bare=True),
    "start-rollout-id": R(None, "the rollout id resumes from the checkpoint (load, ckpt_step)"),
    "release-train": R(False, "not implemented", bare=True),
    # data and rollout
    "prompt-data": I(),
    "input-key": I("input"),
    "label-key": I(),
    "metadata-key": I("metadata"),
    "tool-key": R("tools", "tool schemas in the data are not rendered into prompts; render them into the prompt "
                           "text (or messages) when building the dataset"),
    "multimodal-keys": I(),
    "apply-chat-template": I(False, bare=True),
    "apply-chat-template-kwargs": R("{}", "chat templates render with their defaults; render the prompts yourself "
                                          "if you need template arguments"),
    "rollout-shuffle": I(False, bare=True),
    "rollout-seed": I(42),
    "num-rollout": I(),
    "num-epoch": M(None, "num_rollout = num_epoch × (prompt_data's rows, JSONL or Parquet, after its @[start:end] "
                         "slice // rollout_batch_size), as slime computes it; ignored when num_rollout is given (as "
                         "in slime)"),
    "rollout-batch-size": I(),
    "n-samples-per-prompt": I(1),
    "over-sampling-batch-size": I(),
    "rollout-max-response-len": I(),
    "rollout-max-prompt-len": R(None, "prompts are not filtered by length; filter the dataset beforehand"),
    "rollout-max-context-len": M(None, "kept in args for plugins (the default generate bounds the response by "
                                       "rollout_max_response_len)", warn=True),
    "rollout-temperature": I(1.0),
    "rollout-top-p": I(1.0),
    "rollout-top-k": I(-1),
    "rollout-stop": I(nargs=True),
    "rollout-stop-token-ids": I(nargs=True),
    "rollout-skip-special-tokens": M(False, "the default generate sends skip_special_tokens=true; kept in args for "
                                            "plugins", warn=True, bare=True),
    "rollout-task-type": M("math", "kept in args for plugins"),
    "rollout-function-path": Flag("implemented", "slime.rollout.sglang_rollout.generate_rollout",
                                  "rollout_function_path: the rollout service runs a user's generate_rollout(args, "
                                  "rollout_id, data_source, evaluation=False) once per rollout, against the "
                                  "data_source_path data source (the job's buffer), and writes its groups as its own "
                                  "(a reward left None is scored by the job's reward); slime's own become "
                                  "settings: generate_rollout (the service's loop), sft_rollout.generate_rollout "
                                  "(loss_type sft_loss), fully_async_rollout.generate_rollout_fully_async (mode "
                                  "fully_async: the manager streams groups across rollouts); each eval calls it "
                                  "with evaluation=True unless eval_function_path is given, as slime does"),
    "data-source-path": Flag("implemented", "slime.rollout.data_source.RolloutDataSourceWithBuffer",
                             "data_source_path: a user's DataSource class, built once per job in the rollout service "
                             "and given to the rollout function (slime's default generate_rollout when "
                             "--rollout-function-path names none); slime.rollout.data_source's classes (the default "
                             "included) lease the job's prompts from the buffer, and a group given back "
                             "(add_samples) keeps its prompt's lease; another DataSource class makes its own "
                             "prompts, which the buffer stores at its position in place of prompt_data's"),
    "rollout-buffer-url": R(None, "the buffer service is the rollout buffer"),
    "buffer-filter-path": Flag("implemented", None, "buffer_filter_path: RolloutDataSourceWithBuffer.get_samples "
                                                    "takes the groups given back through it, with the rollout id "
                                                    "being generated (slime passes None); it runs the rollout "
                                                    "through a rollout function, slime's default when none is named"),
    "rollout-data-transport": M("object-store", "samples travel through the buffer service", warn=True),
    "fetch-trajectory-retry-times": M(-1, "the buffer waits for a rollout's groups itself", warn=True),
    "min-batch-collection-ratio": R(1, "a rollout always collects its full batch"),
    "disable-rollout-global-dataset": R(None, "the buffer service always holds the dataset", bare=True),
    "custom-generate-function-path": I(),
    "custom-rm-path": Flag("implemented", None, "custom_rm_path; slime's on_policy_distillation.reward_func (the "
                                                "teacher at --rm-url as the reward) is opd_teacher_url = rm_url with "
                                                "opd_only: the rollout service asks the teacher engine for each "
                                                "sample's log-probs, rewards are 0"),
    "custom-config-path": M(None, "its YAML mapping is read at submit, as slime sets each key on args: a job-spec "
                                  "key sets the spec (over its flag), any other joins the spec's plugin_args, so "
                                  "plugins and hooks see every key in args"),
    "custom-reward-post-process-path": Flag("implemented", None, "custom_reward_post_process_path; slime's "
                                               "on_policy_distillation.post_process_rewards (the teacher's log-probs "
                                               "onto the samples, rewards 0) is what opd_only does, with its "
                                               "reward_func only"),
    "custom-convert-samples-to-train-data-path": R(None, "samples become training data in the trainer; use "
                                                         "custom_loss_function_path to change the loss"),
    "custom-rollout-log-function-path": R(None, "rollout metrics are the rollout service's"),
    "custom-eval-rollout-log-function-path": R(None, "eval metrics are the rollout service's"),
    "rollout-data-postprocess-path": R(None, "post-process rewards in a group_rm function"),
    "rollout-all-samples-process-path": R(None, "filter groups with dynamic_sampling_filter_path"),
    "rollout-sample-filter-path": R(None, "filter groups with dynamic_sampling_filter_path"),
    "rollout-sample-hook-path": R([], "post-process samples in the generate function", nargs=True),
    "dynamic-sampling-filter-path": I(),
    "partial-rollout": I(False, bare=True),
    "mask-offpolicy-in-partial-rollout": I(False, bare=True),
    "group-rm": I(False, bare=True),
    "rm-type": I(),
    "rm-url": I(),
    "reward-key": I(),
    # eval
    "eval-interval": I(),
    "eval-prompt-data": I(nargs=True),
    "eval-config": M(None, "its datasets become eval_prompt_data; settings alike in every dataset the eval_* keys, "
                           "the others each dataset's own (eval_dataset_settings: samples per prompt, temperature, "
                           "top_p, top_k, max_response_len, input/label/metadata keys, rm_type, custom_rm_path); "
                           "settings with no counterpart (stop settings, min_new_tokens, repetition_penalty, "
                           "metadata injection, a per-dataset generate function or chat template) are refused, and "
                           "rm_type ifbench is refused by the reward service (IFBench's checker is not shipped)"),
    "eval-function-path": Flag("implemented", None, "eval_function_path: each eval calls it with evaluation=True "
                                                    "in the rollout service; its RolloutFnEvalOutput becomes eval/*"),
    "eval-input-key": I(),
    "eval-label-key": I(),
    "eval-tool-key": R(None, "tool schemas in the data are not rendered (see tool_key)"),
    "eval-reward-key": R(None, "evaluation uses reward_key"),
    "n-samples-per-eval-prompt": I(1),
    "eval-temperature": I(),
    "eval-top-p": I(),
    "eval-top-k": I(),
    "eval-max-response-len": I(),
    "eval-max-prompt-len": R(None, "prompts are not filtered by length"),
    "eval-max-context-len": R(None, "evaluation bounds responses by eval_max_response_len"),
    "eval-min-new-tokens": R(None, "min_new_tokens is not sent to the engines"),
    "skip-eval-before-train": M(False, "Physarum evaluates after rollouts (every eval_interval), never before "
                                       "training", warn=True, bare=True),
    # algorithm
    "advantage-estimator": I("grpo"),
    "loss-type": I("policy_loss"),
    "loss-mask-type": I("qwen"),
    "custom-loss-function-path": I(),
    "custom-advantage-function-path": I(),
    "custom-pg-loss-reducer-function-path": R(None, "use calculate_per_token_loss or custom_loss_function_path"),
    "custom-tis-function-path": I(),
    "disable-compute-advantages-and-returns": M(None, "with loss_type sft_loss (which uses none); refused otherwise: "
                                                      "advantages are always computed", bare=True),
    "global-batch-size": I(),
    "num-steps-per-rollout": I(),
    "micro-batch-size": I(1),
    "use-dynamic-batch-size": I(False, bare=True),
    "max-tokens-per-gpu": I(),
    "eps-clip": I(0.2),
    "eps-clip-high": I(),
    "eps-clip-c": I(),
    "value-clip": I(0.2),
    "gamma": I(1.0),
    "lambd": I(1.0),
    "num-critic-only-steps": I(0),
    "normalize-advantages": I(False, bare=True),
    "disable-grpo-std-normalization": I(False, bare=True),
    "disable-rewards-normalization": I(False, bare=True),
    "calculate-per-token-loss": I(False, bare=True),
    "use-kl-loss": I(False, bare=True),
    "kl-loss-coef": I(0.0),
    "kl-loss-type": I("k1"),
    "use-unbiased-kl": I(False, bare=True),
    "kl-coef": I(0.0),
    "entropy-coef": I(0.0),
    "use-tis": I(False, bare=True),
    "tis-clip": I(2.0),
    "tis-clip-low": I(0.0),
    "use-rollout-logprobs": I(False, bare=True),
    "get-mismatch-metrics": M(False, "train_rollout_logprob_abs_diff is always logged when rollout log-probs exist; "
                                     "with custom_tis_function_path the function also runs without use_tis, for its "
                                     "metrics, as in slime", warn=True, bare=True),
    "use-rollout-entropy": R(False, "the engines' entropies are not collected", bare=True),
    "use-opsm": R(False, "off-policy sequence masking is not implemented", bare=True),
    "opsm-delta": R(0.0001, "off-policy sequence masking is not implemented"),
    "use-opd": I(False, bare=True),
    "opd-type": I(),
    "opd-kl-coef": I(1.0),
    "opd-teacher-load": I(),
    "opd-teacher-ckpt-step": I(),
    "lr": I(1e-6),
    "clip-grad": I(1.0),
    "seed": I(1234),
    # weight sync
    "update-weights-interval": I(1),
    "update-weight-buffer-size": I(512 * 1024**2),
    "update-weight-mode": I("full"),
    "update-weight-transport": M("nccl", "weight_sync_backend: disk sets it to disk (engines pull each version from "
                                         "update_weight_disk_dir); nccl leaves it (nccl on GPUs, gloo otherwise)",
                                 warn=True),
    "update-weight-disk-dir": I(None),
    "update-weight-disk-keep-files": R(False, "the disk transport keeps the two newest full snapshots and the deltas "
                                              "after the newest, and removes the rest itself",
                                       bare=True),
    "update-weight-local-checkpoint-dir": M(None, "engines apply pulled deltas to the weights in memory: no host-local "
                                                  "copy is made; kept in args for plugins", warn=True),
    "update-weight-delta-checksum": I("xxh3-128"),
    "update-weight-delta-encoding": I("xor"),
    "custom-update-weight-post-write-path": R(None, "the disk transport's engines pull each version themselves "
                                                   "(/pull_weights); no hook runs after a write"),
    "check-weight-update-equal": R(False, _DEBUG + "the weight-sync tests check it", bare=True),
    # debugging and CI
    "debug-rollout-only": I(False, bare=True),
    "debug-train-only": I(False, bare=True),
    "save-debug-rollout-data": I(),
    "load-debug-rollout-data": I(),
    "load-debug-rollout-data-subsample": R(None, "debug rollout data is loaded whole"),
    "load-forge-rollout-data": R(None, _DEBUG + "use load_debug_rollout_data"),
    "save-debug-train-data": R(None, _DEBUG + "use save_debug_rollout_data"),
    "dump-details": R(None, _DEBUG + "use save_debug_rollout_data"),
    "ci-test": R(False, _DEBUG + "drop it", bare=True),
    "ci-disable-kl-checker": R(False, _DEBUG + "drop it", bare=True),
    "ci-load-grad-norm": R(None, _DEBUG + "drop it"),
    "ci-save-grad-norm": R(None, _DEBUG + "drop it"),
    "ci-train-rollout-logprob-abs-diff-threshold": R(0.1, _DEBUG + "drop it"),
    "profile-target": R(["train_overall"], _DEBUG + "drop it", nargs=True),
    "record-memory-history": R(False, _DEBUG + "drop it", bare=True),
    "memory-recorder": R("torch", _DEBUG + "drop it"),
    "memory-snapshot-dir": R(".", _DEBUG + "drop it"),
    "memory-snapshot-num-steps": R(None, _DEBUG + "drop it"),
    # logging
    "use-tensorboard": M(False, "TensorBoard event files are written for every job with `save` "
                                           "(<save>/tensorboard) or under the trainer's --tensorboard-dir",
                         bare=True),
    "tb-project-name": M(None, "the event files' directory is named after the job id", warn=True),
    "tb-experiment-name": M(None, "the event files' directory is named after the job id", warn=True),
    "log-passrate": M(False, "eval logs pass@k by itself; rollout pass rates are rollout/reward_mean", warn=True,
                      bare=True),
    "log-multi-turn": M(False, "response lengths are logged for every rollout", warn=True, bare=True),
    "log-correct-samples": M(False, "the reward metrics are logged for every rollout", warn=True, bare=True),
    "log-reward-category": R(None, "reward categories are not logged"),
    "use-wandb": I(False, bare=True),
    "wandb-mode": I(),
    "wandb-project": I(),
    "wandb-group": I(),
    "wandb-team": I(),
    "wandb-host": I(),
    "wandb-key": I(),
    "wandb-dir": I(),
    "wandb-run-id": I(),
    "wandb-always-use-train-step": I(False, bare=True),
    "disable-wandb-random-suffix": I(False, bare=True),
}


# Implemented flags whose spec default is not slime's, and why.
DEFAULTS_DIFFER: dict[str, str] = {
    "train-backend": "a spec without it gets the trainer's deployment default (fsdp on CPU); slime_args get "
                     "slime's megatron",
    "label-key": "label: a dataset's `label` column is read when there is one (slime reads none unless told); "
                 "rows without it get an empty label, so this only adds labels slime would not see",
    "rm-type": "math: slime fails at the first sample without one; every launch script sets --rm-type or "
               "--custom-rm-path, and a per-sample metadata.rm_type still wins",
    "rollout-max-response-len": "1024: slime leaves SGLang's own limit, which depends on the server",
    "log-probs-chunk-size": "1024: the fused, chunked log-probs, which never hold the [tokens × vocab] logits, are "
                            "exact and lighter; -1 (slime's default) projects every token at once",
    "hf-checkpoint": "required (slime fails without it too)",
    "multimodal-keys": "{}: no modality, the same as slime's None",
    "prompt-data": "required (slime fails without it too)",
    "num-rollout": "required unless num_epoch is given with a JSONL prompt_data (it is derived then)",
    "rollout-batch-size": "required (slime fails without it too)",
    "rollout-function-path": "empty: slime's default, the rollout service's own loop",
    "data-source-path": "empty: slime's default, slime.rollout.data_source.RolloutDataSourceWithBuffer",
}
# store_false flags: slime's default (None/True) is its destination's; the flag absent means False here and there
STORE_FALSE = ("disable-compute-advantages-and-returns", "disable-grpo-std-normalization",
               "disable-rewards-normalization", "disable-rollout-global-dataset", "disable-wandb-random-suffix")


def implemented() -> list[str]:
    return sorted(name for name, flag in FLAGS.items() if flag.status == "implemented")


def spec_key(flag: str) -> str:
    return flag.replace("-", "_")


# Megatron's MoE flags that no table lists: refused as the MoE layout flags are
MOE_REFUSAL = "this MoE setting is not implemented (the backends route as the HF config says)"


def is_moe_flag(name: str) -> bool:
    return name.startswith("moe-") or name == "num-experts"
