"""The page pool / prefix cache and the scheduler, with no model: pure host bookkeeping.

Page pool: hash chaining, references, LRU eviction of cached free pages, the reserved dummy page,
all-or-nothing growth. Scheduler: admission order, the token and sequence budgets, why requests
finish, aborts, and preemption. Requests are built by hand and fed fake sampled tokens.
"""

from __future__ import annotations

import pytest

from jaxserve.config.engine_config import EngineConfig
from jaxserve.runner.page_pool import PagePool, hash_page
from jaxserve.core.request import Request, RequestStatus
from jaxserve.config.sampling_params import SamplingParams
from jaxserve.core.scheduler import Scheduler

PS = 4  # page size used throughout


def _tokens(n: int, first: int = 0) -> list[int]:
    return list(range(first, first + n))


def _cached_hashes(pool: PagePool) -> set[bytes]:
    return {h for h in pool.page_hashes if h is not None}


def _holding(pool: PagePool, token_ids: list[int]) -> tuple[list[int], list[bytes]]:
    """Allocates pages for `token_ids` as a request would, registers its full pages; returns both."""
    table: list[int] = []
    assert pool.grow(table, len(token_ids))
    hashes = pool.page_hashes_of(token_ids, [])
    pool.cache_full_pages(table, hashes)
    return table, hashes


# ------------------------------------------------------------------------------------------------
# Page pool


def test_page_hash_chains_the_parent():
    """Equal hashes mean equal whole prefixes: the same page tokens under another parent hash differently."""
    page = [1, 2, 3, 4]
    root = hash_page(None, page)
    assert hash_page(None, page) == root  # deterministic
    assert hash_page(root, page) != root
    assert hash_page(hash_page(None, [9, 9, 9, 9]), page) != hash_page(root, page)
    assert hash_page(None, [1, 2, 3, 5]) != root

    pool = PagePool(8, PS)
    a = pool.page_hashes_of([0, 0, 0, 0] + page, [])
    b = pool.page_hashes_of([0, 0, 0, 1] + page, [])
    assert a[1] != b[1]  # second page identical, first page differs: the chain differs


def test_page_hashes_cover_only_full_pages_and_extend_known():
    """page_hashes_of hashes full pages only, and extends known hashes rather than recomputing them."""
    pool = PagePool(8, PS)
    tokens = _tokens(11)
    hashes = pool.page_hashes_of(tokens, [])
    assert len(hashes) == 2  # 11 tokens = 2 full pages + 3 tokens
    assert hashes == [hash_page(None, tokens[0:4]), hash_page(hashes[0], tokens[4:8])]
    assert pool.page_hashes_of(tokens[:7], []) == hashes[:1]
    assert pool.page_hashes_of(tokens[:8], []) == hashes
    assert pool.page_hashes_of(tokens[:3], []) == []
    # extending: the known hashes are kept as given, and new ones chain from the last known one
    assert pool.page_hashes_of(tokens + [11], hashes[:1]) == pool.page_hashes_of(tokens + [11], [])
    fake = [b"not-a-real-hash"]
    extended = pool.page_hashes_of(tokens, fake)
    assert extended == [fake[0], hash_page(fake[0], tokens[4:8])]
    assert pool.page_hashes_of(tokens, hashes) == hashes  # nothing new to add


def test_lookup_takes_references_and_counts_tokens():
    """lookup returns the longest cached prefix, takes one reference per page, counts queried/hit tokens."""
    pool = PagePool(10, PS)
    tokens = _tokens(12)
    table, hashes = _holding(pool, tokens)
    assert len(table) == 3 and pool.num_cached_pages == 3

    assert pool.lookup(hashes, max_pages=3) == table
    assert [pool.ref_counts[p] for p in table] == [2, 2, 2]
    assert (pool.num_queried_tokens, pool.num_hit_tokens) == (12, 12)

    # a different third page: only the first two pages hit
    other = pool.page_hashes_of(tokens[:8] + [99, 99, 99, 99], [])
    assert pool.lookup(other, max_pages=3) == table[:2]
    assert [pool.ref_counts[p] for p in table] == [3, 3, 2]
    assert (pool.num_queried_tokens, pool.num_hit_tokens) == (24, 20)

    # max_pages caps the lookup and the count of queried tokens
    assert pool.lookup(hashes, max_pages=1) == table[:1]
    assert (pool.num_queried_tokens, pool.num_hit_tokens) == (28, 24)

    # a first-page miss hits nothing
    assert pool.lookup(pool.page_hashes_of(_tokens(8, first=50), []), max_pages=2) == []
    assert (pool.num_queried_tokens, pool.num_hit_tokens) == (36, 24)
    assert [pool.ref_counts[p] for p in table] == [4, 3, 2]


def test_shared_page_ref_count_goes_up_and_back_down():
    """A page shared by two requests has ref 2; each free drops one; at 0 it is free but still cached."""
    pool = PagePool(6, PS)
    first, hashes = _holding(pool, _tokens(5))  # 1 full page + 1 partial page
    page = first[0]
    assert pool.ref_counts[page] == 1
    second = pool.lookup(hashes, max_pages=1)
    assert second == [page] and pool.ref_counts[page] == 2
    assert pool.grow(second, 6) and len(second) == 2 and second[1] not in first
    used = pool.num_used_pages
    assert used == 3

    pool.free(first)
    assert first == [] and pool.ref_counts[page] == 1 and pool.num_used_pages == 2
    pool.free(second)
    assert pool.ref_counts[page] == 0 and pool.num_used_pages == 0
    assert pool.page_hashes[page] == hashes[0] and pool.num_cached_pages == 1
    assert pool.num_free_pages == 5


def test_finished_request_pages_stay_cached_and_are_reused():
    """Pages of a finished request keep their hashes at ref 0 and a later lookup gets the same pages back."""
    pool = PagePool(10, PS)
    table, hashes = _holding(pool, _tokens(13))
    old = list(table)
    pool.free(table)
    assert pool.num_used_pages == 0 and pool.num_cached_pages == 3
    assert all(pool.ref_counts[p] == 0 for p in old)

    again = pool.lookup(hashes, max_pages=3)
    assert again == old[:3]
    assert pool.num_used_pages == 3 and pool.num_free_pages == 9 - 3
    assert all(pool.ref_counts[p] == 1 for p in again)
    # the reused pages were taken out of the free queue: growing never hands them out twice
    assert pool.grow(again, 9 * PS)
    assert len(again) == len(set(again)) == 9


def test_lru_eviction_order_is_least_recently_freed_first_tail_first():
    """Cached free pages are evicted least recently freed first, and within a request tail page first."""
    pool = PagePool(9, PS)  # pages 1..8
    a_table, a_hashes = _holding(pool, _tokens(12))  # 3 full pages
    b_table, b_hashes = _holding(pool, _tokens(12, first=100))
    assert a_table == [1, 2, 3] and b_table == [4, 5, 6]
    pool.free(a_table)  # freed first: evicted first
    pool.free(b_table)

    evicted, handed_out = [], []
    table: list[int] = []
    for n in range(1, 9):
        before = _cached_hashes(pool)
        assert pool.grow(table, n * PS)
        handed_out.append(table[-1])
        evicted.append(before - _cached_hashes(pool))
    # never-used pages 7, 8 first (nothing evicted), then a's pages tail first, then b's
    assert handed_out == [7, 8, 3, 2, 1, 6, 5, 4]
    expected = [set(), set()] + [{a_hashes[i]} for i in (2, 1, 0)] + [{b_hashes[i]} for i in (2, 1, 0)]
    assert evicted == expected
    assert pool.num_cached_pages == 0


def test_lookup_refreshes_lru_position():
    """A cached page that is looked up and freed again becomes most recently freed: evicted last."""
    pool = PagePool(7, PS)  # pages 1..6
    a_table, a_hashes = _holding(pool, _tokens(8))  # pages 1, 2
    b_table, b_hashes = _holding(pool, _tokens(8, first=100))  # pages 3, 4
    pool.free(a_table)
    pool.free(b_table)
    reused = pool.lookup(a_hashes, max_pages=1)  # touches a's first page
    assert reused == [1]
    pool.free(reused)

    evicted = []
    table: list[int] = []
    for n in range(1, 7):
        before = _cached_hashes(pool)
        assert pool.grow(table, n * PS)
        evicted.append(before - _cached_hashes(pool))
    assert evicted == [set(), set(), {a_hashes[1]}, {b_hashes[1]}, {b_hashes[0]}, {a_hashes[0]}]


def test_page_zero_is_never_handed_out():
    """Page 0 is the dummy page padded rows write to: no request may ever own it."""
    pool = PagePool(5, PS)
    assert pool.num_free_pages == 4 and pool.num_used_pages == 0
    for _ in range(3):
        table: list[int] = []
        assert pool.grow(table, 4 * PS)
        assert sorted(table) == [1, 2, 3, 4]
        assert not pool.grow(table, 5 * PS)
        hashes = pool.page_hashes_of(_tokens(4 * PS), [])
        pool.cache_full_pages(table, hashes)
        shared = pool.lookup(hashes, max_pages=4)
        assert shared == table and 0 not in shared
        pool.free(shared)
        pool.free(table)
        assert pool.num_free_pages == 4
        pool.reset_prefix_cache()
    assert pool.ref_counts[0] == 0 and pool.page_hashes[0] is None


def test_grow_fails_without_side_effects():
    """grow is all or nothing: short of pages it returns False and changes no table, ref or cache entry."""
    pool = PagePool(5, PS)  # 4 usable
    other_table, other_hashes = _holding(pool, _tokens(4, first=200))  # 1 cached page, then freed
    other = list(other_table)
    pool.free(other_table)
    table: list[int] = []
    assert pool.grow(table, 2 * PS)
    state = (list(table), list(pool.ref_counts), list(pool.page_hashes), pool.num_free_pages,
             pool.num_cached_pages)
    assert not pool.grow(table, 5 * PS)  # needs 3 more pages, 2 are free
    assert (list(table), list(pool.ref_counts), list(pool.page_hashes), pool.num_free_pages,
            pool.num_cached_pages) == state
    assert pool.lookup(other_hashes, max_pages=1) == other  # still cached, not evicted
    assert pool.grow(table, 2 * PS)  # already covered: nothing needed
    assert pool.pages_needed(table, 2 * PS) == 0 and pool.pages_needed(table, 2 * PS + 1) == 1


def test_prefix_caching_disabled_caches_nothing():
    """With enable_prefix_caching=False no page gets a hash and lookups never hit."""
    pool = PagePool(8, PS, enable_prefix_caching=False)
    table, hashes = _holding(pool, _tokens(12))
    assert len(hashes) == 3  # hashes are still computed, just never registered
    assert pool.num_cached_pages == 0 and all(h is None for h in pool.page_hashes)
    assert pool.lookup(hashes, max_pages=3) == []
    pool.free(table)
    assert pool.lookup(hashes, max_pages=3) == [] and pool.num_hit_tokens == 0


# ------------------------------------------------------------------------------------------------
# Scheduler


def _request(rid: str, num_prompt: int, max_tokens: int = 4, first_token: int = 0, priority: int = 0,
             eos: tuple[int, ...] = (), **params) -> Request:
    sampling = SamplingParams(max_tokens=max_tokens, **params)
    return Request(rid, _tokens(num_prompt, first_token), sampling, seed=0, max_tokens=max_tokens,
                   eos_token_ids=eos, priority=priority)


def _scheduler(num_pages: int = 64, page_size: int = PS, prefix_caching: bool = True, **cfg) -> Scheduler:
    cfg = {"max_model_len": 256, "block_size": page_size, **cfg}
    return Scheduler(EngineConfig(**cfg), PagePool(num_pages, page_size, prefix_caching))


def _step(scheduler: Scheduler, token: int = 7):
    """One schedule/update round with a fake model that samples `token` for every row."""
    out = scheduler.schedule()
    scheduler.advance(out)  # the step was launched
    updated = scheduler.update_from_output(out, [token] * len(out.scheduled))
    return out, updated


def _run(scheduler: Scheduler, token: int = 7, max_steps: int = 500) -> int:
    """Steps until nothing is left; fails (rather than hangs) if the scheduler stops making progress."""
    for num_steps in range(max_steps):
        if not scheduler.has_unfinished:
            return num_steps
        _step(scheduler, token)
    raise AssertionError(f"requests still unfinished after {max_steps} steps")


def _ids(out) -> list[tuple[str, int]]:
    return [(r.request_id, n) for r, n in out.scheduled]


def test_admission_is_first_come_first_served():
    """Equal priority: waiting requests are admitted in arrival order, the rest wait their turn."""
    scheduler = _scheduler(max_num_seqs=2, max_num_batched_tokens=64)
    requests = [_request(f"r{i}", 3, max_tokens=2, first_token=10 * i) for i in range(4)]
    for request in requests:
        scheduler.add_request(request)
    out, _ = _step(scheduler)
    assert _ids(out) == [("r0", 3), ("r1", 3)]
    assert [r.request_id for r in scheduler.waiting] == ["r2", "r3"]
    out, finished = _step(scheduler)  # r0 and r1 generate their second and last token
    assert _ids(out) == [("r0", 1), ("r1", 1)] and all(r.status.is_finished for r in finished)
    out, _ = _step(scheduler)
    assert _ids(out) == [("r2", 3), ("r3", 3)]


def test_admission_follows_priority_then_arrival():
    """Lower priority value is admitted first; ties keep arrival order."""
    scheduler = _scheduler(max_num_seqs=4, max_num_batched_tokens=64, scheduling_policy="priority")
    for rid, priority in [("a", 1), ("b", 0), ("c", 2), ("d", 0), ("e", 1)]:
        scheduler.add_request(_request(rid, 2, priority=priority))
    out, _ = _step(scheduler)
    assert [r.request_id for r, _ in out.scheduled] == ["b", "d", "a", "e"]
    assert [r.request_id for r in scheduler.waiting] == ["c"]


def test_fcfs_admits_by_arrival_whatever_the_priority():
    """Under the default policy (fcfs) a request's priority orders nothing: no request jumps the queue."""
    scheduler = _scheduler(max_num_seqs=4, max_num_batched_tokens=64)
    assert scheduler.cfg.scheduling_policy == "fcfs"
    for rid, priority in [("a", 1), ("b", 0), ("c", 2), ("d", -5), ("e", 1)]:
        scheduler.add_request(_request(rid, 2, priority=priority))
    out, _ = _step(scheduler)
    assert [r.request_id for r, _ in out.scheduled] == ["a", "b", "c", "d"]
    assert [r.request_id for r in scheduler.waiting] == ["e"]


def test_fcfs_admits_by_arrival_time_not_by_the_order_requests_reach_the_scheduler():
    """The server tokenizes on several threads, so a request can reach the scheduler after one that arrived
    later: waiting requests are admitted by arrival_time, ties in the order they were added."""
    scheduler = _scheduler(max_num_seqs=2, max_num_batched_tokens=64)
    for rid, arrived in [("late", 2.0), ("early", 1.0), ("tie-first", 3.0), ("tie-second", 3.0)]:
        request = _request(rid, 3, max_tokens=2)
        request.arrival_time = arrived
        scheduler.add_request(request)
    out, _ = _step(scheduler)
    assert _ids(out) == [("early", 3), ("late", 3)]
    assert [r.request_id for r in scheduler.waiting] == ["tie-first", "tie-second"]


def test_token_budget_is_respected_and_prompts_are_chunked():
    """No step schedules more than max_num_batched_tokens; the prompt that overflows it is chunked."""
    scheduler = _scheduler(max_num_seqs=8, max_num_batched_tokens=32)
    for i in range(3):
        scheduler.add_request(_request(f"r{i}", 20, max_tokens=3, first_token=30 * i))
    out, _ = _step(scheduler)
    assert _ids(out) == [("r0", 20), ("r1", 12)]  # r2 waits: no budget left
    out, _ = _step(scheduler)
    assert _ids(out) == [("r0", 1), ("r1", 8), ("r2", 20)]
    for _ in range(100):
        out, _ = _step(scheduler)
        assert 0 < out.num_tokens <= 32
        if not scheduler.has_unfinished:
            break
    assert scheduler.pool.num_used_pages == 0


def test_max_num_seqs_is_respected():
    """At most max_num_seqs requests run (and are scheduled) at once, however large the budget."""
    scheduler = _scheduler(max_num_seqs=2, max_num_batched_tokens=64)
    requests = [_request(f"r{i}", 3, max_tokens=1 + i % 3, first_token=10 * i) for i in range(6)]
    for request in requests:
        scheduler.add_request(request)
    for steps in range(1, 100):
        out, _ = _step(scheduler)
        assert len(out.scheduled) <= 2 and len(scheduler.running) <= 2
        if not scheduler.has_unfinished:
            break
    assert all(r.status is RequestStatus.FINISHED_LENGTH for r in requests)
    assert [len(r.output_token_ids) for r in requests] == [1 + i % 3 for i in range(6)]
    assert steps >= 6


@pytest.mark.parametrize(
    "params, eos, tokens, num_out, status, stop_reason",
    [
        (dict(max_tokens=10), (9,), [5, 5, 9, 5], 3, RequestStatus.FINISHED_STOPPED, 9),
        (dict(max_tokens=10, stop_token_ids=[6]), (9,), [5, 6, 5], 2, RequestStatus.FINISHED_STOPPED, 6),
        (dict(max_tokens=3), (9,), [5, 5, 5, 5], 3, RequestStatus.FINISHED_LENGTH, None),
        (dict(max_tokens=4, ignore_eos=True), (9,), [9, 9, 9, 9, 9], 4, RequestStatus.FINISHED_LENGTH, None),
        (dict(max_tokens=10, min_tokens=3), (9,), [9, 9, 9, 5], 3, RequestStatus.FINISHED_STOPPED, 9),
        (dict(max_tokens=10, min_tokens=2, stop_token_ids=[6]), (), [6, 6, 5], 2,
         RequestStatus.FINISHED_STOPPED, 6),
        (dict(max_tokens=10, ignore_eos=True, stop_token_ids=[6]), (9,), [9, 6], 2,
         RequestStatus.FINISHED_STOPPED, 6),
    ],
    ids=["eos", "stop_token_ids", "max_tokens", "ignore_eos", "min_tokens_suppresses_eos",
         "min_tokens_suppresses_stop_ids", "ignore_eos_keeps_stop_ids"],
)
def test_requests_finish_for_the_right_reason(params, eos, tokens, num_out, status, stop_reason):
    """EOS, stop_token_ids and max_tokens end a request (min_tokens suppresses the first two); pages freed."""
    max_tokens = params.pop("max_tokens")
    scheduler = _scheduler(max_num_seqs=2, max_num_batched_tokens=32)
    request = _request("r", 5, max_tokens=max_tokens, eos=eos, **params)
    scheduler.add_request(request)
    for token in tokens:
        if request.status.is_finished:
            break
        _step(scheduler, token)
    assert request.output_token_ids == tokens[:num_out]
    assert request.status is status and request.stop_reason == stop_reason
    assert request.finish_reason == status.value
    assert not scheduler.has_unfinished and scheduler.pool.num_used_pages == 0


def test_abort_frees_pages_of_running_and_waiting_requests():
    """Aborting a running (mid-prefill or decoding) or waiting request frees its pages, drops it from
    the queues, and a step that was in flight when it was aborted adds nothing to it."""
    scheduler = _scheduler(num_pages=16, max_num_seqs=2, max_num_batched_tokens=16)
    decoding = _request("decoding", 3, max_tokens=50, first_token=50)
    prefilling, waiting = _request("prefilling", 40, max_tokens=5), _request("waiting", 8, first_token=100)
    for request in (decoding, prefilling, waiting):
        scheduler.add_request(request)
    _step(scheduler)
    _step(scheduler)
    assert decoding.output_token_ids == [7, 7] and prefilling.num_computed_tokens == 13 + 15
    assert scheduler.pool.num_used_pages == 1 + 7 and waiting in scheduler.waiting

    # both aborted while the step ran (after advance(), before update_from_output()): its results are dropped
    out = scheduler.schedule()
    assert _ids(out) == [("decoding", 1), ("prefilling", 12)]  # the prompt's last chunk
    scheduler.advance(out)  # the step was launched
    scheduler.finish(decoding, RequestStatus.FINISHED_ABORTED)
    scheduler.finish(prefilling, RequestStatus.FINISHED_ABORTED)
    assert scheduler.update_from_output(out, [9] * len(out.scheduled)) == []
    assert decoding.output_token_ids == [7, 7] and prefilling.output_token_ids == []
    for request in (decoding, prefilling):
        assert request.status is RequestStatus.FINISHED_ABORTED and request.finish_reason == "abort"
        assert request.page_table == []
    assert scheduler.pool.num_used_pages == 0 and scheduler.running == []

    scheduler.finish(waiting, RequestStatus.FINISHED_ABORTED)
    assert waiting.status is RequestStatus.FINISHED_ABORTED
    assert not scheduler.has_unfinished and scheduler.pool.num_used_pages == 0
    assert scheduler.schedule().scheduled == []


def _fill_to_decode(scheduler: Scheduler, *requests: Request) -> None:
    """Admits `requests` (in this order, one step each) and runs their prompts to the first token."""
    for request in requests:
        scheduler.add_request(request)
        _step(scheduler)
        assert request.status is RequestStatus.RUNNING and request.output_token_ids


def test_preemption_victim_is_lowest_priority_then_most_recently_admitted():
    """Out of pages, the victim is the highest priority number; among equals, the latest admitted."""
    # 10 usable pages of 4 tokens; head is admitted first and crosses page boundaries first, so each
    # preemption happens while every other running request is still a candidate.
    scheduler = _scheduler(num_pages=11, max_num_seqs=8, max_num_batched_tokens=64, scheduling_policy="priority")
    head = _request("head", 4, max_tokens=50, priority=0)
    low = _request("low", 1, max_tokens=50, first_token=100, priority=2)  # admitted before mid1, mid2
    mid1 = _request("mid1", 1, max_tokens=50, first_token=200, priority=1)
    mid2 = _request("mid2", 1, max_tokens=50, first_token=300, priority=1)
    _fill_to_decode(scheduler, head, low, mid1, mid2)
    assert {r.request_id for r in scheduler.running} == {"head", "low", "mid1", "mid2"}
    victims = []
    for _ in range(100):
        if len(victims) >= 3:
            break
        out, _ = _step(scheduler)
        if out.preempted and not victims:
            assert mid2 in scheduler.running  # a more recent request was there to pick, and was spared
        victims += [r.request_id for r in out.preempted]
        assert head.status is RequestStatus.RUNNING and not head.status.is_finished
    # low goes first although admitted before mid1 and mid2; then the later of the two equals
    assert victims == ["low", "mid2", "mid1"]
    assert scheduler.num_preemptions == 3
    assert all(r.page_table == [] and r.num_computed_tokens == 0 for r in (low, mid1, mid2))
    assert all(r.status is RequestStatus.PREEMPTED and r.output_token_ids for r in (low, mid1, mid2))
    assert [r.request_id for r in scheduler.waiting] == ["mid1", "mid2", "low"]


def test_preemption_never_evicts_a_higher_priority_request_for_a_lower_one():
    """Priority holds under page pressure: a low-priority request is preempted before a high-priority one."""
    scheduler = _scheduler(num_pages=4, max_num_seqs=4, max_num_batched_tokens=64,
                           scheduling_policy="priority")  # 3 usable pages
    low = _request("low", 3, max_tokens=20, priority=5)
    high = _request("high", 4, max_tokens=20, first_token=100, priority=0)
    _fill_to_decode(scheduler, low)  # low runs alone first: it is admitted before high
    scheduler.add_request(high)
    _step(scheduler)  # high admitted (1 page); low still fits in its first page
    assert [r.request_id for r in scheduler.running] == ["low", "high"] and scheduler.pool.num_free_pages == 1
    out, _ = _step(scheduler)  # both need a 2nd page, one is left: someone must go, and it must be low
    assert [r.request_id for r in out.preempted] == ["low"]
    assert high.status is RequestStatus.RUNNING and ("high", 1) in _ids(out)


def test_fcfs_preempts_the_latest_admitted_whatever_the_priority():
    """Under fcfs, priority cannot force a preemption: out of pages, the most recently admitted goes."""
    scheduler = _scheduler(num_pages=4, max_num_seqs=4, max_num_batched_tokens=64)  # 3 usable pages
    first = _request("first", 3, max_tokens=20, priority=5)
    late = _request("late", 4, max_tokens=20, first_token=100, priority=-5)
    _fill_to_decode(scheduler, first)
    scheduler.add_request(late)
    _step(scheduler)
    assert [r.request_id for r in scheduler.running] == ["first", "late"] and scheduler.pool.num_free_pages == 1
    out, _ = _step(scheduler)  # both need a 2nd page, one is left: the later admitted goes
    assert [r.request_id for r in out.preempted] == ["late"]
    assert first.status is RequestStatus.RUNNING and ("first", 1) in _ids(out)


def test_preempted_request_is_readmitted_and_hits_its_own_cached_pages():
    """A preempted request keeps its output, is re-admitted later and recomputes only what was evicted."""
    scheduler = _scheduler(num_pages=6, max_num_seqs=4, max_num_batched_tokens=64)  # 5 usable pages
    first = _request("first", 8, max_tokens=4)
    second = _request("second", 8, max_tokens=4, first_token=100)
    scheduler.add_request(first)
    scheduler.add_request(second)
    _step(scheduler, token=11)  # both: 8-token prompts (2 full cached pages each) + 1 output token
    old_table = list(second.page_table)
    computed_before = scheduler.num_computed_prompt_tokens
    cached_before = scheduler.num_cached_prompt_tokens
    assert (computed_before, cached_before) == (16, 0)

    out, _ = _step(scheduler, token=12)  # first takes the last free page; second must go
    assert out.preempted == [second] and second.output_token_ids == [11]
    assert second.status is RequestStatus.PREEMPTED and second.num_computed_tokens == 0

    readmitted = None
    hits_before = None
    for _ in range(20):
        if readmitted is not None:
            break
        hits_before = scheduler.pool.num_hit_tokens
        out, _ = _step(scheduler, token=13)
        readmitted = dict(_ids(out)).get("second")
    assert first.status is RequestStatus.FINISHED_LENGTH  # it had to finish to make room
    # both full prompt pages were still cached: only the one token after them is recomputed
    assert second.page_table[:2] == old_table and readmitted == 1
    assert scheduler.pool.num_hit_tokens - hits_before == 8
    assert second.output_token_ids == [11, 13] and second.status is RequestStatus.RUNNING
    # the prompt is counted once, at first admission: a re-admission is neither "computed" nor "cached"
    assert scheduler.num_computed_prompt_tokens == computed_before
    assert scheduler.num_cached_prompt_tokens == cached_before
    _run(scheduler)
    assert len(second.output_token_ids) == 4 and scheduler.pool.num_used_pages == 0


def test_prefix_cache_stats_count_a_waiting_request_once():
    """prefix_cache_queries/hits count each admission once, not once per step a request waits for pages."""
    scheduler = _scheduler(num_pages=5, max_num_seqs=4, max_num_batched_tokens=64)  # 4 usable pages
    pool = scheduler.pool
    cached = _request("cached", 8, max_tokens=1)
    scheduler.add_request(cached)
    _run(scheduler)  # its 2 full pages stay cached
    hog = _request("hog", 9, max_tokens=3, first_token=100)  # 3 pages: only 1 is left
    scheduler.add_request(hog)
    _step(scheduler)
    waiter = Request("waiter", _tokens(8) + [50, 51, 52, 53, 54], SamplingParams(max_tokens=1), seed=0,
                     max_tokens=1)  # shares the cached prompt's first page; needs 4 pages in all
    queried, hits = pool.num_queried_tokens, pool.num_hit_tokens
    scheduler.add_request(waiter)
    steps_waited = 0
    for _ in range(10):
        out, _ = _step(scheduler)
        if waiter in [r for r, _ in out.scheduled]:
            break
        steps_waited += 1
    assert steps_waited >= 2 and waiter.num_cached_tokens == 4  # it did wait, then hit one page
    assert pool.num_hit_tokens - hits == waiter.num_cached_tokens
    assert pool.num_queried_tokens - queried == 12
