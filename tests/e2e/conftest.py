"""The whole local stack, started once for the end-to-end tests and stopped by its recorded PIDs."""

import pytest

from physarum import stack
from tests.e2e.roots import stack_roots


@pytest.fixture(scope="session")
def local_stack(session_dir, tiny_model_dir):
    work_dir = session_dir / "stack"
    state = stack.up(stack.StackOptions(work_dir=work_dir, model_path=tiny_model_dir, num_engines=2,
                                        trainer_threads=1, path_roots=stack_roots(session_dir)))
    yield state
    stack.down(work_dir)
