"""Secrets stay out of children's environments and out of directories that do not need them."""

from __future__ import annotations

import stat

from physarum import stack
from services.common import auth, procs


def test_children_inherit_no_variable_named_like_a_secret(monkeypatch):
    monkeypatch.setenv("PHYSARUM_TRAINER_API_TOKEN", "s3cr3t")
    monkeypatch.setenv("HF_TOKEN", "hf")
    monkeypatch.setenv("REDIS_PASSWORD", "pw")
    monkeypatch.setenv("PHYSARUM_ROLLOUT_ENGINE_PER_TOKEN_DELAY_S", "0.5")
    env = procs.inherited_env()
    assert not {"PHYSARUM_TRAINER_API_TOKEN", "HF_TOKEN", "REDIS_PASSWORD"} & set(env)
    assert env["PHYSARUM_ROLLOUT_ENGINE_PER_TOKEN_DELAY_S"] == "0.5"


def test_the_stack_gives_each_process_only_the_tokens_it_needs(tmp_path):
    envs = stack.write_credentials(tmp_path / "secrets")
    held = {name: sorted(p.stem for p in (tmp_path / "secrets" / name).iterdir()) for name in envs}
    assert held == {"buffer": ["buffer"], "reward": ["reward"], "router": ["router"],
                    "rollout": ["buffer", "engine", "reward", "rollout", "router"],
                    "trainer": ["buffer", "engine", "rollout", "trainer"],
                    "operator": ["buffer", "reward", "rollout", "router", "trainer"]}
    assert sorted(p.name for p in (tmp_path / "secrets").iterdir()) == sorted(envs)  # no directory of every token
    for name, env in envs.items():
        token_dir = env[auth.TOKEN_DIR_ENV]
        assert stat.S_IMODE((tmp_path / "secrets" / name).stat().st_mode) == 0o700
        for service in held[name]:
            path = auth.token_path(service, token_dir)
            assert stat.S_IMODE(path.stat().st_mode) == 0o600 and len(auth.read_token(service, token_dir)) >= 32
    # one token per service, the same wherever it is held
    assert auth.read_token("buffer", envs["rollout"][auth.TOKEN_DIR_ENV]) == \
        auth.read_token("buffer", envs["buffer"][auth.TOKEN_DIR_ENV])
    assert auth.read_token("engine", envs["buffer"][auth.TOKEN_DIR_ENV]) == ""
