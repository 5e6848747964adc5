"""Each values.schema.json rule and each template guard refuses a bad value with a message naming what is wrong."""

from __future__ import annotations

import helm_python as helm
import pytest

from tests.chart.chart import CHART, VALUE_SETS, render, render_raw

# (id, bad values, regex the error must contain). The schema runs inside Chart.render, as it does in `helm install`.
SCHEMA_RULES = [
    ("misspelt key", {"trainer": {"replcas": 2}}, r"at '/trainer': additional properties 'replcas' not allowed"),
    ("unknown top-level key", {"trainers": {}}, r"additional properties 'trainers' not allowed"),
    ("integer as string", {"buffer": {"replicas": "2"}}, r"at '/buffer/replicas': got string, want integer"),
    ("shm size unit", {"trainer": {"shmSize": "64G"}}, r"at '/trainer/shmSize': '64G' does not match pattern"),
    ("tmp size unit", {"tmpSize": "20GB"}, r"at '/tmpSize': '20GB' does not match pattern"),
    ("engine backend", {"engines": {"backend": "vllm"}},
     r"at '/engines/backend': value must be one of 'sglang', 'cpu'"),
    ("hpa and manager both scale engines", {"engines": {"hpa": {"enabled": True}, "managerScaling": {"enabled": True}}},
     r"at '/engines/managerScaling/enabled': value must be false"),
    ("sglang without gpus", {"engines": {"backend": "sglang", "gpus": 0}},
     r"at '/engines/gpus': minimum: got 0, want 1"),
    ("external redis without url", {"redis": {"enabled": False}}, r"at '/redis/externalUrl': minLength: got 0, want 1"),
    ("redis url scheme", {"redis": {"enabled": False, "externalUrl": "http://redis:6379"}},
     r"at '/redis/externalUrl': 'http://redis:6379' does not match pattern"),
    ("redis appendfsync", {"redis": {"appendfsync": "sometimes"}}, r"at '/redis/appendfsync': value must be one of"),
    ("config sets a chart-owned field", {"buffer": {"config": {"redis_url": "redis://x:6379/0"}}},
     r"at '/buffer/config/redis_url': false schema"),
    ("config sets the trainer's token", {"trainer": {"config": {"api_token": "x" * 20}}},
     r"at '/trainer/config/api_token': false schema"),
    ("config sets the trainer's world", {"trainer": {"config": {"world_size": 4}}},
     r"at '/trainer/config/world_size': false schema"),
    ("config sets the default backend", {"trainer": {"config": {"default_train_backend": "fsdp"}}},
     r"at '/trainer/config/default_train_backend': false schema"),
    ("default train backend", {"trainer": {"defaultTrainBackend": "deepspeed"}},
     r"at '/trainer/defaultTrainBackend': value must be one of 'megatron', 'fsdp'"),
    ("config sets the engine's model", {"engines": {"cpu": {"config": {"model_path": "/x"}}}},
     r"at '/engines/cpu/config/model_path': false schema"),
    ("config sets a peer address", {"rollout": {"config": {"router_url": "http://x"}}},
     r"at '/rollout/config/router_url': false schema"),
    ("config sets the engine launcher", {"rollout": {"config": {"engine_launcher": "local"}}},
     r"at '/rollout/config/engine_launcher': false schema"),
    ("engine join mode", {"engines": {"joinMode": "copy"}}, r"at '/engines/joinMode': value must be one of"),
    ("config key not a field name", {"reward": {"config": {"MaxConcurrency": 8}}},
     r"at '/reward/config': additional properties 'MaxConcurrency' not allowed"),
    ("config value not a scalar", {"trainer": {"config": {"num_threads": {"n": 1}}}},
     r"at '/trainer/config/num_threads': 'anyOf' failed"),
    ("cpu request removed", {"buffer": {"resources": {"requests": {"cpu": None}}}},
     r"at '/buffer/resources/requests': missing property 'cpu'"),
    ("memory limit removed", {"trainer": {"resources": {"limits": {"memory": None}}}},
     r"at '/trainer/resources/limits': missing property 'memory'"),
    ("no trainer rank", {"trainer": {"replicas": 0}}, r"at '/trainer/replicas': minimum: got 0, want 1"),
    ("port range", {"buffer": {"port": 70000}}, r"at '/buffer/port': maximum"),
    ("nccl debug level", {"trainer": {"network": {"ncclDebug": "info"}}},
     r"at '/trainer/network/ncclDebug': value must"),
    ("empty socket ifname", {"trainer": {"network": {"socketIfname": ""}}},
     r"at '/trainer/network/socketIfname': minLength"),
    ("router policy", {"router": {"policy": "least_load"}}, r"at '/router/policy': value must be one of"),
    ("short job token", {"jobApi": {"token": "short"}}, r"at '/jobApi/token': 'short' does not match pattern"),
    ("pdb budget", {"engines": {"pdb": {"maxUnavailable": "half"}}},
     r"at '/engines/pdb/maxUnavailable': 'anyOf' failed"),
    ("metrics peers empty", {"networkPolicy": {"metricsFrom": []}},
     r"at '/networkPolicy/metricsFrom': minItems: got 0, want 1"),
    ("root pods", {"podSecurityContext": {"runAsNonRoot": False}},
     r"at '/podSecurityContext/runAsNonRoot': value must be true"),
    ("privileged containers", {"securityContext": {"privileged": True}},
     r"at '/securityContext/privileged': value must be false"),
    ("pull policy", {"image": {"pullPolicy": "Sometimes"}}, r"at '/image/pullPolicy': value must be one of"),
    ("access mode", {"checkpoints": {"persistence": {"accessMode": "ReadWriteAll"}}},
     r"at '/checkpoints/persistence/accessMode': value must be one of"),
    ("hpa without metrics", {"engines": {"hpa": {"metrics": []}}}, r"at '/engines/hpa/metrics': minItems"),
    ("scrape interval", {"metrics": {"serviceMonitor": {"interval": "30"}}},
     r"at '/metrics/serviceMonitor/interval': '30' does not match pattern"),
    ("gpu resource name", {"gpuResourceName": "gpu"}, r"at '/gpuResourceName': 'gpu' does not match pattern"),
]


@pytest.mark.parametrize("values, message", [pytest.param(v, m, id=i) for i, v, m in SCHEMA_RULES])
def test_schema_refuses(values, message):
    with pytest.raises(helm.HelmValuesError, match=message):
        render_raw(values)


def test_schema_accepts_every_value_set():
    for name, values in VALUE_SETS.items():
        helm.Chart.load(str(CHART)).validate_schema(values)  # raises on a refusal
        assert render(values), name


def test_schema_accepts_config_of_each_kind():
    objects = render({"buffer": {"config": {"grace_s": 2.5, "redis_wait_s": 60}},
                      "rollout": {"config": {"engine_urls": ["http://a:30000", "http://b:30000"]}}})
    assert objects


# Template guards: (id, values, regex of the `fail` message). The first two are also schema rules; the guards hold
# when the schema is skipped (helm install --skip-schema-validation), so they are tested on a chart copy without it.
GUARDS = [
    ("hpa and manager both scale engines", {"engines": {"hpa": {"enabled": True}, "managerScaling": {"enabled": True}}},
     r"engines: hpa.enabled and managerScaling.enabled are both true; an HPA and the rollout manager would fight"),
    ("external redis without url", {"redis": {"enabled": False, "externalUrl": ""}},
     r"redis: enabled is false but externalUrl is empty"),
    ("engine hpa min > max", {"engines": {"managerScaling": {"enabled": False},
                                          "hpa": {"enabled": True, "minReplicas": 5, "maxReplicas": 2}}},
     r"engines.hpa: minReplicas \(5\) must be <= maxReplicas \(2\)"),
    ("reward hpa min > max", {"reward": {"hpa": {"minReplicas": 3, "maxReplicas": 1}}},
     r"reward.hpa: minReplicas \(3\) must be <= maxReplicas \(1\)"),
    ("ranks share a ReadWriteOnce volume", {"trainer": {"replicas": 2}, "engines": {"joinMode": "sync"},
                                            "checkpoints": {"persistence": {"accessMode": "ReadWriteOnce"}}},
     r"checkpoints.persistence.accessMode ReadWriteOnce: the 2 trainer ranks share the volume from different nodes; "
     r"use ReadWriteMany"),
    ("engines share a ReadWriteOnce volume", {"checkpoints": {"persistence": {"accessMode": "ReadWriteOnce"}}},
     r"ReadWriteOnce: the trainer and the engines \(engines.joinMode disk\) share the volume"),
    ("disk join without a shared volume", {"checkpoints": {"persistence": {"enabled": False}}},
     r"engines.joinMode disk needs a volume the trainer and the engines share"),
]


@pytest.mark.parametrize("values, message", [pytest.param(v, m, id=i) for i, v, m in GUARDS])
def test_guard_fails_without_schema(values, message, chart_without_schema):
    with pytest.raises(helm.HelmRenderError, match=message):
        render_raw(values, chart_dir=chart_without_schema)


@pytest.mark.parametrize("values, message", [pytest.param(v, m, id=i) for i, v, m in GUARDS[2:]])
def test_guard_fails_through_the_schema(values, message):
    """Cross-field rules the schema cannot express reach the guard in a normal install."""
    with pytest.raises(helm.HelmRenderError, match=message):
        render_raw(values)


def test_guard_allows_a_shared_claim_of_your_own():
    values = {"trainer": {"replicas": 2},
              "checkpoints": {"persistence": {"accessMode": "ReadWriteOnce", "existingClaim": "mine"}}}
    assert any(o["kind"] == "StatefulSet" for o in render(values))

