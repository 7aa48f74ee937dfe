"""Fair admission between groups (engine/scheduler.py): a request that arrives behind a
group holding every `max_num_seqs` slot and many more waiting sequences takes the next
slot that frees, so it finishes within one run of the group's sequences plus its own,
counted in steps, however many sequences the group still has queued."""

from __future__ import annotations

from engine.request import RequestStatus
from engine.scheduler import Scheduler
from tests.engine.test_scheduler import FakeModel, make_request, make_scheduler, step

BIG_TOKENS = 8
VICTIM_TOKENS = 2
# the victim's own prefill and decodes, and the step its slot frees in
STEPS_OF_ITS_OWN = VICTIM_TOKENS + 2


def steps_until_finished(scheduler: Scheduler, model: FakeModel, request_id: str) -> int:
    victim = scheduler.requests[request_id]
    steps = 0
    while victim.status not in (RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_STOPPED):
        step(scheduler, model)
        steps += 1
        assert steps < 1000
    return steps


def test_a_newcomer_waits_for_one_run_of_a_big_group_not_for_all_of_it():
    scheduler = make_scheduler(max_num_seqs=2, num_blocks=256)
    model = FakeModel()
    for i in range(8):  # the prompts of one API call: 8 sequences for 2 slots
        scheduler.add_request(make_request(f"big-{i}", [i + 1] * 3, BIG_TOKENS, ignore_eos=True), group="call-1")
    step(scheduler, model)
    scheduler.add_request(make_request("victim", [500, 501], VICTIM_TOKENS, ignore_eos=True))
    steps = steps_until_finished(scheduler, model, "victim")
    # first come first served admitted it after 6 of the 8 big sequences: 3 whole runs
    assert steps <= BIG_TOKENS + STEPS_OF_ITS_OWN
    assert scheduler.num_waiting >= 4  # the big call's queued sequences did not go first


def test_the_sequences_of_n_do_not_jump_ahead_of_another_request():
    scheduler = make_scheduler(max_num_seqs=2, num_blocks=256)
    model = FakeModel()
    leader = make_request("n/0", [7] * 6, BIG_TOKENS, ignore_eos=True)
    followers = [make_request(f"n/{i}", [7] * 6, BIG_TOKENS, ignore_eos=True) for i in range(1, 8)]
    scheduler.add_request(leader, followers)
    step(scheduler, model)
    scheduler.add_request(make_request("victim", [500, 501], VICTIM_TOKENS, ignore_eos=True))
    # the followers forked from the leader's prefill wait at the front of the queue; before,
    # they took every slot that freed until all of them had run
    assert steps_until_finished(scheduler, model, "victim") <= BIG_TOKENS + STEPS_OF_ITS_OWN


def test_groups_share_the_slots_and_a_group_alone_uses_them_all():
    scheduler = make_scheduler(max_num_seqs=4, num_blocks=256)
    model = FakeModel()
    for i in range(6):
        scheduler.add_request(make_request(f"a-{i}", [i + 1] * 3, BIG_TOKENS), group="a")
    for i in range(6):
        scheduler.add_request(make_request(f"b-{i}", [i + 20] * 3, BIG_TOKENS), group="b")
    out = step(scheduler, model)
    assert sorted(r.request_id for r in out.requests) == ["a-0", "a-1", "b-0", "b-1"]
    alone = make_scheduler(max_num_seqs=4, num_blocks=256)
    for i in range(6):
        alone.add_request(make_request(f"a-{i}", [i + 1] * 3, BIG_TOKENS), group="a")
    assert len(step(alone, FakeModel()).requests) == 4
