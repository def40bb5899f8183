"""Offload job bookkeeping of the host tier (pdxfer.vllm.scheduler.offload_jobs): complete only when every
TP rank answered, failed on any rank's failure or after the answer bound."""

from __future__ import annotations

import pytest

from pdxfer.vllm.metadata import PdxferWorkerMeta
from pdxfer.vllm.scheduler.offload_jobs import OffloadJobs


def test_a_job_completes_when_every_rank_reported_it_over_steps():
    jobs = OffloadJobs(tp_size=2, answer_bound_s=10.0)
    j = jobs.queue(b"k", (4, 5), (0, 1))
    assert jobs.take(now=0.0) == [j] and jobs.take(now=0.0) == []
    assert jobs.answer(PdxferWorkerMeta({j.job_id: 1}, {})) == []  # one rank of two
    assert jobs.pending()
    out = jobs.answer(PdxferWorkerMeta({j.job_id: 1}, {}))
    assert [(o.key, o.why) for o in out] == [(b"k", "")] and not jobs.pending()
    assert jobs.answer(PdxferWorkerMeta({j.job_id: 1}, {})) == []  # late duplicates are ignored


def test_any_failure_or_silence_past_the_bound_fails_the_job():
    jobs = OffloadJobs(tp_size=2, answer_bound_s=1.0)
    a = jobs.queue(b"a", (1,), (0,))
    b = jobs.queue(b"b", (2,), (1,))
    jobs.take(now=100.0)
    jobs.answer(PdxferWorkerMeta({a.job_id: 1}, {}))
    out = jobs.answer(PdxferWorkerMeta({}, {a.job_id: "copy failed"}))
    assert [(o.key, o.why) for o in out] == [(b"a", "copy failed")]
    assert jobs.expire(now=100.5) == []
    late = jobs.expire(now=101.5)
    assert [o.key for o in late] == [b"b"] and "within 1 s" in late[0].why and not jobs.pending()
    assert jobs.answer(None) == []


def test_a_queued_job_never_expires_before_it_was_sent_and_bad_jobs_are_refused():
    jobs = OffloadJobs(tp_size=1, answer_bound_s=0.0)
    jobs.queue(b"a", (1,), (0,))
    assert jobs.expire(now=1e9) == [] and jobs.pending()
    with pytest.raises(ValueError, match="one block per slot"):
        jobs.queue(b"b", (1, 2), (0,))


def test_an_outcome_carries_the_time_from_queueing_to_its_end():
    """What vllm:pdxfer_offload_seconds shows: a copy queued behind steps that took their time is
    timed from the queue, not from the step that sent it."""
    jobs = OffloadJobs(tp_size=2, answer_bound_s=5.0)
    done = jobs.queue(b"d", (1,), (0,), now=10.0)
    late = jobs.queue(b"l", (2,), (1,), now=10.5)
    jobs.take(now=12.0)
    jobs.answer(PdxferWorkerMeta({done.job_id: 1}, {}), now=12.1)
    out = jobs.answer(PdxferWorkerMeta({done.job_id: 1}, {}), now=12.25)
    assert [(o.key, o.why, o.seconds) for o in out] == [(b"d", "", pytest.approx(2.25))]
    (gone,) = jobs.expire(now=17.5)
    assert gone.key == b"l" and gone.why and gone.seconds == pytest.approx(7.0)
