"""The schedule shared by every executor with workers (loader/executors/schedule.py), run in fake time: fake workers
whose groups take known compute times, and a consumer that takes a group every `step`. Times are integers (ms), so
the waits asserted are exact."""

import heapq
import itertools

import pytest

from loader.executors.schedule import Result, Scheduled, Worker


class Clock:
    def __init__(self):
        self.now = 0


class FakeWorkers(Scheduled):
    """Workers that compute each group sent to them in compute(group) ms of fake time, all of a worker's groups at
    once (a worker runs `per_worker` threads)."""

    def __init__(self, num_groups: int, count: int, per_worker: int, compute, clock: Clock):
        self.clock, self.compute = clock, compute
        self.running: list = []  # heap of (finish, serial, worker, group)
        self.sent: list[tuple[int, int]] = []  # (time, group)
        self._serial = itertools.count()
        super().__init__(num_groups, count, per_worker, str)

    def _start(self, number):
        return Worker(number)

    def _send(self, worker, group, arg):
        self.sent.append((self.clock.now, group))
        heapq.heappush(self.running, (self.clock.now + self.compute(group), next(self._serial), worker, group))

    def _wait(self, timeout=None):
        if timeout is None and self.running and self.running[0][0] > self.clock.now:
            self.clock.now = self.running[0][0]  # blocks: fake time passes until the first group is done
        events = []
        while self.running and self.running[0][0] <= self.clock.now:
            _, _, worker, group = heapq.heappop(self.running)
            events.append(Result(worker, group, True, group))
        return events

    def _stop(self, worker):
        pass


def consume(groups: FakeWorkers, clock: Clock, step: int) -> list[int]:
    """Takes every group, one each `step` ms of fake time; the time waited for each."""
    waits = []
    for expected in range(groups._n):
        t = clock.now
        assert next(groups) == expected  # in order
        waits.append(clock.now - t)
        clock.now += step
    with pytest.raises(StopIteration):
        next(groups)
    return waits


def test_the_window_slides_so_a_consumer_slower_than_the_workers_waits_only_for_the_first_groups():
    # 2 workers x 2 groups at once, 1,000 ms a group: 4 groups/s against a consumer taking one every 300 ms.
    clock = Clock()
    groups = FakeWorkers(20, count=2, per_worker=2, compute=lambda g: 1000, clock=clock)
    waits = consume(groups, clock, step=300)
    # Only the first group is waited for. A window refilled only once it is empty would make the consumer wait a
    # whole group's compute time again after every 4 groups.
    assert waits == [1000] + [0] * 19
    # The window holds every worker's groups and one worker's more, done ahead (6): each group is sent as soon as a
    # worker has room (here, seen when the consumer takes a group) and the window reaches it.
    assert groups.sent == [(0, 0), (0, 1), (0, 2), (0, 3), (1000, 4), (1000, 5), (1000, 6), (1300, 7), (2200, 8),
                           (2200, 9), (2200, 10), (2500, 11), (3400, 12), (3400, 13), (3400, 14), (3700, 15),
                           (4600, 16), (4600, 17), (4600, 18), (4900, 19)]


def test_a_slow_group_holds_the_consumer_back_by_its_own_lateness_only():
    clock = Clock()
    groups = FakeWorkers(30, count=2, per_worker=2, compute=lambda g: 3000 if g == 10 else 1000, clock=clock)
    waits = consume(groups, clock, step=300)
    # Group 10 is sent at 2,200 ms and done 3,000 ms later, at 5,200; the consumer reaches it at 4,000: it waits
    # 1,200 ms, the group's 2,000 ms of lateness less the 800 ms the window had in hand. The groups after it were
    # computed meanwhile: no other wait.
    assert waits == [1000] + [0] * 9 + [1200] + [0] * 19


def test_a_consumer_faster_than_the_workers_waits_a_share_of_each_group():
    # 4 groups/s of supply, a consumer that would take 10/s: every 4 groups it waits the 1,000 ms they took less the
    # 400 ms it spent taking them.
    clock = Clock()
    groups = FakeWorkers(12, count=2, per_worker=2, compute=lambda g: 1000, clock=clock)
    waits = consume(groups, clock, step=100)
    assert waits == [1000, 0, 0, 0, 600, 0, 0, 0, 600, 0, 0, 0]
