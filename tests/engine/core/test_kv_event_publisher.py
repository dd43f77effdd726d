"""The KV-event publisher against a subscriber written from vLLM's schema (helpers/kv_subscriber.py): batches in
order with their sequence numbers, a gap filled from the replay socket, vLLM's config keys and endpoints."""

from __future__ import annotations

import time

import msgpack
import pytest
import zmq

from kiln.cache.kv_events import BlockRemoved, BlockStored, KVEventLog
from kiln.engine.core.kv_event_publisher import KVEventPublisher, rank_endpoint
from kiln.engine.kv_events_config import KVEventsConfig

from helpers.kv_subscriber import KVEventSubscriber
from helpers.server import free_port


def config(**extra) -> KVEventsConfig:
    port = free_port()
    return KVEventsConfig.parse(
        {
            "enable_kv_cache_events": True,
            "endpoint": f"tcp://*:{port}",
            "replay_endpoint": f"tcp://*:{free_port()}",
            "topic": "kv@test",
            **extra,
        }
    )


def local(endpoint: str) -> str:
    return endpoint.replace("*", "127.0.0.1")


@pytest.fixture
def pair():
    cfg = config(buffer_steps=4)
    publisher = KVEventPublisher(cfg, KVEventLog())
    subscriber = KVEventSubscriber(local(cfg.endpoint), local(cfg.replay_endpoint), cfg.topic)
    time.sleep(0.3)  # (a PUB socket drops what it sends before the subscription has reached it)
    yield publisher, subscriber
    subscriber.close()
    publisher.close()


def stored(block_hash: int, parent: int | None = None) -> BlockStored:
    return BlockStored([block_hash], parent, [block_hash] * 4, 4)


def test_batches_arrive_in_order_with_their_numbers(pair):
    publisher, subscriber = pair
    publisher.log.stored(b"\x00" * 31 + b"\x01", None, [1, 1, 1, 1])
    publisher.flush()
    publisher.flush()  # nothing new: no batch
    publisher.publish([stored(2, 1), BlockRemoved([2])])
    assert subscriber.poll(1.0) == 2
    assert [seq for seq, _ in subscriber.batches] == [0, 1]
    assert subscriber.live == {1: (1, 1, 1, 1)} and subscriber.removed == [2]
    assert subscriber.layouts == {"map"}


def test_a_gap_is_filled_from_the_replay_socket(pair):
    publisher, subscriber = pair
    for i in range(6):
        publisher.publish([stored(10 + i)])
    assert subscriber.poll(1.0, drop={2, 3}) == 6  # 0, 1, then 4 finds 2 and 3 missing: replayed, then 4 and 5
    assert subscriber.replayed == [2, 3]
    assert sorted(subscriber.live) == list(range(10, 16))


def test_replay_keeps_the_last_buffer_steps_batches(pair):
    publisher, subscriber = pair
    for i in range(6):
        publisher.publish([stored(20 + i)])
    subscriber.poll(1.0)
    asker = subscriber.context.socket(zmq.REQ)  # vLLM's own test asks with a REQ socket
    asker.connect(subscriber.replay_endpoint)
    asker.send((0).to_bytes(8, "big"))
    assert asker.poll(2000)
    topic, seq, payload = asker.recv_multipart()
    assert topic == b"kv@test" and int.from_bytes(seq, "big") == 2  # 0 and 1 are gone: buffer_steps is 4
    assert msgpack.unpackb(payload)[1] == [stored(22).wire()]
    asker.close(linger=0)


def test_a_publisher_connects_where_the_endpoint_names_a_host():
    """vLLM's rule: a wildcard or ipc address is bound, another is connected to (llm-d's indexer binds)."""
    context = zmq.Context()
    sink = context.socket(zmq.SUB)
    sink.setsockopt(zmq.SUBSCRIBE, b"")
    port = sink.bind_to_random_port("tcp://127.0.0.1")
    publisher = KVEventPublisher(KVEventsConfig(True, endpoint=f"tcp://127.0.0.1:{port}"), KVEventLog())
    try:
        # NOTE: a bound SUB socket sends its subscription once its own thread has touched it after the connect
        assert not sink.poll(300)
        publisher.publish([stored(1)])
        assert sink.poll(2000)
        topic, seq, payload = sink.recv_multipart()
        assert (topic, int.from_bytes(seq, "big")) == (b"", 0)
        assert msgpack.unpackb(payload)[1:] == [[stored(1).wire()], 0]  # (tagged maps: vLLM's layout now)
    finally:
        publisher.close()
        context.destroy(linger=0)


def test_the_array_layout_is_there_for_older_subscribers():
    cfg = config(layout="array")
    publisher = KVEventPublisher(cfg, KVEventLog())
    subscriber = KVEventSubscriber(local(cfg.endpoint), local(cfg.replay_endpoint), cfg.topic)
    try:
        time.sleep(0.3)
        publisher.publish([stored(3), BlockRemoved([3])])
        assert subscriber.poll(1.0) == 1
        assert subscriber.layouts == {"array"} and subscriber.removed == [3]
    finally:
        subscriber.close()
        publisher.close()


def test_data_parallel_ranks_publish_on_their_own_ports():
    assert rank_endpoint("tcp://*:5557", 0) == "tcp://*:5557"
    assert rank_endpoint("tcp://*:5557", 2) == "tcp://*:5559"
    assert rank_endpoint("tcp://*:0", 2) == "tcp://*:0"
    assert rank_endpoint("ipc:///tmp/kv", 1) == "ipc:///tmp/kv_dp1"


def test_a_taken_port_fails_in_a_line():
    cfg = config()
    first = KVEventPublisher(cfg, KVEventLog())
    try:
        with pytest.raises(ValueError, match="cannot open"):
            KVEventPublisher(cfg, KVEventLog())
    finally:
        first.close()


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("{", "not JSON"),
        ([], "JSON object"),
        ({"enable_kv_cache_events": True, "endpont": "tcp://*:1"}, "unknown keys"),
        ({"enable_kv_cache_events": True, "publisher": "kafka"}, "unknown publisher"),
        ({"enable_kv_cache_events": True, "buffer_steps": 0}, "positive integer"),
        ({"enable_kv_cache_events": True, "endpoint": "inproc://x"}, "tcp:// or ipc://"),
        ({"enable_kv_cache_events": True, "layout": "json"}, "unknown layout"),
    ],
)
def test_a_wrong_kv_events_config_is_one_error(value, message):
    with pytest.raises(ValueError, match=message):
        KVEventsConfig.parse(value)


def test_vllms_defaults():
    """vllm/config/kv_events.py: zmq once enabled, null otherwise, its endpoint and sizes."""
    on, off = KVEventsConfig.parse('{"enable_kv_cache_events": true}'), KVEventsConfig.parse("{}")
    assert (on.publisher, on.enabled, off.publisher, off.enabled) == ("zmq", True, "null", False)
    assert (on.endpoint, on.replay_endpoint, on.buffer_steps, on.hwm, on.topic) == (
        "tcp://*:5557",
        None,
        10_000,
        100_000,
        "",
    )
