"""The engine scheduler's max_loras_per_batch: a batch holds at most that many distinct adapters (the base model
counting as one); a request over the limit waits, and those behind it that fit go first."""

from services.engine.scheduler import Request, SamplingParams, Scheduler


def scheduler(max_loras_per_batch: int) -> Scheduler:
    s = Scheduler(vocab_size=10, context_len=64, eos_ids=frozenset({0}), max_batch_size=8)
    s.max_loras_per_batch = max_loras_per_batch
    return s


def queue(s: Scheduler, names: list[str | None]) -> list[Request]:
    requests = [Request(rid=f"r{i}", input_ids=[1], params=SamplingParams(), lora_name=name)
                for i, name in enumerate(names)]
    s.waiting.extend(requests)
    return requests


def test_a_batch_takes_at_most_max_loras_per_batch_adapters_in_queue_order():
    s = scheduler(2)
    r = queue(s, ["a", None, "b", "a", None, "c"])
    assert s._take([], 8, stop_at_scoring=False) == [r[0], r[1], r[3], r[4]]
    assert list(s.waiting) == [r[2], r[5]]  # b and c wait for the next batch: two adapters each
    assert s._take([], 8, stop_at_scoring=False) == [r[2], r[5]]


def test_joining_counts_the_running_rows_adapters():
    s = scheduler(2)
    running = [Request(rid="x", input_ids=[1], params=SamplingParams(), lora_name="a")]
    r = queue(s, ["b", "c", "a"])
    assert s._take(running, 8, stop_at_scoring=True, dry_run=True) == [r[0], r[2]]
    assert len(s.waiting) == 3  # a dry run leaves the queue as it was


def test_without_lora_serving_the_batch_is_the_queue_head():
    s = scheduler(0)
    r = queue(s, ["a", "b", "c", None])
    assert s._take([], 3, stop_at_scoring=False) == r[:3]
