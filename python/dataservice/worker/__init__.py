"""The worker: runs the tasks the dispatcher gives it and serves their elements
(as tf.data service's worker). `WorkerServer` is the public name (re-exported by
`dataservice`).

Modules, one concern each:

- `server.py`: `WorkerServer`'s life (start, stop, join), registration and
  heartbeats with the dispatcher, dataset definitions, starting a runner per new
  task and stopping deleted ones.
- `serving.py`: GetElements and GetElementsStream (the "grpc" transfer protocol):
  finding a request's task and source (`element_source`, also what the worker's
  `TransferHost` gives every other protocol's server), taking its elements,
  encoding them into a reply, acknowledged replies and streaming in ~1 MiB messages.
- `sources.py`: which source serves a read (cross-trainer cache, coordinated
  round, or the task's first come, first served buffer): the one decision.
- `splits.py`: a DYNAMIC task's splits, fetched from the dispatcher in batches.
- `task_runner.py`: one task's runner (first come, first served, or coordinated
  rounds) and its prefetch thread.
- `unacked_replies.py`: a task's replies kept per consumer until acknowledged
  (resent on retry, given back to the task's buffer, cut for slow links); it
  imports no other module of the worker.
- `cross_trainer_cache.py`: the byte-bounded sliding window that trainers
  (`trainer_id`) share.

`server.py` imports the others; none of them imports `server.py` at run time.
"""
