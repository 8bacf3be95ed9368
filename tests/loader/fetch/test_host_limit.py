import asyncio

from loader.fetch import host_limit
from loader.fetch.host_limit import HostLimit


def test_a_hosts_limit_grows_with_kept_connections_and_halves_when_a_new_one_fails():
    host = HostLimit(128)
    assert host.limit == host_limit.START == 16
    seen = []
    for _ in range(16 + 32 + 64 + 10):
        host.answered(kept=True)
        seen.append(host.limit)
    assert [seen[15], seen[16 + 31], seen[16 + 32 + 63], seen[-1]] == [32, 64, 128, 128]
    host.refused()
    host.refused()
    assert host.limit == 32
    host.answered(kept=False)  # its answers close their connections: at most CLOSING, and no growth
    for _ in range(100):
        host.answered(kept=True)
    assert host.limit == host_limit.CLOSING
    for _ in range(10):
        host.refused()
    assert host.limit == 1


def test_requests_past_the_limit_wait_in_order_and_a_cancelled_one_gives_its_place_on():
    async def main():
        host = HostLimit(128)
        host.limit = 2
        order = []

        async def request(name, hold):
            await host.enter()
            order.append(name)
            await asyncio.sleep(hold)
            host.leave()

        tasks = [asyncio.create_task(request(n, 0.05)) for n in "abcde"]
        await asyncio.sleep(0.01)
        assert host.busy == 2 and len(host.waiting) == 3
        tasks[3].cancel()  # "d" waits, and is cancelled
        await asyncio.gather(*tasks, return_exceptions=True)
        return order, host.busy, len(host.waiting)
    order, busy, waiting = asyncio.run(main())
    assert order == ["a", "b", "c", "e"] and busy == 0 and waiting == 0
