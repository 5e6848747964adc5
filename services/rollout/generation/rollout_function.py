"""slime's --rollout-function-path in the rollout service: the user's `generate_rollout(args, rollout_id, data_source,
evaluation=False)` (or slime's default, compat sglang_rollout's, for a job that names only a data source or a buffer
filter) runs once per rollout in a worker thread, against the job's data source (--data-source-path, built once per
job on data_source.JobPrompts, the job's buffer). Its groups come back checked, finished and scored, each with the
prompt it answers; the manager writes them as its own. Coroutines the function runs through
slime.utils.async_utils.run go to the service's event loop, so slime's generate reaches the router as the loop's does.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import contextvars
import functools
import importlib
import inspect
import logging
import numbers
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from services.common import plugins
from services.common.errors import InvalidArgument
from services.common.plugin_sample import finish_plugin_sample
from services.common.samples import Prompt, Sample, Status
from services.common.settings.rollout import RolloutConfig
from services.rollout.engine_calls.generate import LOG_PROB_SETTINGS, use_context
from services.rollout.generation import data_source
from services.rollout.generation.data_source import JobPrompts, PromptFeeder
from services.rollout.generation.drain import EngineAborter
from services.rollout.generation.evaluation import function_eval_metrics
from services.rollout.generation.groups import Generation, rate_group
from services.rollout.generation.prompts import PromptEncoder

if TYPE_CHECKING:
    from services.buffer.client import BufferClient
    from services.rollout.generation.run_state import Run

log = logging.getLogger(__name__)

EXPECTED, DATA_SOURCE_EXPECTED, FILTER_EXPECTED = (plugins.ROLLOUT_FUNCTION.expected, plugins.DATA_SOURCE.expected,
                                                   plugins.BUFFER_FILTER.expected)
DEFAULT_DATA_SOURCE = "slime.rollout.data_source.RolloutDataSourceWithBuffer"
BUFFER_DATA_SOURCE = "slime.rollout.data_source.RolloutDataSource"  # its subclasses read the buffer's prompts
DATA_SOURCE_METHODS = ("get_samples", "add_samples", "save", "load")

# slime's default rollout function over a data source (with data_source_path or buffer_filter_path alone)
DEFAULT_ROLLOUT_FUNCTION = "slime.rollout.sglang_rollout.generate_rollout"
FUNCTION_METRICS = "rollout/function/"  # a rollout function's metrics under this prefix reach the trainer's logs
RATED_ATTR = "_physarum_rated"  # on each sample of a group rate_once rated


@dataclass(frozen=True)
class FunctionRun:
    """What slime's own rollout code (compat sglang_rollout) runs with inside a rollout function: the rollout's
    generation, the service's loop and its engine aborter."""

    gen: Generation
    loop: asyncio.AbstractEventLoop
    aborter: EngineAborter
    dropped: list[list[Sample]] = field(default_factory=list)  # groups the dynamic filter dropped
    drops: collections.Counter[str] = field(default_factory=collections.Counter)  # by drop_metric(reason)
    # in an eval: the service's own eval of the job's eval datasets, {name: groups} (slime's default eval_rollout)
    eval_groups: Callable[[], Awaitable[dict[str, list[list[Sample]]]]] | None = None


_RUN: contextvars.ContextVar[FunctionRun | None] = contextvars.ContextVar("physarum_function_run", default=None)


def current_run() -> FunctionRun | None:
    """The rollout function run this code is part of (None outside one)."""
    return _RUN.get()


def service_loop() -> asyncio.AbstractEventLoop | None:
    """The rollout service's event loop, inside a rollout function it runs (None elsewhere)."""
    run = _RUN.get()
    return None if run is None else run.loop


@functools.cache
def load_rollout_function(path: str) -> Callable[..., Any]:
    """The user's function, or slime's default (the compatibility package's, on the data source) for an empty path."""
    if not path:
        return _compat(DEFAULT_ROLLOUT_FUNCTION)
    fn = plugins.load_function(path, flag="rollout_function_path", expected=EXPECTED, is_async=False, num_params=3)
    params = inspect.signature(fn).parameters
    if "evaluation" not in params and not any(p.kind == p.VAR_KEYWORD for p in params.values()):
        raise InvalidArgument(f"rollout_function_path: {path} takes no `evaluation` keyword (slime passes it); "
                              f"expected {EXPECTED}")
    return fn


@functools.cache
def load_data_source_class(path: str) -> type:
    """The user's class, or slime's default (the compatibility package's, backed by the buffer) for an empty path."""
    if not path:
        return _compat(DEFAULT_DATA_SOURCE)
    cls = plugins.load_function(path, flag="data_source_path", expected=DATA_SOURCE_EXPECTED)
    missing = [name for name in DATA_SOURCE_METHODS if not callable(getattr(cls, name, None))]
    if not inspect.isclass(cls) or missing:
        what = "is not a class" if not inspect.isclass(cls) else f"has no {', '.join(missing)}"
        raise InvalidArgument(f"data_source_path: {path} {what}; expected {DATA_SOURCE_EXPECTED}")
    return cls


def makes_own_prompts(data_source_path: str) -> bool:
    """Whether the job's data source makes its own prompts: a class that is not slime's RolloutDataSource (which
    reads the buffer's dataset) or a subclass of it."""
    return not issubclass(load_data_source_class(data_source_path), _compat(BUFFER_DATA_SOURCE))


def _compat(path: str) -> Any:
    """slime's own object at `path`, from the compatibility package (slime's defaults need no allow-listing)."""
    plugins.ensure_slime_compat()
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


@functools.cache
def load_buffer_filter(path: str) -> Callable[..., Any]:
    return plugins.load_function(path, flag="buffer_filter_path", expected=FILTER_EXPECTED, is_async=False,
                                 num_params=4)


@dataclass
class JobSource:
    """A job's data source in this service: the user's object (built at its first rollout) over its prompts."""

    prompts: JobPrompts
    data_source: Any = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one rollout of a job at a time
    last_rollout_id: int | None = None  # the last rollout generated here; an earlier one means the trainer resumed


MAX_JOBS = 256  # data sources kept; beyond this the least recently used job's is forgotten


def job_source(sources: dict[str, JobSource], config: RolloutConfig, buffer: BufferClient,
               encoder: PromptEncoder) -> JobSource:
    """The job's JobSource in `sources` (made at its first rollout), bound for slime.rollout.data_source."""
    source = sources.pop(config.job_id, None) or JobSource(JobPrompts(buffer, encoder, config))
    sources[config.job_id] = source  # the most recent last
    data_source.bind(config.job_id, source.prompts)
    for job in list(sources)[: max(0, len(sources) - MAX_JOBS)]:
        data_source.unbind(job)
        del sources[job]
    return source


@contextlib.asynccontextmanager
async def job_rollout(sources: dict[str, JobSource], config: RolloutConfig, buffer: BufferClient,
                      encoder: PromptEncoder, rollout_id: int,
                      give_back: Callable[[list[str]], Awaitable[None]]) -> AsyncIterator[JobSource]:
    """One rollout of a job with a rollout function: its JobSource, held for the rollout (one at a time per job);
    after it, the data source saved when the trainer checkpoints this rollout, and the leases neither written nor
    kept given back."""
    source = job_source(sources, config, buffer, encoder)
    async with source.lock:
        try:
            yield source
            if source.data_source is not None and save_due(config.args, rollout_id):
                await asyncio.to_thread(source.data_source.save, rollout_id)
                if source.prompts.feeder is not None:
                    await asyncio.to_thread(source.prompts.feeder.save, rollout_id)
        finally:
            await give_back(source.prompts.release())


def train_groups(output: Any, what: str) -> list[list[Sample]]:
    """slime's call_rollout_fn for training: RolloutFnTrainOutput's samples, or the list a legacy function returns;
    groups (lists) of Samples."""
    groups = getattr(output, "samples", output)
    if not isinstance(groups, list) or not all(isinstance(g, list) and g and all(isinstance(s, Sample) for s in g)
                                               for g in groups):
        raise InvalidArgument(f"{what}: the rollout function returned {type(groups).__name__}, not groups of "
                              f"Samples (a list of non-empty lists); expected {EXPECTED}")
    return groups


Answered = list[tuple[Prompt, list[Sample]]]


async def generate_groups(run: Run, source: JobSource, aborter: EngineAborter) -> tuple[Answered, Answered]:
    """Run the job's rollout function for the run's rollout: each group it returns, finished and scored, with its
    prompt, and the groups slime's default function dropped (dynamic filter); the function's numeric metrics join
    the run's. InvalidArgument says what the function got wrong."""
    gen, rollout_id, weight_version, what = run.gen, run.rollout_id, run.weight_version, run.name
    config = gen.config
    if makes_own_prompts(config.data_source_path):  # its prompts' dataset exists from the first rollout on
        await asyncio.to_thread(source.prompts.buffer.append_prompts, config.job_id, 0, [])
    done = await asyncio.to_thread(source.prompts.buffer.count_groups, config.job_id, rollout_id)
    if done >= config.rollout_batch_size:  # asked again after its groups were written (a trainer that resumed)
        return [], []
    fn = load_rollout_function(config.rollout_function_path)
    if source.last_rollout_id is not None and rollout_id <= source.last_rollout_id:
        log.info("%s: the trainer resumed (last rollout here %d): the data source is built and loaded again", what,
                 source.last_rollout_id)
        source.data_source = None
        if forgotten := source.prompts.forget_kept():
            await asyncio.to_thread(source.prompts.buffer.return_prompts, config.job_id, forgotten)
    source.last_rollout_id = rollout_id
    if not getattr(gen.args, "job_id", ""):
        gen.args.job_id = config.job_id  # slime.rollout.data_source finds the job's prompts by it
    use_context(gen.ctx)  # the worker thread, and what it schedules on the loop, generate through this rollout's
    function_run = FunctionRun(gen=gen, loop=asyncio.get_running_loop(), aborter=aborter)
    _RUN.set(function_run)
    source.prompts.config, source.prompts.rollout_id = config, rollout_id
    output = await asyncio.to_thread(_call, fn, gen.args, rollout_id, source)
    groups = train_groups(output, what)
    run.drops.update(function_run.drops)
    run.extra_metrics = {FUNCTION_METRICS + str(k).removeprefix("rollout/"): float(v)
                         for k, v in (getattr(output, "metrics", None) or {}).items() if isinstance(v, numbers.Real)}
    if len(groups) != config.rollout_batch_size:
        raise InvalidArgument(f"{what}: the rollout function returned {len(groups)} groups; the trainer trains on "
                              f"rollout_batch_size ({config.rollout_batch_size})")
    out: Answered = []
    for position, group in enumerate(groups + function_run.dropped):
        prompt = source.prompts.prompt_of(group)
        if prompt is None or any(prompt is other for other, _ in out):
            problem = "answers no prompt leased from the buffer" if prompt is None else "answers a prompt again"
            raise InvalidArgument(f"{what}: group {position} (group_index {group[0].group_index}) {problem}: build "
                                  "each group from one group of data_source.get_samples")
        _finish(group, weight_version, config.args, f"{what}: group {position}")
        out.append((prompt, group))
    kept = out[:len(groups)]
    await asyncio.gather(*(rate_once(gen, group, f"{what}: prompt {prompt.index}") for prompt, group in kept))
    return kept, out[len(groups):]


async def rate_once(gen: Generation, group: list[Sample], what: str) -> None:
    """rate_group, unless the group was rated already (slime's default function rates its groups as they finish)."""
    if group and all(getattr(sample, RATED_ATTR, False) for sample in group):
        return
    await rate_group(gen, group, what)
    for sample in group:
        setattr(sample, RATED_ATTR, True)


def _call(fn: Callable[..., Any], args: Any, rollout_id: int, source: JobSource, evaluation: bool = False) -> Any:
    """In the worker thread: build the job's data source at its first use (loading its state as slime does at
    start: load(rollout_id - 1)), then call the function as slime's call_rollout_fn does."""
    feeder = source.prompts.feeder
    if source.data_source is None or (feeder is not None and feeder.broken):
        cls = load_data_source_class(source.prompts.config.data_source_path)
        if not makes_own_prompts(source.prompts.config.data_source_path):
            source.prompts.feeder = None
            source.data_source = cls(args)
            source.data_source.load(rollout_id - 1)
        else:  # it makes its own prompts: they go to the buffer, which slime's default data source reads
            source.prompts.feeder = PromptFeeder(cls(args), source.prompts.buffer, source.prompts.config.job_id)
            source.prompts.feeder.load(rollout_id - 1)
            source.data_source = _compat(DEFAULT_DATA_SOURCE)(args)
    return fn(args, rollout_id, source.data_source, evaluation=evaluation)


async def evaluate(source: JobSource, gen: Generation, gens: dict[str, Generation], rollout_id: int,
                   aborter: EngineAborter, eval_groups: Callable[[], Awaitable[dict[str, list[list[Sample]]]]],
                   ) -> dict[str, float]:
    """slime's eval through a function: eval_function_path (else rollout_function_path) called with
    evaluation=True on the job's data source, in a worker thread; its RolloutFnEvalOutput (or the data dict a
    legacy function returns) becomes the eval/* metrics. `gen` is the eval's generation (the job's eval sampling),
    `gens` each eval dataset's, whose samples per prompt group the rewards for pass@k."""
    config = gen.config
    path = config.eval_function_path or config.rollout_function_path
    fn = load_rollout_function(path)
    if not getattr(gen.args, "job_id", ""):
        gen.args.job_id = config.job_id
    use_context(gen.ctx)
    _RUN.set(FunctionRun(gen=gen, loop=asyncio.get_running_loop(), aborter=aborter, eval_groups=eval_groups))
    async with source.lock:  # the data source is built once, and used by one call at a time
        output = await asyncio.to_thread(_call, fn, gen.args, rollout_id, source, True)
    data = getattr(output, "data", output)
    if not isinstance(data, dict) or hasattr(output, "samples"):
        raise InvalidArgument(f"eval function {path}: returned {type(output).__name__} for evaluation=True; expected "
                              "RolloutFnEvalOutput(data={dataset: {rewards, truncated, samples}}) or that dict")
    return function_eval_metrics(data, getattr(output, "metrics", None),
                                 {name: g.n_samples for name, g in gens.items()})


def _finish(group: list[Sample], weight_version: str, job_args: dict[str, Any], what: str) -> None:
    needs = next((flag for flag in LOG_PROB_SETTINGS if job_args.get(flag)), "")
    for j, sample in enumerate(group):
        if sample.status == Status.ABORTED:
            raise InvalidArgument(f"{what}: sample {j} is ABORTED; give aborted groups back with "
                                  "data_source.add_samples")
        finish_plugin_sample(sample, needs_log_probs=needs, what=f"{what} sample {j}")
        if not sample.weight_versions:
            sample.weight_versions = [weight_version]  # tokens made without the engines' weight_version


def save_due(job_args: dict[str, Any], rollout_id: int) -> bool:
    """slime saves the data source with the trainer's checkpoints: every save_interval rollouts and at the last."""
    interval, last = job_args.get("save_interval"), job_args.get("num_rollout")
    if not job_args.get("save"):
        return False
    return bool(interval and (rollout_id + 1) % int(interval) == 0) or (last is not None and rollout_id + 1 == last)
