"""free_port: below the kernel's ephemeral range, free, and without touching the seeded ``random``."""
import random
import socket

from megatron_sparsebalance.training.ports import _ephemeral_ports_start, free_port


def test_free_port_lies_below_the_ephemeral_range_and_can_be_listened_on():
    end = _ephemeral_ports_start()
    for _ in range(20):
        port = free_port()
        assert 1024 <= port < end
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
            s.listen()


def test_free_port_leaves_the_seeded_random_alone():
    random.seed(3)
    expected = [random.random() for _ in range(3)]
    random.seed(3)
    free_port()
    assert [random.random() for _ in range(3)] == expected
