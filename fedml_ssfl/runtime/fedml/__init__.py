"""The FedML runtime: any registered algorithm as a FedML cross-silo server and clients.

``fedml-ssfl run --cf CONFIG`` with ``comm_args.backend: MPI`` (under ``mpirun -np C_k+1``) or
``GRPC`` (one process per host, ``--rank N --role server|client``) lands in :func:`run_fedml`.
FedML 0.9.6 honours custom trainers only in ``training_type: cross_silo`` (see
docs/deploy.md); there rank 0 is the server and ranks 1..C_k are workers, and FedML's server
manager tells each worker, every round, which data silo (client id) it trains.

How the pieces map onto FedML
-----------------------------
* :class:`ServerRuntime` (no FedML in it) is the server half of a round:
  :meth:`~ServerRuntime.begin_round` samples the C_k silos with the ONE seeded sampler
  (:func:`fedml_ssfl.sampling.sample_clients`, via :func:`.common.start_round`), runs the
  algorithm's server step and ``message_for`` each silo, and returns one payload per silo;
  :meth:`~ServerRuntime.finish_round` checks the replies, calls ``aggregate`` and records
  the round exactly as the local runtime does (:class:`.common.RunRecorder`).
* FedML's ``ServerAggregator`` subclass returns those payloads as a plain ``dict`` keyed by silo
  id -- FedML then sends each worker its own entry (group models, thresholds, helper weights all
  travel this way). Its ``FedMLAggregator`` subclass routes silos to workers
  (``data_silo_selection``) following the runtime's plan.
* FedML's ``ClientTrainer`` subclass hands each payload to a :class:`ClientWorker`, which calls
  the algorithm's ``client_update`` on the silo named in the payload.

Per-silo client state
---------------------
``client_update`` mutates a persistent per-client ``state`` dict (EMA nets, ensembles,
sigma/psi). When K > C_k a worker serves different silos across rounds, so state belongs to the
silo, not the process. Each worker caches the states of the silos it served, tagged with the
round they were last updated (under ``device_args.state_memory_mb`` a spilling store:
:func:`.worker.worker_state_cache`); the server keeps the authoritative copy of every silo's state
(what checkpoints store, in the local runtime's format). Silos are routed back to the worker that
holds their newest state when possible (:func:`assign_silos`); when a silo moves, its state is
fetched from its holder the round before (``upload`` requests) and shipped with the payload.
At checkpoint rounds every stale state is uploaded, so checkpoints are complete and ``--resume``
works across any routing. State bytes are counted apart from the algorithm's message bytes.

Faults
------
A client whose ``client_update`` raises replies with the error; the server stops the run at
once naming the rank and the silo, writes ``summary.json`` (``failed``), tells the workers to
finish and exits non-zero; the last checkpoint is untouched (atomic writes). A worker process
that dies: under ``mpirun`` the launcher terminates the job and the server records which ranks
and silos it was waiting for; under GRPC the processes exchange heartbeats, a peer may be silent
for ``FEDML_SSFL_OUTAGE_BUDGET`` seconds (a cut link, a restart: a restarted process rejoins
through the handshake) and the run fails naming it and the cause when it stays silent longer.
A round with no complete reply within ``FEDML_SSFL_ROUND_TIMEOUT``
seconds fails the same way. A malformed reply (unknown or missing keys, wrong shapes, NaN/inf)
is refused with a warning naming rank, silo and reason, and counts as an empty reply (the
algorithms already handle clients with nothing to send) unless the algorithm sets
``requires_all_replies = True``.

Offline
-------
FedML's cloud config fetch is replaced before ``fedml.init``, MLOps and wandb stay off, FedML's
network diagnostics are skipped, and :mod:`.offline` refuses any socket outside loopback and the
configured GRPC peers.

Modules
-------
:mod:`.launch` (config and environment -> ranks, ports, timeouts, FedML args), :mod:`.payloads`
(what crosses the wire, and the reply checks), :mod:`.server` and :mod:`.worker` (the two halves of
a round, no FedML in them), :mod:`.wire` (the codec, no pickle) and :mod:`.security` (sealed GRPC
envelopes, sessions, TLS, membership), :mod:`.delivery` (a peer's outbox) and :mod:`.diagnose` (why
a peer is unreachable), :mod:`.transports` and :mod:`.managers` (FedML's classes, subclassed),
:mod:`.hooks` (the public trainer and aggregator for ``FedMLRunner``), :mod:`.run` (:func:`run_fedml`).
Only :mod:`.transports`, :mod:`.managers` and :mod:`.hooks` import ``fedml``, ``mpi4py`` or ``grpc``
at module level, and nothing imports them until a FedML job starts.
"""
