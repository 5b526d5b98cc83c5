"""Global-model algorithms whose client update is one :class:`~fedml_ssfl.stacked.LocalJob`.

Such an algorithm writes two halves of its client update, :meth:`JobAlgorithm.local_job` (from
the message, data and state: where the client starts, how it draws its batches, its step loss; or
a :class:`~fedml_ssfl.algorithms.base.Message` to reply without training) and
:meth:`JobAlgorithm.client_reply` (from the trained result: the reply, and what goes into the
client's state). State that the job itself is built from may be updated in ``local_job`` (FedSEAL's
self-ensemble); what training produces goes into the state in ``client_reply``. The base class
joins the halves two ways:

* :meth:`~JobAlgorithm.client_update`: one client, trained by
  :func:`~fedml_ssfl.stacked.run_job` (``torch.optim.SGD``, one step after another);
* :meth:`~JobAlgorithm.client_updates_stacked`: a round's clients trained together by
  :func:`~fedml_ssfl.stacked.run_stacked` (``train_args.stack_clients: true``).

The maths is the same either way; only the summation order of the batched kernels differs.
"""

from __future__ import annotations

from typing import Any, ClassVar

from ..stacked import JobResult, LocalJob, run_job, run_stacked
from .base import ClientContext, ClientData, Message
from .global_model import GlobalModelAlgorithm


class JobAlgorithm(GlobalModelAlgorithm):
    """A :class:`GlobalModelAlgorithm` whose client trains one :class:`~fedml_ssfl.stacked.LocalJob`."""

    stackable: ClassVar[bool] = True

    def local_job(
        self, msg: Message, data: ClientData, state: dict[str, Any], ctx: ClientContext
    ) -> LocalJob | Message | None:
        """The client's local training as a job; a :class:`Message` to reply without training (e.g.
        with metrics only), None to reply empty (nothing to train on)."""
        raise NotImplementedError

    def client_reply(
        self, job: LocalJob, result: JobResult, msg: Message, data: ClientData, state: dict[str, Any]
    ) -> Message:
        """The reply from the trained ``result``; also updates the client's ``state`` in place."""
        raise NotImplementedError

    def client_update(self, msg: Message, data: ClientData, state: dict, ctx: ClientContext) -> Message:
        job = self.local_job(msg, data, state, ctx)
        if not isinstance(job, LocalJob):
            return Message() if job is None else job
        model = self.scratch_model(job.weights, ctx.device)
        follower = None if job.follower is None else self.scratch_model(job.follower.weights, ctx.device, "follower")
        return self.client_reply(job, run_job(job, model, self.train, ctx.round_idx, follower), msg, data, state)

    def client_updates_stacked(
        self, work: dict[int, tuple[Message, ClientData, dict[str, Any]]], ctx: ClientContext, max_stack: int = 0
    ) -> dict[int, Message]:
        jobs = {k: self.local_job(msg, data, state, ctx) for k, (msg, data, state) in work.items()}
        live = [k for k, job in jobs.items() if isinstance(job, LocalJob)]
        replies = {k: job if isinstance(job, Message) else Message() for k, job in jobs.items()}
        if live:
            model = self.scratch_model(jobs[live[0]].weights, ctx.device)
            results = run_stacked([jobs[k] for k in live], model, self.train, ctx.round_idx, max_stack)
            for k, result in zip(live, results):
                msg, data, state = work[k]
                replies[k] = self.client_reply(jobs[k], result, msg, data, state)
        return replies
