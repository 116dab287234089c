"""The shared-memory ring between two pipeline stages: messages of any size (many chunks of a small ring)
arrive whole and in order, with or without a tensor, and a receiver waits no longer than the timeout."""

from __future__ import annotations

import threading

import pytest
import torch

from strata.distributed.shared_memory import SharedMemoryChannel


@pytest.mark.parametrize("slot_bytes", [16, 24, 1000, 2**20])
def test_messages_stream_through_a_small_ring(slot_bytes: int) -> None:
    sender = SharedMemoryChannel(None, slot_bytes, 3, 10.0, "rank 1")
    receiver = SharedMemoryChannel(sender.name, slot_bytes, 3, 10.0, "rank 0")
    tensors = [torch.randn(37, 55) * i if i % 3 else None for i in range(12)]
    tensors[3] = torch.arange(10, dtype=torch.int64)  # another dtype, a byte count unlike the others'
    tensors[6] = torch.empty(0)

    def send_all() -> None:
        for i, tensor in enumerate(tensors):
            sender.send({"step": i, "text": "x" * i}, tensor)

    thread = threading.Thread(target=send_all)
    thread.start()
    try:
        for i, tensor in enumerate(tensors):
            obj, got = receiver.receive()
            assert obj == {"step": i, "text": "x" * i}
            if tensor is None:
                assert got is None
            else:
                assert got.dtype == tensor.dtype and torch.equal(got, tensor)
    finally:
        thread.join()
        sender.unlink()
        sender.close()
        receiver.close()


def test_a_receiver_waits_no_longer_than_the_timeout() -> None:
    sender = SharedMemoryChannel(None, 64, 2, 0.3, "rank 1")
    receiver = SharedMemoryChannel(sender.name, 64, 2, 0.3, "rank 0")
    try:
        with pytest.raises(TimeoutError, match=r"rank 0 sent nothing within 0\.3 s"):
            receiver.receive()
    finally:
        sender.unlink()
        sender.close()
        receiver.close()
