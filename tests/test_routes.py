"""Where a ``num_workers=0`` batch is made (``_threads._routes``): the route policy alone, pure,
fed with times and asked for routes, and the settings that allow each route. No loop, no thread:
what the routes do to a running loader is ``test_inline``'s."""

from __future__ import annotations

import pytest
from helpers import build_config

from aioloader._threads import RoutePolicy, epoch_makes, skips_thread
from aioloader._threads._routes import INLINE_AFTER, INLINE_BACKOFF_STALLS
from aioloader._types import Route

CHEAP_S = 0.001
COSTLY_S = 0.01
BETWEEN_S = (CHEAP_S + COSTLY_S) / 2


def policy() -> RoutePolicy:
    return RoutePolicy(cheap_below_s=CHEAP_S, costly_above_s=COSTLY_S)


def routes(p: RoutePolicy) -> tuple[Route, Route]:
    """(the loop's route, the caller's route) for the next batch."""
    return p.route(on_loop=True), p.route(on_loop=False)


def test_a_new_policy_sends_the_loops_batches_to_the_thread_and_lets_the_caller_make_its_own() -> (
    None
):
    # The loop does not know yet that batches are cheap; the caller's thread stalls no loop.
    assert routes(policy()) == (Route.THREAD, Route.CALLER)


def test_the_loop_makes_batches_after_a_run_of_cheap_ones_and_leaves_at_a_costly_one() -> None:
    p = policy()
    for _ in range(INLINE_AFTER - 1):
        p.record(CHEAP_S / 2, Route.THREAD)
    assert routes(p) == (Route.THREAD, Route.CALLER)
    p.record(BETWEEN_S, Route.THREAD)  # neither cheap nor costly: the run starts again
    for _ in range(INLINE_AFTER - 1):
        p.record(CHEAP_S / 2, Route.THREAD)
    assert routes(p) == (Route.THREAD, Route.CALLER)
    p.record(CHEAP_S / 2, Route.THREAD)
    assert routes(p) == (Route.LOOP, Route.CALLER)
    p.record(COSTLY_S * 2, Route.LOOP)
    assert routes(p) == (Route.THREAD, Route.THREAD)
    # One cheap batch after it: the caller makes its own again, the loop needs a new run.
    p.record(CHEAP_S / 2, Route.THREAD)
    assert routes(p) == (Route.THREAD, Route.CALLER)


def test_a_batch_between_cheap_and_costly_keeps_the_route_it_found() -> None:
    p = policy()
    for _ in range(INLINE_AFTER):
        p.record(CHEAP_S / 2, Route.LOOP)
    p.record(BETWEEN_S, Route.LOOP)
    assert routes(p) == (Route.LOOP, Route.CALLER)


def test_each_stall_of_the_loop_makes_the_run_of_cheap_batches_needed_16_times_longer() -> None:
    # A sample that is slow now and then (a cache miss) stalled the loop once per slow sample:
    # after 4 cheap batches the loop made them again, and met the next slow one.
    p = policy()

    def loop_route_after(batches: int) -> Route:
        for _ in range(batches):
            p.record(CHEAP_S / 2, Route.LOOP)
        return p.route(on_loop=True)

    assert loop_route_after(INLINE_AFTER) is Route.LOOP
    lengths = [INLINE_AFTER * 16, INLINE_AFTER * 256, INLINE_AFTER * 4096]
    assert len(lengths) == INLINE_BACKOFF_STALLS
    for stall, needed in enumerate(lengths):
        p.record(COSTLY_S * 2, Route.LOOP)
        assert (p.loop_stalls, p.needed) == (stall + 1, needed)
        assert loop_route_after(needed - 1) is Route.THREAD
        assert loop_route_after(1) is Route.LOOP
    p.record(COSTLY_S * 2, Route.LOOP)  # no longer than that, however many
    assert loop_route_after(INLINE_AFTER * 4096 - 1) is Route.THREAD
    assert loop_route_after(1) is Route.LOOP


@pytest.mark.parametrize("route", [Route.CALLER, Route.THREAD])
def test_a_costly_batch_off_the_loop_stalls_no_loop_and_needs_no_longer_run(route: Route) -> None:
    p = policy()
    for _ in range(INLINE_AFTER):
        p.record(CHEAP_S / 2, route)
    p.record(COSTLY_S * 2, route)
    assert (p.loop_stalls, p.needed) == (0, INLINE_AFTER)
    for _ in range(INLINE_AFTER):
        p.record(CHEAP_S / 2, route)
    assert routes(p) == (Route.LOOP, Route.CALLER)


def test_a_costly_batch_on_the_loop_before_it_was_cheap_is_no_stall() -> None:
    # Only a batch the policy sent to the loop stalls it there: a costly batch made on the loop
    # while the policy said THREAD (another epoch's consumer that had not heard yet) is not one.
    p = policy()
    p.record(COSTLY_S * 2, Route.LOOP)
    assert (p.loop_stalls, p.needed) == (0, INLINE_AFTER)


def test_the_thresholds_and_the_run_are_the_policys_own() -> None:
    p = RoutePolicy(cheap_below_s=1.0, costly_above_s=5.0, cheap_run=2)
    p.record(0.5, Route.THREAD)
    assert p.route(on_loop=True) is Route.THREAD
    p.record(0.5, Route.THREAD)
    assert p.route(on_loop=True) is Route.LOOP
    p.record(4.0, Route.LOOP)  # not costly by these thresholds
    assert routes(p) == (Route.LOOP, Route.CALLER)
    p.record(6.0, Route.LOOP)
    assert (routes(p), p.needed) == ((Route.THREAD, Route.THREAD), 2 << 4)


def test_the_settings_that_let_batches_skip_the_helper_thread() -> None:
    assert skips_thread(build_config())
    assert not skips_thread(build_config(timeout=5))  # a batch made inline cannot be abandoned
    assert not skips_thread(build_config(num_workers=2))  # worker processes make them
    assert not skips_thread(build_config(num_workers=2, thread_pool=True))  # several threads
    assert not skips_thread(build_config(kind="async_map"))  # fetched on the loop, decoded off
    assert not skips_thread(build_config(kind="iterable"))  # one stream, on the thread


def test_the_settings_that_let_an_epoch_make_its_batches_itself() -> None:
    assert epoch_makes(build_config(), device=False)
    assert not epoch_makes(build_config(), device=True)  # the hand-over starts the copies
    assert not epoch_makes(build_config(max_retries=1), device=False)  # retries need a task
    assert not epoch_makes(build_config(timeout=5), device=False)  # nor may they skip it
