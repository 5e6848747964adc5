"""How a trainer rank's process ends (`exit_rank`): it leaves the world, then exits without the interpreter's
finalization, which torch's collective threads can turn into an abort. The world's own teardown is World.close's.

Why: a gloo worker thread outlives `destroy_process_group` while anything still holds its group (FSDP2's mesh,
megatron's groups), and it frees each finished collective's tensors after the caller has seen the collective done.
Freeing a tensor whose Python object outlived the caller's reference takes the GIL; once the interpreter finalizes,
CPython ends a thread that asks for the GIL with pthread_exit, and that unwinding through a C++ noexcept destructor
aborts the process ("terminate called without an active exception", SIGABRT) after a run whose results were whole.
The release can lag the collective by as long as the scheduler keeps the thread waiting, so no barrier or wait
rules it out (the autograd engine's device threads, on GPUs, can do the same). Everything the interpreter's exit
does that a run relies on (waiting for non-daemon threads, atexit callbacks such as logging's flush, flushing the
standard streams) is done here first; what is skipped is the tearing down of modules and objects alive at exit.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import sys
import threading
from typing import TYPE_CHECKING, NoReturn

if TYPE_CHECKING:  # no torch import for a process that never formed a world
    from services.trainer.distributed.parallel import World

log = logging.getLogger(__name__)


def exit_rank(code: int | None, world: World | None = None) -> NoReturn:
    """End this rank's process with `code` (None: 0, as sys.exit): close `world` if given (its errors are logged:
    the run's outcome is `code`), then exit as the interpreter would, short of finalizing it."""
    if world is not None:
        try:
            world.close()
        except Exception:  # noqa: BLE001 - a peer gone at the very end must not change a finished run's exit code
            log.exception("rank %d: leaving the world failed", world.rank)
    for thread in threading.enumerate():  # the interpreter waits for these before it exits
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()  # logging.shutdown and every other exit hook, while the interpreter is whole
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code or 0)
