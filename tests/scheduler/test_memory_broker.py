"""The embedded mode's in-memory broker wakes its consumer instead of polling: a message put
by another thread, or an ack that frees a full prefetch window, reaches a consumer that waits
with a polling interval far longer than the test (a missing wake-up would end in the
timeout)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
from kombu import Connection, Consumer, Exchange, Producer, Queue

POLL_S = 60.0  # the safety net: never reached when the wake-ups work
QUEUE = Queue("wake-test", Exchange("wake-test"), routing_key="wake-test")


@pytest.fixture
def conn() -> Iterator[Connection]:
    with Connection("memory://", transport="scheduler.memory_broker:Transport",
                    transport_options={"polling_interval": POLL_S}) as c:
        yield c
    from kombu.transport import memory

    memory.Channel.queues.pop(QUEUE.name, None)  # class-level state shared by all channels


def publish_later(conn: Connection, body: str, after_s: float = 0.2) -> threading.Thread:
    def run() -> None:
        time.sleep(after_s)  # the consumer is waiting by then
        with conn.clone() as other:
            Producer(other.channel()).publish(body, exchange=QUEUE.exchange,
                                              routing_key=QUEUE.routing_key, declare=[QUEUE])

    t = threading.Thread(target=run)
    t.start()
    return t


def test_a_message_put_by_another_thread_wakes_the_waiting_consumer(conn: Connection) -> None:
    got: list[str] = []
    with Consumer(conn.channel(), [QUEUE], callbacks=[lambda body, msg: (got.append(body),
                                                                          msg.ack())]):
        sender = publish_later(conn, "apply step 7")
        conn.drain_events(timeout=20)  # a poll would come after 60 s: TimeoutError at 20
        sender.join()
    assert got == ["apply step 7"]


def test_an_ack_that_frees_the_prefetch_window_wakes_the_consumer(conn: Connection) -> None:
    """Celery's worker holds at most `prefetch` unacknowledged tasks: the next queued one
    must be delivered when one is acknowledged, not at the next poll."""
    got: list[tuple[str, object]] = []
    channel = conn.channel()
    channel.basic_qos(0, 1, False)
    with Consumer(channel, [QUEUE], callbacks=[lambda body, msg: got.append((body, msg))]):
        for body in ("first", "second"):
            Producer(conn.channel()).publish(body, exchange=QUEUE.exchange,
                                             routing_key=QUEUE.routing_key, declare=[QUEUE])
        conn.drain_events(timeout=20)
        assert [b for b, _ in got] == ["first"]  # the window (1) is full until the ack
        acker = threading.Timer(0.2, got[0][1].ack)  # the task finishes on a pool thread
        acker.start()
        conn.drain_events(timeout=20)
        acker.join()
    assert [b for b, _ in got] == ["first", "second"]


def test_an_empty_queue_still_times_out(conn: Connection) -> None:
    with Consumer(conn.channel(), [QUEUE], callbacks=[]), pytest.raises(TimeoutError):
        conn.drain_events(timeout=0.3)
