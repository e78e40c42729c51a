"""The dispatcher: tf.data service's coordinator of datasets, jobs, iterations,
tasks and splits. Its public face is `DispatchServer` (re-exported by
`dataservice`).

Modules:

    server.py         DispatchServer: start, stop, join, recovery from the journal;
                      the gRPC servicer that routes each RPC to its handler
    base.py           the fields every handler shares (guarded by one lock, `_mu`),
                      the journaled write path `_apply_locked`, `_Worker`
    datasets.py       RegisterDataset, GetDatasetDef, GetElementSpec
    tasks.py          WorkerHeartbeat; task placement (which worker, which iteration)
    jobs.py           GetOrCreateJob, GetOrCreateIteration, ClientHeartbeat,
                      ReleaseIterationClient
    split_handout.py  GetSplits (DYNAMIC sharding), GetRounds (coordinated reads)
    worker_loss.py    ReportWorkerFailure; lost workers' splits; stranded iterations
    liveness.py       the maintenance thread: timeouts, probes, stall grace, job GC
    state.py          DispatcherState, changed only by `apply(update)`
    journal.py        the update log and snapshots in work_dir, replayed on restart
    journal_codec.py  updates and snapshots <-> records
    buffer_store.py   big dataset buffers as files, shared with same-host workers
    work_dir.py       the files of work_dir: checked names, atomic writes

`DispatchServer` is one class made of the handler mixins (datasets.py to
liveness.py), each over `base.DispatcherBase`'s state; each module's docstring
says which fields it reads and writes.
"""
