"""A named job nobody reads any more is replaced at once by a new pipeline under
its name (issue 10, item 8); a job still read is refused with a message that
says what reads it and how to proceed."""

from __future__ import annotations

import re

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


def test_a_released_iterator_frees_the_name(cluster):
    it = iter(named(old(), cluster))
    assert int(next(it)) == 0
    it.close()  # released: the iteration is unfinished, but nobody reads it
    assert [int(x) for x in named(edited(), cluster)] == [0, 10, 20, 30, 40]


def test_other_parameters_replace_a_finished_job_too(cluster):
    assert [int(x) for x in named(old(), cluster)] == [0, 1, 2, 3, 4]
    dynamic = old().apply(
        ds.distribute(ds.ShardingPolicy.DYNAMIC, cluster.target, job_name="train")
    )
    assert sorted(int(x) for x in dynamic) == [0, 1, 2, 3, 4]


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
    assert "iterators closed" in text
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
