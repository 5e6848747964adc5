"""Command lines of the engines the pool launches (CPU engine, SGLang server with sglang_* options passed through),
the Kubernetes launcher behind the pool's interface, and the manager's pool settings."""

from __future__ import annotations

import sys

import pytest

from services.common.errors import InvalidArgument
from services.rollout.config import RolloutManagerConfig
from services.rollout.pool.launchers import KubernetesLauncher, LaunchedEngine, cpu_engine_argv
from services.rollout.pool.sglang_launcher import parse_sglang_options, sglang_server_args, sglang_server_argv


def test_sglang_options_become_server_flags_like_slimes_prefix():
    options = {"sglang_mem_fraction_static": 0.8, "sglang_tp_size": 2, "sglang_enable_metrics": True,
               "sglang_disable_radix_cache": False, "sglang_chunked_prefill_size": None,
               "sglang_cuda_graph_bs": [1, 2, 4], "sglang_json_model_override_args": {"rope_theta": 1e6}}
    assert sglang_server_args(options) == [
        "--mem-fraction-static", "0.8", "--tp-size", "2", "--enable-metrics", "--cuda-graph-bs", "1", "2", "4",
        "--json-model-override-args", '{"rope_theta": 1000000.0}']
    assert sglang_server_argv("/models/qwen", "0.0.0.0", 30001, {"sglang_tp_size": 2}, python="py") == [
        "py", "-m", "services.rollout.pool.keyed_launch", "engine", "sglang.launch_server", "--model-path",
        "/models/qwen", "--host", "0.0.0.0", "--port", "30001", "--tp-size", "2"]


@pytest.mark.parametrize("key, fragment", [("mem_fraction_static", "named sglang_<server flag>"),
                                           ("sglang_", "named sglang_<server flag>"),
                                           ("sglang_port", "sets --port itself"),
                                           ("sglang_admin_api_key", "sets --admin-api-key itself")])
def test_bad_sglang_option_names_are_rejected(key, fragment):
    with pytest.raises(InvalidArgument, match=fragment):
        sglang_server_args({key: 1})


def test_sglang_options_from_flags_are_typed_yaml():
    assert parse_sglang_options(["sglang_mem_fraction_static=0.85", "sglang_enable_metrics=true",
                                 "sglang_cuda_graph_bs=[1, 2]", "sglang_attention_backend=flashinfer"]) == {
        "sglang_mem_fraction_static": 0.85, "sglang_enable_metrics": True, "sglang_cuda_graph_bs": [1, 2],
        "sglang_attention_backend": "flashinfer"}
    with pytest.raises(InvalidArgument, match="expected sglang_<flag>=<value>"):
        parse_sglang_options(["sglang_tp_size"])
    with pytest.raises(InvalidArgument, match="sets --host itself"):
        parse_sglang_options(["sglang_host=0.0.0.0"])


def test_cpu_engine_argv():
    argv = cpu_engine_argv("/m", num_threads=2, per_token_delay_s=0.05, fake_compute=True,
                           weight_sync_timeout_s=9.0, device="cuda")(31000, 3)
    assert argv == [sys.executable, "-m", "services.engine", "--host", "127.0.0.1", "--port", "31000",
                    "--model-path", "/m", "--num-threads", "2", "--seed", "3", "--per-token-delay-s", "0.05",
                    "--fake-compute", "True", "--weight-sync-timeout-s", "9.0", "--device", "cuda"]


class FakeKubernetes:
    def __init__(self) -> None:
        self.ready = {"engine-abc": "http://10.0.0.7:30000", "engine-xyz": "http://10.0.0.9:30000"}
        self.scaled: list[int] = []
        self.listed = 0

    def engine_urls(self) -> list[str]:
        self.listed += 1
        return sorted(self.ready.values())

    def scale(self, replicas: int) -> None:
        self.scaled.append(replicas)


def test_kubernetes_launcher_lists_ready_pods_and_patches_replicas():
    k8s = FakeKubernetes()
    launcher = KubernetesLauncher(k8s)
    assert launcher.engines() == [LaunchedEngine("engine-abc", "http://10.0.0.7:30000"),
                                  LaunchedEngine("engine-xyz", "http://10.0.0.9:30000")]
    assert k8s.listed == 1
    launcher.scale(3)
    launcher.scale(2, remove=["engine-abc"])  # the ReplicaSet picks the pod: only the count is sent
    assert k8s.scaled == [3, 2]


def test_manager_pool_settings_are_checked():
    config = RolloutManagerConfig(num_engines=0, engine_join_mode="sync", sglang_args=["sglang_tp_size=2"])
    assert config.engine_join_mode == "sync" and config.rest_port == 0
    for bad, fragment in [({"engine_join_mode": "rsync"}, "engine_join_mode must be disk or sync"),
                          ({"engine_launcher": "slurm"}, "engine_launcher must be local or kubernetes"),
                          ({"engine_type": "vllm"}, "engine_type must be cpu or sglang"),
                          ({"num_engines": 2}, "model_path is required to start 2 local engines"),
                          ({"engine_launcher": "kubernetes"}, "needs k8s_engine_deployment"),
                          ({"health_check_timeout_s": 0}, "health_check_timeout_s must be > 0"),
                          ({"rest_port": 70000}, "rest_port must be in")]:
        with pytest.raises(ValueError, match=fragment):
            RolloutManagerConfig(**bad)


def test_keyed_launch_adds_the_token_flag_only_when_the_token_file_exists(tmp_path, monkeypatch):
    from services.common import auth
    from services.rollout.pool import keyed_launch

    monkeypatch.setenv(auth.TOKEN_DIR_ENV, str(tmp_path))
    assert keyed_launch.with_key("engine", ["--port", "1"]) == ["--port", "1"]  # auth off: the server's own flags
    auth.write_tokens(tmp_path, ["engine", "router"])
    engine, router = auth.read_token("engine"), auth.read_token("router")
    assert keyed_launch.with_key("engine", ["--port", "1"]) == ["--port", "1", "--admin-api-key", engine]
    assert keyed_launch.with_key("router", []) == [
        "--control-plane-api-keys", f"rollout-manager:rollout-manager:admin:{router}"]
    with pytest.raises(ValueError, match="no credential flag known for 'buffer'"):
        keyed_launch.keyed_argv("buffer", "services.buffer")
