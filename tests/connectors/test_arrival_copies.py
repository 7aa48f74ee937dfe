"""The claims that let the parts of one load be copied into device blocks concurrently,
as they arrive, while `seal` (before the blocks are freed) waits for every copy."""

from __future__ import annotations

import threading

from connectors.worker import ArrivalCopies


def test_parts_are_copied_concurrently_and_each_once():
    copies = ArrivalCopies()
    assert copies.claim(0) and copies.claim(1)  # two parts at once
    assert not copies.claim(0)  # a part being copied is not claimed again
    copies.finish(0, True)
    copies.finish(1, False)  # not placed: the slot path may copy it later
    assert not copies.claim(0) and copies.claim(1)
    copies.finish(1, True)
    assert copies.seal() == {0, 1}


def test_seal_waits_for_the_copies_under_way_and_refuses_new_ones():
    copies = ArrivalCopies()
    assert copies.claim(0)
    sealed: list[set[int]] = []
    sealer = threading.Thread(target=lambda: sealed.append(copies.seal()))
    sealer.start()
    sealer.join(0.2)
    assert sealer.is_alive() and not sealed  # the copy of part 0 is still writing its blocks
    assert not copies.claim(1)  # sealed: no new copy starts
    copies.finish(0, True)
    sealer.join(5)
    assert sealed == [{0}]
