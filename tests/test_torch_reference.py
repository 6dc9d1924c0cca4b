"""Pins the independent torch-reference re-implementation (``tests/helpers/torch_reference.py``) to SPEC 2.6."""

from __future__ import annotations

import torch

from helpers.torch_reference import ANCHOR_HASH, _host_sources, mix3, real_kv_hash, splitmix64


def test_splitmix_pins():
    assert ANCHOR_HASH == 0xDE7FAE23A9A1B716
    assert splitmix64(0x9E3779B97F4A7C15) == 0xE220A8397B1DCDAF
    assert mix3(1, 2, 3) == 0xA55BDF37C08724B5
    assert mix3(ANCHOR_HASH, 42, 0) == 0x1B798564098041C9


def test_real_kv_pins():
    class S:
        pass

    s = S()
    s.tensor = torch.tensor(
        [[0x01, 0x02, 0x04, 0x08, 0x10, 0x20, 0x40, 0x80, 0x81, 0x82, 0x84, 0x88, 0x90, 0xA0, 0xC0, 0xFF]],
        dtype=torch.uint8,
    )
    s.page_size, s.num_bytes_per_token, s.read_bytes = 1, 16, 16
    assert real_kv_hash(_host_sources([s], 1), 0) == 0x6041580849E6407D
    s2 = S()
    s2.tensor = torch.arange(32, dtype=torch.uint8).reshape(1, 32)
    s2.page_size, s2.num_bytes_per_token, s2.read_bytes = 1, 32, 32
    assert real_kv_hash(_host_sources([s2], 2), 0) == 0xB44181DFE9420039


def test_chain_pins():
    running, got = ANCHOR_HASH, []
    for tok, pos in zip([101, 202, 303, 404, 505], range(5)):
        got.append(running)
        running = mix3(running, tok, pos)
    assert got == [0xDE7FAE23A9A1B716, 0x542FE5061275A6AB, 0x9890D56BDE53142E, 0x5213C65EEE8A1DD1, 0xC749AFFE5A5A9634]
    assert running == 0x3A650FCC4023CD13
