"""slime compatibility for plugins: what slime's custom generate, reward and filter functions import, backed by
Physarum. Install it with the `slime` extra, or let the services add it to sys.path when they load a plugin.

Only the plugin-facing surface exists here (utils.types, utils.http_utils, utils.misc, utils.async_utils,
utils.processing_utils (with `qwen_vl_utils` beside this package),
rollout.sglang_rollout, rollout.base_types, rollout.data_source (read from the job's buffer), rollout.filter_hub,
rollout.rm_hub, agent.adapters (on the rollout service's agent gateway), agent.parsing, agent.trajectory, and
backends.megatron_utils.cp_utils at CP 1 for TIS helpers); slime's trainer, Ray and Megatron layers do not:
Physarum's services do that job.
"""
