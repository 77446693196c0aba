"""distmk.timing.cuda_times without a GPU (CUDA events replaced by a clock): every process runs exactly
warmup + iters calls, which tensor-parallel ranks rely on, and `before` stays outside the timed span."""
from distmk import timing


class FakeEvent:
    """A CUDA event that records when, in calls of the benchmarked function, it was recorded."""
    clock = 0

    def __init__(self, enable_timing):
        assert enable_timing

    def record(self):
        self.at = FakeEvent.clock

    def synchronize(self):
        pass

    def elapsed_time(self, end):
        return float(end.at - self.at)


def test_fixed_count_and_untimed_before(monkeypatch):
    monkeypatch.setattr(timing.torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(timing.torch.cuda, "synchronize", lambda: None)
    log = []

    def fn():
        FakeEvent.clock += 1
        log.append("fn")

    def barrier():
        FakeEvent.clock += 100            # a slow barrier must not show in the times
        log.append("barrier")

    times = timing.cuda_times(fn, iters=4, warmup=2, before=barrier)
    assert times == [1.0] * 4
    assert log == ["fn", "fn"] + ["barrier", "fn"] * 4
