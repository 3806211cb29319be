"""StepDelivery: one loop wake-up per burst of engine-thread deliveries, nothing lost,
order kept per queue."""

from __future__ import annotations

import asyncio
import threading

from kvscope.engine.server.delivery import StepDelivery
from tests.waiting import HANG_S


def test_a_burst_is_one_wakeup_and_keeps_order():
    async def main():
        loop = asyncio.get_running_loop()
        delivery = StepDelivery(loop)
        queues = [asyncio.Queue() for _ in range(4)]
        delivers = [delivery.to(q) for q in queues]
        wakeups = []
        flush = delivery._flush
        delivery._flush = lambda: (wakeups.append(1), flush())

        def engine_thread():
            for step in range(3):
                for d in delivers:
                    d(step)

        t = threading.Thread(target=engine_thread)
        t.start()
        t.join()  # the loop was busy here: the whole burst is pending
        got = [[await asyncio.wait_for(q.get(), HANG_S) for _ in range(3)] for q in queues]
        assert got == [[0, 1, 2]] * 4
        assert len(wakeups) == 1
        # the next burst schedules a new flush
        threading.Thread(target=lambda: delivers[0]("late")).start()
        assert await asyncio.wait_for(queues[0].get(), HANG_S) == "late"
        assert len(wakeups) == 2

    asyncio.run(main())


def test_a_closed_loop_drops_quietly():
    loop = asyncio.new_event_loop()
    delivery = StepDelivery(loop)
    loop.close()
    delivery.to(asyncio.Queue())("x")  # the server shut down: no exception on the engine
