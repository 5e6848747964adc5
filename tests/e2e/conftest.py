"""The whole local stack, started once for the end-to-end tests and stopped by its recorded PIDs."""

import pytest

from physarum import stack


@pytest.fixture(scope="session")
def local_stack(session_dir, tiny_model_dir):
    work_dir = session_dir / "stack"
    state = stack.up(stack.StackOptions(work_dir=work_dir, model_path=tiny_model_dir, num_engines=2,
                                        trainer_threads=1))
    yield state
    stack.down(work_dir)
