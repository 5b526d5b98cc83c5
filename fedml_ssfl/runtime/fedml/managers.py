"""FedML's cross-silo managers and aggregator, subclassed: the runtime's rounds, the handshake, faults and timeouts.

Imports FedML: import it only when a FedML job starts.

The handshake (both backends; under GRPC it also admits sessions, :mod:`.security`)::

    server --CHECK(challenge)--> worker --ONLINE(challenge, membership, proof)--> server
    server --WELCOME(challenge, worker's session)--> worker          (or FINISH(refused, ...))

The server sends a fresh challenge when it starts, to every worker not yet online every heartbeat
interval, in answer to an ONLINE that answers no challenge of its own (a worker's hello, or a
handshake captured from an earlier process), and to a worker whose transport says it does not know
this server (it restarted). A worker answers each challenge once. A worker admitted with a new
session after the first round (a silo restarted) *rejoins*: its next task carries an ``Intro`` and
it reloads its state saved after the last round the server completed. A server restarted with
``--resume`` is rejoined by the live workers the same way (every first task carries an ``Intro``).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import platform
import sys
import threading
import time
from typing import Any

from fedml.core.distributed.communication.message import Message as FedMessage
from fedml.cross_silo.client.fedml_client_master_manager import ClientMasterManager
from fedml.cross_silo.server.fedml_aggregator import FedMLAggregator
from fedml.cross_silo.server.fedml_server_manager import FedMLServerManager
from fedml.cross_silo.server.message_define import MyMessage

from ...errors import PROG, error_line
from .adapters import UPLOAD_KEY, SSFLAggregator, unwrap
from .payloads import encode
from .protocol import Failure, Finish, Reply
from .security import (
    membership_diff,
    new_challenge,
    proof,
)
from .server import ServerRuntime
from .transport import Transport, at
from .transports import (
    CHALLENGE,
    CLIENT_SESSION,
    FAILED,
    MEMBERSHIP,
    PROOF,
    REFUSED,
    SESSION,
    TRANSPORT,
    VERIFIED,
    WATCHDOG,
    WELCOME,
    make_comm,
)
from .wire import WireMeter

log = logging.getLogger(__name__)

CHALLENGES_KEPT = 32
"""Per worker, the newest challenges that may still be answered (each once). With a new challenge at
most every heartbeat interval (:meth:`SSFLServerManager.recheck`), an answer may take that many
intervals to come back: on a slow link the answers queue behind each other."""
LINGER_BEATS = 3
"""A process that fails before a peer joined keeps its port open this many heartbeat intervals, so
that the peer, diagnosing it (a TLS mismatch), can name the cause too."""


def is_finish(payload: Any) -> bool:
    return isinstance(payload, Finish)


class SSFLSiloAggregator(FedMLAggregator):
    """FedML's round driver, routing silos to workers by the runtime's plan."""

    def __init__(self, server_aggregator: SSFLAggregator, args, workers: int, device):
        super().__init__(None, None, 0, {}, {}, {}, workers, device, args, server_aggregator)
        self.runtime = server_aggregator.runtime

    def data_silo_selection(self, round_idx, client_num_in_total, client_num_per_round):
        return list(self.runtime.routing())

    def aggregate(self):
        # FedML's own version indexes dict results by position 0..n-1, not by silo id.
        model_list = [(self.sample_num_dict[i], self.model_dict[i]) for i in range(self.client_num)]
        payloads = self.aggregator.aggregate(model_list)
        return payloads, model_list, list(range(self.client_num))

    def test_on_server_for_all_clients(self, round_idx):
        pass  # evaluation happens in the runtime, as in the local runtime


def _dispatch(manager, msg_type, msg_params) -> bool:
    """FedML's ``receive_message`` without its KeyError on a type nobody handles: such a message
    (from a member of another version) is dropped with one line; False if it was."""
    handler = manager.message_handler_dict.get(msg_type)
    if handler is None:
        log.warning(
            "rank %d dropped a message of unknown type %r from rank %s",
            manager.rank,
            msg_type,
            msg_params.get_sender_id(),
        )
        return False
    handler(msg_params)
    return True


class SSFLServerManager(FedMLServerManager):
    """FedML's cross-silo server manager plus the handshake, rejoins and fault handling."""

    def __init__(self, args, aggregator, runtime: ServerRuntime, meter: WireMeter, limits, comm, size, backend):
        self.runtime, self.meter, self.limits = runtime, meter, limits
        self.failing = False
        self.fail_time = 0.0
        self.linger_until = 0.0  # after a failure, the port stays open this long for ranks that never joined
        self.dead: set[int] = set()
        self.finished: set[int] = set()
        self.refused: dict[int, str] = {}
        self.causes: dict[int, str] = {}  # rank -> a lasting reason it cannot join (TLS settings)
        self.challenges: dict[int, list[str]] = {}
        self.checked: dict[int, float] = {}  # rank -> when it was last sent a challenge
        security = getattr(args, "ssfl_security", None)
        self.job_key = security.key if security is not None else None
        self.t_start = time.monotonic()
        self._stop = threading.Event()
        super().__init__(args, aggregator, comm, 0, size, backend)

    def _init_manager(self):
        make_comm(self)

    @property
    def transport(self) -> Transport:
        """The manager's transport: all it uses of one is :class:`~.transport.Transport`."""
        return self.com_manager

    def register_message_receive_handlers(self):
        super().register_message_receive_handlers()
        self.register_message_receive_handler(WATCHDOG, self.handle_watchdog)
        self.register_message_receive_handler(TRANSPORT, self.handle_transport)

    def receive_message(self, msg_type, msg_params) -> None:
        try:
            _dispatch(self, msg_type, msg_params)
        except Exception as exc:  # a handler's error ends the run with its name, not the process
            self.fail(exc)

    def run(self):
        watchdog = threading.Thread(target=self._watch, name="ssfl-watchdog", daemon=True)
        watchdog.start()
        try:
            super().run()
        finally:
            self._stop.set()

    # -- the handshake --
    def send_message_check_client_status(self, receive_id, datasilo_index):
        self.check(int(receive_id))

    def check(self, rank: int) -> None:
        """Send ``rank`` a fresh challenge (its ONLINE must answer it)."""
        challenge = new_challenge()
        kept = self.challenges.setdefault(rank, [])
        kept.append(challenge)
        del kept[:-CHALLENGES_KEPT]
        self.checked[rank] = time.monotonic()
        message = FedMessage(MyMessage.MSG_TYPE_S2C_CHECK_CLIENT_STATUS, 0, rank)
        message.add_params(MyMessage.MSG_ARG_KEY_CLIENT_INDEX, str(rank - 1))
        message.add_params(CHALLENGE, challenge)
        self.send_message(message)

    def recheck(self, rank: int) -> None:
        """A new challenge for ``rank`` unless one went out within the heartbeat interval (at least 1 s):
        a challenge a second on a link whose round trip is longer queues the answers up without end."""
        if time.monotonic() - self.checked.get(rank, 0.0) >= max(1.0, self.limits.heartbeat):
            self.check(rank)

    def process_online_status(self, client_status, msg_params):
        if self.failing:
            return
        sender = int(msg_params.get_sender_id())
        challenge, session = msg_params.get(CHALLENGE), msg_params.get(SESSION) or ""
        if not isinstance(challenge, str) or challenge not in self.challenges.get(sender, ()):
            if challenge is not None:
                log.warning(
                    "rank %d answered a challenge this server did not send (a handshake of an earlier process, "
                    "or a replay): not admitted; it is sent a new one",
                    sender,
                )
            self.recheck(sender)
            return
        self.challenges[sender].remove(challenge)
        problem = self.admission(sender, msg_params, challenge, session)
        if problem:
            if self.refused.get(sender) != problem:
                log.error("rank %d refused: %s", sender, problem)
            self.refused[sender] = problem
            refusal = FedMessage(MyMessage.MSG_TYPE_S2C_FINISH, 0, sender)
            refusal.add_params(REFUSED, problem)
            refusal.add_params(CHALLENGE, challenge)
            refusal.add_params(CLIENT_SESSION, session)
            self.send_message(refusal)
            return
        self.refused.pop(sender, None)
        before = self.transport.admit(sender, session)
        welcome = FedMessage(WELCOME, 0, sender)
        welcome.add_params(CHALLENGE, challenge)
        welcome.add_params(CLIENT_SESSION, session)
        if self.is_initialized and before is not None and before != session:
            self.transport.clear_outbox(sender)  # what was queued for its old process
        self.send_message(welcome)
        if not self.is_initialized and not self.runtime.done:
            super().process_online_status(client_status, msg_params)
        elif before != session or not self.is_initialized:
            self.rejoin(sender)  # after the end (a server resumed on a finished run): told the end at once

    def admission(self, rank: int, msg_params, challenge: str, session: str) -> str:
        """Why rank ``rank``'s ONLINE handshake is refused ("" if it is admitted)."""
        theirs = msg_params.get(MEMBERSHIP)
        if msg_params.get(PROOF) != proof(self.job_key, self.args.ssfl_job, rank, theirs, challenge, session):
            return "its key proof does not match (another job key, or another version of fedml_ssfl)"
        differ = membership_diff(self.args.ssfl_membership, theirs, rank)
        if differ:
            return f"its config differs from the server's in {'; '.join(differ)}: start it with the server's config"
        return ""

    def rejoin(self, rank: int) -> None:
        """A worker came back as a new process after the first round: resend it the round's task (with
        an ``Intro``), or give the next one an ``Intro``."""
        rt = self.runtime
        silos = rt.routing()
        silo = silos[rank - 1] if 1 <= rank <= len(silos) else "?"
        if rt.done:  # it missed the end: tell it again
            self.send_message_diff_sync_model_to_client(rank, Finish(), silo)
            return
        try:
            task = rt.rejoin(rank)
        except RuntimeError as exc:
            self.fail(str(exc))
            return
        log.warning(
            "round %d: rank %d (silo %s) rejoined as a new process; it resumes from its state after round %d%s",
            rt.round + 1,
            rank,
            silo,
            rt.round,
            ", and is sent this round's task again" if task is not None else "",
        )
        if task is not None:
            self.send_message_diff_sync_model_to_client(rank, encode(task), task.silo)

    # -- the round --
    def handle_message_receive_model_from_client(self, msg_params):
        if self.failing:
            return
        payload = unwrap(msg_params.get(MyMessage.MSG_ARG_KEY_MODEL_PARAMS))
        sender = int(msg_params.get_sender_id())
        rt = self.runtime
        if not isinstance(payload, (Reply, Failure)):
            log.warning(
                "round %d: dropped rank %d's upload: a %s, not a reply of the protocol",
                rt.round + 1,
                sender,
                type(payload).__name__,
            )
            return
        if payload.round != rt.round or sender not in rt.awaiting:
            log.warning(
                "round %d: dropped rank %d's answer for round %d, which this round does not wait for "
                "(sent before a restart, or twice)",
                rt.round + 1,
                sender,
                payload.round + 1,
            )
            return
        if isinstance(payload, Failure):
            self.fail(rt.client_error(payload))
            return
        problem = rt.reply_problem(sender, payload)
        if problem is not None:  # a member's inconsistent reply: refused, the round waits for its answer
            log.warning("round %d: refused rank %d's reply: %s", rt.round + 1, sender, problem)
            return
        rt.received(sender)
        try:
            super().handle_message_receive_model_from_client(msg_params)
        except Exception as exc:
            self.fail(exc)

    def process_finished_status(self, client_status, msg_params):
        sender = int(msg_params.get_sender_id())
        if not (self.runtime.done or self.failing):
            log.warning(
                "round %d: dropped rank %d's FINISHED status: the run is not over", self.runtime.round + 1, sender
            )
            return
        self.finished.add(sender)
        self._maybe_finish()

    def _maybe_finish(self):
        if self.failing and time.monotonic() < self.linger_until:
            return  # the watchdog finishes once the linger is over
        if set(self.client_real_ids) <= self.finished | self.dead:
            self.finish()

    def finish(self):
        # FedML calls MPI.Finalize here; leaving it to mpi4py at exit lets one process run
        # several jobs in turn (and a failing run still report before MPI goes away).
        if self.transport.whole_job and self.failing and self.dead:
            # a rank that never answered (stalled: SIGSTOP, a hung update) would hold every
            # process in MPI_Finalize forever; the failed summary is written, so end the job
            self.force_stop()
        self._stop_transport()

    def _stop_transport(self, drain: float | None = None) -> None:
        self.transport.stop_receive_message(self.limits.grace if drain is None else drain)

    # -- faults --
    def fail(self, error) -> None:
        if self.failing:
            return
        self.failing, self.fail_time = True, time.monotonic()
        failure = self.runtime.fail(error)
        log.error("%s", failure)
        for rank in self.client_real_ids:
            if self.transport.admitted(rank) is None:
                self.dead.add(rank)  # never admitted: it cannot take a message of the run
                # but it may be diagnosing this port (a TLS mismatch): stay up a moment, so it can say why
                self.linger_until = self.fail_time + LINGER_BEATS * self.limits.heartbeat
            if rank in self.dead:
                continue
            notice = FedMessage(MyMessage.MSG_TYPE_S2C_FINISH, 0, rank)
            notice.add_params(FAILED, str(failure))
            try:
                self.send_message(notice)
            except Exception:
                self.dead.add(rank)
        self._maybe_finish()

    def describe_rank(self, rank: int) -> str:
        silos = self.runtime.routing()
        silo = silos[rank - 1] if 1 <= rank <= len(silos) else "?"
        return f"rank {rank} (silo {silo}){at(self.transport, rank)}"

    def handle_transport(self, msg_params):
        """What the transport found: a message given up, or a worker that does not know this server."""
        event, peer = msg_params.get("event"), int(msg_params.get("peer"))
        if event == "unknown" and not self.failing:
            self.recheck(peer)  # it restarted (or this server did): the handshake again
            return
        cause, label = msg_params.get("cause"), msg_params.get("label")
        if self.failing or self.runtime.done:  # the end could not be told: the run is over all the same
            self.dead.add(peer)
            self._maybe_finish()
            return
        if not self.is_initialized and msg_params.get("code") == "PERMISSION_DENIED":
            # a rank not yet admitted drops what this server seals (another job key): named with the
            # others at the connect timeout; a TLS mismatch, found by the transport, ends the start at once
            if peer not in self.refused:
                log.error("could not deliver %s to %s: %s", label, self.describe_rank(peer), cause)
            self.refused[peer] = f"could not deliver {label} to it: {cause}"
            return
        self.dead.add(peer)
        self.fail(f"round {self.runtime.round + 1}: could not deliver {label} to {self.describe_rank(peer)}: {cause}")

    def handle_watchdog(self, msg_params):
        action = msg_params.get("action")
        self.dead |= set(msg_params.get("dead") or ())
        if action == "fail":
            self.fail(msg_params.get("reason"))
            self._maybe_finish()
        elif action == "force":
            self.force_stop()
        elif action == "check" and not self.failing:
            for rank in msg_params.get("ranks") or ():
                self.check(int(rank))
        elif action == "finish" and self.failing:
            self._maybe_finish()
        elif action == "gone":
            log.warning(
                "the run is over; ranks %s did not acknowledge its end and were not heard from", sorted(self.dead)
            )
            self._maybe_finish()

    def force_stop(self):
        """Workers did not acknowledge the stop in time: end without waiting for them."""
        self.transport.abort_job(str(self.runtime.failure))  # where one process ends the whole job (MPI)
        self._stop_transport(drain=0.0)

    def _inject(self, **params):
        msg = FedMessage(WATCHDOG, 0, 0)
        for k, v in params.items():
            msg.add_params(k, v)
        self.transport.inject(msg)

    def _missing(self) -> list[int]:
        return [r for r in self.client_real_ids if not self.client_online_mapping.get(str(r))]

    def _why(self, rank: int) -> str:
        """The transport's reason ``rank`` is not heard from, or a fresh diagnosis of its port."""
        if not self.transport.liveness:
            return ""
        cause = self.transport.cause_of(rank)
        return f": {cause}" if cause else ""

    def _watch(self):
        limits, rt = self.limits, self.runtime
        last_check = time.monotonic()
        forced = reported = lingered = False
        while not self._stop.wait(0.5):
            now = time.monotonic()
            if self.failing:
                if not forced and now - self.fail_time > max(limits.grace, self.linger_until - self.fail_time):
                    forced = True
                    self._inject(action="force")
                elif self.linger_until and now >= self.linger_until and not lingered:
                    lingered = True
                    self._inject(action="finish")
                continue
            if reported:
                continue
            if rt.done and self.transport.liveness:  # the end was sent (or, resumed on a finished run, is sent to
                # each worker that comes back): a worker not heard from within the outage budget is let go
                gone = [
                    r
                    for r in self.client_real_ids
                    if r not in self.finished | self.dead
                    and now - self.transport.heard.get(r, self.t_start) > limits.outage
                ]
                if gone:
                    reported = True
                    self._inject(action="gone", dead=gone)
                elif not self.is_initialized and now - last_check >= limits.heartbeat:
                    last_check = now  # a worker still running answers a challenge, and is told the end
                    waiting = [r for r in self.client_real_ids if r not in self.finished | self.dead]
                    self._inject(action="check", ranks=waiting)
                continue
            if not self.is_initialized:
                missing = self._missing()
                if now - self.t_start > limits.connect:
                    refused = "".join(f"; rank {r} was refused: {why}" for r, why in sorted(self.refused.items()))
                    causes = "".join(f"; rank {r}{self._why(r)}" for r in missing if r not in self.refused)
                    reported = True
                    self._inject(
                        action="fail",
                        reason=f"ranks {missing} did not come online within {limits.connect:.0f} s "
                        f"(FEDML_SSFL_CONNECT_TIMEOUT){refused}{causes}",
                        dead=missing,
                    )
                elif self.transport.liveness and missing and now - last_check >= limits.heartbeat:
                    last_check = now
                    self._inject(action="check", ranks=missing)
                continue
            waiting = rt.outstanding()
            if waiting and now - rt.round_started > limits.round:
                reported = True
                self._inject(
                    action="fail",
                    reason=f"round {rt.round + 1}: no reply within {limits.round:.0f} s (FEDML_SSFL_ROUND_TIMEOUT) "
                    f"from {rt.describe(waiting)}",
                    dead=sorted(waiting),
                )
                continue
            if self.transport.liveness and waiting:
                for rank in waiting:
                    silent = now - self.transport.heard.get(rank, self.t_start)
                    if silent > limits.outage:
                        reported = True
                        self._inject(
                            action="fail",
                            reason=f"round {rt.round + 1}: {self.describe_rank(rank)} was not heard from for "
                            f"{silent:.0f} s (FEDML_SSFL_OUTAGE_BUDGET {limits.outage:.0f} s){self._why(rank)}",
                            dead=[rank],
                        )
                        break

    def on_terminate(self, signum, frame):
        """mpirun (or a scheduler) is ending the job: record who the round was waiting for."""
        waiting = self.runtime.outstanding()
        if self.runtime.failure is None and not waiting:
            # no task was out: the rank that ended the job (a worker's refusal) printed the one error line
            sys.stderr.write(
                f"{PROG}: the launcher ended the job (signal {signum}) before round {self.runtime.round + 1} "
                "was under way; the failing rank's error line above names why\n"
            )
            sys.stderr.flush()
            os._exit(1)
        if self.runtime.failure is None:
            self.runtime.fail(
                f"the job was terminated (signal {signum}) in round {self.runtime.round + 1} while the server "
                f"waited for {self.runtime.describe(waiting)}; a worker process died (the launcher's message "
                "names its rank)"
            )
        sys.stderr.write(error_line(str(self.runtime.failure)) + "\n")
        sys.stderr.flush()
        os._exit(1)


class SSFLClientManager(ClientMasterManager):
    """FedML's cross-silo client manager: the handshake, the server's ``finish`` payload ends the run,
    and a run that failed (here or on the server) ends this process with an error."""

    def __init__(self, args, adapter, meter: WireMeter, limits, comm, rank, size, backend):
        self.meter, self.limits = meter, limits
        self.refusal: str | None = None
        self.failure: str | None = None
        self.ending = False
        self.linger_until = 0.0
        self.joined = False
        self.last_heard = time.monotonic()
        self.t_start = time.monotonic()
        self.task_started = time.monotonic()
        self.hello_sent = 0.0
        self._stop = threading.Event()
        super().__init__(args, adapter, comm, rank, size, backend)
        self.num_rounds = 2**62  # the server decides when the run ends (resume-safe)

    def _init_manager(self):
        make_comm(self)

    @property
    def transport(self) -> Transport:
        """The manager's transport: all it uses of one is :class:`~.transport.Transport`."""
        return self.com_manager

    def register_message_receive_handlers(self):
        super().register_message_receive_handlers()
        self.register_message_receive_handler(WELCOME, self.handle_welcome)
        self.register_message_receive_handler(TRANSPORT, self.handle_transport)
        self.register_message_receive_handler(WATCHDOG, self.handle_watchdog)

    def finish(self):
        # MPI.Finalize is left to mpi4py at exit
        self.ending = True
        self.transport.stop_receive_message(FINISH_DRAIN)

    def receive_message(self, msg_type, msg_params) -> None:
        if msg_type not in (TRANSPORT, WATCHDOG):
            self.last_heard = time.monotonic()
        try:
            _dispatch(self, msg_type, msg_params)
        except Exception as exc:  # a handler's error: this process ends with it named
            self.fail_here(f"{type(exc).__name__}: {exc}")

    def fail_here(self, reason: str) -> None:
        """End this worker: it exits with ``reason`` (or the failure it already found)."""
        if self.ending or self.refusal is not None:
            return
        if self.failure is None:
            self.failure = reason
            log.error("rank %d: %s", self.rank, reason)
        self.finish()

    # -- the handshake --
    def handle_message_connection_ready(self, msg_params):
        if not self.has_sent_online_msg:
            self.has_sent_online_msg = True
            self.hello()

    def hello(self) -> None:
        """An ONLINE that answers no challenge: the server answers it with one."""
        self.hello_sent = time.monotonic()
        message = FedMessage(MyMessage.MSG_TYPE_C2S_CLIENT_STATUS, self.client_real_id, 0)
        message.add_params(MyMessage.MSG_ARG_KEY_CLIENT_STATUS, self.ONLINE_STATUS_FLAG)
        self.send_message(message)

    def handle_message_check_status(self, msg_params):
        challenge = msg_params.get(CHALLENGE)
        if not isinstance(challenge, str):
            return
        session = msg_params.get(SESSION) or ""
        if not self.transport.answer(challenge, session):
            log.warning("rank %d: a challenge it already answered came again (a replay): not answered", self.rank)
            return
        self.send_client_status(0, ClientMasterManager.ONLINE_STATUS_FLAG, challenge)

    def send_client_status(self, receive_id, status=ClientMasterManager.ONLINE_STATUS_FLAG, challenge=None):
        if status != ClientMasterManager.ONLINE_STATUS_FLAG:
            super().send_client_status(receive_id, status)
            return
        if challenge is None:
            self.hello()
            return
        # the handshake: this process's job config, rank, the server's challenge and a key proof
        message = FedMessage(MyMessage.MSG_TYPE_C2S_CLIENT_STATUS, self.client_real_id, receive_id)
        message.add_params(MyMessage.MSG_ARG_KEY_CLIENT_STATUS, status)
        message.add_params(MyMessage.MSG_ARG_KEY_CLIENT_OS, platform.system())
        security = getattr(self.args, "ssfl_security", None)
        key = security.key if security is not None else None
        mine = self.args.ssfl_membership
        session = self.transport.session
        message.add_params(MEMBERSHIP, mine)
        message.add_params(CHALLENGE, challenge)
        message.add_params(PROOF, proof(key, self.args.ssfl_job, self.rank, mine, challenge, session))
        self.send_message(message)

    def _verified(self, msg_params) -> bool:
        return not self.transport.sessions or msg_params.get(VERIFIED) is True

    def handle_welcome(self, msg_params):
        if not self._verified(msg_params):
            log.warning("rank %d dropped a welcome that answers none of its handshakes (a replay)", self.rank)
            return
        if self.joined:
            log.warning("rank %d: a new server process admitted it (the server restarted)", self.rank)
        self.joined = True

    def handle_message_finish(self, msg_params):
        refusal = msg_params.get(REFUSED)
        if refusal:  # not a member of this job: stop without reporting FINISHED
            if not self._verified(msg_params):
                log.warning("rank %d dropped a refusal that answers none of its handshakes (a replay)", self.rank)
                return
            self.refusal = refusal
            self.finish()
            return
        failed = msg_params.get(FAILED)
        if failed:
            self.failure = f"the run failed: {failed}"
        super().handle_message_finish(msg_params)

    # -- the round --
    def handle_message_init(self, msg_params):
        self.task_started = time.monotonic()
        if is_finish(msg_params.get(MyMessage.MSG_ARG_KEY_MODEL_PARAMS)):
            self.cleanup()
            return
        self.is_inited = False  # a server that restarted starts again with a first task
        super().handle_message_init(msg_params)

    def handle_message_receive_model_from_server(self, msg_params):
        self.task_started = time.monotonic()
        if is_finish(msg_params.get(MyMessage.MSG_ARG_KEY_MODEL_PARAMS)):
            self.cleanup()
            return
        super().handle_message_receive_model_from_server(msg_params)

    def send_model_to_server(self, receive_id, weights, local_sample_num):
        """The reply; a failure's traceback stays in this process's log (the server gets one line)."""
        upload = unwrap(weights)
        if isinstance(upload, Failure):
            if upload.traceback:
                log.error(
                    "rank %d (silo %d), round %d:\n%s", self.rank, upload.silo, upload.round + 1, upload.traceback
                )
            weights = {UPLOAD_KEY: dataclasses.replace(upload, traceback="")}
        elif isinstance(upload, Reply) and self.transport.liveness:  # a worker on a host of its own: its log says
            log.info(
                "rank %d (silo %d): round %d %s in %.2f s; reply sent",
                self.rank,
                upload.silo,
                upload.round + 1,
                "trained" if upload.trained else "idle",
                time.monotonic() - self.task_started,
            )
        super().send_model_to_server(receive_id, weights, local_sample_num)

    # -- faults --
    def handle_transport(self, msg_params):
        event = msg_params.get("event")
        if event == "unknown":  # the server does not know this process (it restarted): a hello
            if time.monotonic() - self.hello_sent >= 1.0:
                self.hello()
            return
        label, cause = msg_params.get("label"), msg_params.get("cause")
        reason = f"could not deliver {label} to the server (rank 0){at(self.transport, 0)}: {cause}"
        if not self.joined and self.failure is None:
            # the server may be diagnosing this process too (a TLS mismatch): stay up a moment
            self.failure = reason
            log.error("rank %d: %s", self.rank, reason)
            self.linger_until = time.monotonic() + LINGER_BEATS * self.limits.heartbeat
            return
        self.fail_here(reason)

    def handle_watchdog(self, msg_params):
        action = msg_params.get("action")
        if action == "fail":
            self.fail_here(msg_params.get("reason"))
        elif action == "hello" and not self.ending and not self.linger_until:
            self.hello()

    def run(self):
        if self.transport.liveness:
            threading.Thread(target=self._watch, name="ssfl-server-watchdog", daemon=True).start()
        try:
            super().run()
        finally:
            self._stop.set()

    def _inject(self, **params):
        msg = FedMessage(WATCHDOG, self.rank, self.rank)
        for k, v in params.items():
            msg.add_params(k, v)
        self.transport.inject(msg)

    def _watch(self):
        """With a transport's liveness only (GRPC; under mpirun the launcher ends the job when the server
        dies): stop when the server is not heard from for the outage budget (or, before it first admits
        this process, the connect timeout), or after FEDML_SSFL_IDLE_TIMEOUT without a message of the
        run. Between, send hellos while no server has admitted this process."""
        limits, comm = self.limits, self.transport
        where = at(comm, 0)
        told = None
        while not self._stop.wait(1.0):
            now = time.monotonic()
            reason = None
            if told is not None:
                if now - told > limits.grace:  # the message thread is busy (a long update): end anyway
                    sys.stderr.write(error_line(f"rank {self.rank}: {self.failure}; stopping") + "\n")
                    sys.stderr.flush()
                    os._exit(1)
                continue
            idle = now - self.last_heard
            if self.linger_until:
                if now >= self.linger_until:
                    told = now
                    self._inject(action="fail", reason=self.failure)
                continue
            if not self.joined:
                if now - self.t_start > limits.connect:
                    cause = comm.cause_of(0)
                    reason = (
                        f"the server (rank 0){where} did not admit this process within "
                        f"{limits.connect:.0f} s (FEDML_SSFL_CONNECT_TIMEOUT)" + (f": {cause}" if cause else "")
                    )
                elif now - self.hello_sent >= limits.heartbeat and comm.admitted(0) is None:
                    self._inject(action="hello")
            else:
                silent = now - comm.heard.get(0, self.t_start)
                if silent > limits.outage:
                    cause = comm.cause_of(0)
                    reason = (
                        f"the server (rank 0){where} was not heard from for {silent:.0f} s "
                        f"(FEDML_SSFL_OUTAGE_BUDGET {limits.outage:.0f} s)" + (f": {cause}" if cause else "")
                    )
                elif idle > limits.idle:
                    reason = f"heard nothing from the server (rank 0) for {idle:.0f} s (FEDML_SSFL_IDLE_TIMEOUT)"
            if reason:
                told = now
                self.failure = self.failure or reason
                self._inject(action="fail", reason=reason)


FINISH_DRAIN = 10.0
"""Seconds a worker waits, at its end, for its last messages (its FINISHED status) to go out."""
