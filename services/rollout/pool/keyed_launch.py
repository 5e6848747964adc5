"""Start a server that takes its credential only as a flag — sglang-router's control-plane key, SGLang's
`--admin-api-key` — without the token on the command line: read it from this process's token file
(services.common.auth), append the flag inside the process, and run the server's module as `__main__`.
`/proc/PID/cmdline` shows the module and its other flags only. No token file: the server runs without the flag.

`python -m services.rollout.pool.keyed_launch SERVICE MODULE [ARGS...]`
"""

from __future__ import annotations

import runpy
import sys

from services.common import auth, procs

# service whose token the server checks -> (flag, value format)
FLAGS = {
    "router": ("--control-plane-api-keys", "rollout-manager:rollout-manager:admin:{token}"),  # /workers: admin role
    "engine": ("--admin-api-key", "{token}"),  # SGLang: weight updates, pause, abort, flush
}


def keyed_argv(service: str, module: str, *args: str) -> list[str]:
    """The command line that starts `python -m module args...` with `service`'s token appended as its flag."""
    if service not in FLAGS:
        raise ValueError(f"no credential flag known for {service!r}; expected one of {', '.join(FLAGS)}")
    return procs.python_module(__name__, service, module, *args)


def with_key(service: str, args: list[str]) -> list[str]:
    """`args` and, when this process holds `service`'s token, its flag."""
    token = auth.read_token(service)
    flag, value = FLAGS[service]
    return [*args, flag, value.format(token=token)] if token else list(args)


def main(argv: list[str] | None = None) -> None:
    service, module, *args = sys.argv[1:] if argv is None else argv
    sys.argv = [module, *with_key(service, args)]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
