"""A named job nobody reads any more is replaced at once by a new pipeline under
its name (issue 10, item 8); a job still read is refused with a message that
says what reads it and how to proceed."""

from __future__ import annotations

import re
import time

import pytest

import dataservice as ds
from dataservice import errors
from dataservice.rpc import service_pb2 as pb

pytestmark = pytest.mark.timeout(60)


def named(dataset, cluster, name="train", **kw):
    return dataset.apply(ds.distribute(ds.ShardingPolicy.OFF, cluster.target, job_name=name, **kw))


def old():
    return ds.Dataset.range(5)


def edited():
    return ds.Dataset.range(5).map(lambda x: x * 10)


def test_a_finished_job_is_replaced_at_once_by_an_edited_pipeline(cluster):
    assert [int(x) for x in named(old(), cluster)] == [0, 1, 2, 3, 4]
    # No job GC in between (its default timeout is minutes): the name is free now.
    assert [int(x) for x in named(edited(), cluster)] == [0, 10, 20, 30, 40]
    jobs = cluster.dispatcher._state.jobs
    retired = [j for j in jobs.values() if j.retired]
    assert len(retired) == 1 and retired[0].job_name == "train"
    live = cluster.dispatcher._state.live_job_named("train")
    assert live is not None and not live.retired and live.job_id != retired[0].job_id


def test_an_unfinished_iteration_keeps_the_name_until_job_gc(make_cluster):
    """A consumer that stopped before the end leaves an unfinished iteration (a
    cross-trainer cache's, say, which other trainers may still join): the job
    keeps its name until job GC collects it."""
    cluster = make_cluster(1, job_gc_timeout_ms=1_000, job_gc_check_interval_ms=100)
    it = iter(named(old(), cluster))
    assert int(next(it)) == 0
    it.close()  # released before the end
    with pytest.raises(errors.InvalidArgumentError) as info:
        next(iter(named(edited(), cluster)))
    text = str(info.value)
    job = cluster.dispatcher._state.jobs[min(cluster.dispatcher._state.jobs)]
    (iteration_id,) = job.iterations.values()
    assert f"iteration {iteration_id} (repetition 0) did not finish, and no consumer" in text
    assert "job_gc_timeout_ms (1000 ms)" in text and "another job_name" in text
    deadline = time.monotonic() + 20
    while not job.garbage_collected:
        assert time.monotonic() < deadline, "job GC did not collect the abandoned job"
        time.sleep(0.05)
    assert [int(x) for x in named(edited(), cluster)] == [0, 10, 20, 30, 40]


def test_a_new_pipeline_with_other_parameters_replaces_a_finished_job(cluster):
    assert [int(x) for x in named(old(), cluster)] == [0, 1, 2, 3, 4]
    dynamic = edited().apply(
        ds.distribute(ds.ShardingPolicy.DYNAMIC, cluster.target, job_name="train")
    )
    assert sorted(int(x) for x in dynamic) == [0, 10, 20, 30, 40]


def test_other_parameters_alone_do_not_replace_a_job(cluster):
    """As tf.data service (and the conformance suite's JOB-07, TW-08, CACHE-15):
    the same dataset under the same name keeps its parameters."""
    assert [int(x) for x in named(old(), cluster)] == [0, 1, 2, 3, 4]
    dynamic = old().apply(
        ds.distribute(ds.ShardingPolicy.DYNAMIC, cluster.target, job_name="train")
    )
    with pytest.raises(errors.InvalidArgumentError) as info:
        list(dynamic)
    text = str(info.value)
    assert "processing mode (existing: OFF, requested: DYNAMIC) differ" in text
    assert "use another job_name" in text


def test_a_live_job_is_refused_saying_what_reads_it_and_how_to_proceed(cluster):
    it = iter(named(old(), cluster))
    assert int(next(it)) == 0
    with pytest.raises(errors.InvalidArgumentError) as info:
        next(iter(named(edited(), cluster)))
    text = str(info.value)
    assert "existing job with different parameters: dataset id" in text
    job = cluster.dispatcher._state.live_job_named("train")
    (iteration_id,) = job.iterations.values()
    (client_id,) = cluster.dispatcher._state.iterations[iteration_id].clients
    assert re.search(
        rf"iteration {iteration_id} \(repetition 0\) has 1 consumer\(s\) attached "
        rf"\(iteration client ids {client_id}\)",
        text,
    ), text
    assert "client_timeout_ms" in text and "another job_name" in text
    assert "closed or deleted" in text and "read to the end" in text
    # The old job is intact: its consumer reads on to the end.
    assert [int(x) for x in it] == [1, 2, 3, 4]
    # and now the name is free
    assert [int(x) for x in named(edited(), cluster)] == [0, 10, 20, 30, 40]


def test_a_late_reader_of_the_replaced_job_is_told_so(cluster):
    assert [int(x) for x in named(old(), cluster)] == [0, 1, 2, 3, 4]
    old_job = cluster.dispatcher._state.live_job_named("train")
    assert [int(x) for x in named(edited(), cluster)] == [0, 10, 20, 30, 40]
    new_job = cluster.dispatcher._state.live_job_named("train")
    request = pb.GetOrCreateIterationRequest(job_id=old_job.job_id, repetition=1)
    with pytest.raises(errors.NotFoundError) as info:
        cluster.dispatcher._get_or_create_iteration(request)
    assert f"was replaced by job {new_job.job_id}" in str(info.value)


def test_the_same_pipeline_still_joins_the_job(cluster):
    a = named(old(), cluster)
    b = named(old(), cluster)
    assert [int(x) for x in a] == [0, 1, 2, 3, 4]
    assert [int(x) for x in b] == []  # joined repetition 0, which `a` read (shared)
    assert not any(j.retired for j in cluster.dispatcher._state.jobs.values())
    assert len(cluster.dispatcher._state.jobs) == 1
