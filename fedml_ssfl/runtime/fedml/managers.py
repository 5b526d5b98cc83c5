"""FedML's cross-silo managers and aggregator, subclassed: the runtime's rounds, the handshake, faults and timeouts.

Imports FedML: import it only when a FedML job starts.
"""

from __future__ import annotations

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

from ...errors import error_line
from .hooks import SSFLAggregator, unwrap
from .protocol import Failure, Finish
from .security import (
    membership_diff,
    proof,
)
from .server import ServerRuntime
from .transports import DeliveryError, grpc_reachable, make_comm
from .wire import WireMeter

log = logging.getLogger(__name__)

WATCHDOG = "ssfl_watchdog"
MEMBERSHIP, PROOF, REFUSED = "ssfl_membership", "ssfl_proof", "ssfl_refused"


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


class SSFLServerManager(FedMLServerManager):
    """FedML's cross-silo server manager plus fault handling (errors, deaths, timeouts)."""

    def __init__(self, args, aggregator, runtime: ServerRuntime, meter: WireMeter, limits, comm, size, backend):
        self.runtime, self.meter, self.limits = runtime, meter, limits
        self.failing = False
        self.fail_time = 0.0
        self.dead: set[int] = set()
        self.finished: set[int] = set()
        self.probe_failures: dict[int, int] = {}
        self.refused: dict[int, str] = {}
        security = getattr(args, "ssfl_security", None)
        self.job_key = security.key if security is not None else None
        self.t_start = time.monotonic()
        self._stop = threading.Event()
        super().__init__(args, aggregator, comm, 0, size, backend)

    def _init_manager(self):
        make_comm(self)

    def register_message_receive_handlers(self):
        super().register_message_receive_handlers()
        self.register_message_receive_handler(WATCHDOG, self.handle_watchdog)

    def run(self):
        watchdog = threading.Thread(target=self._watch, name="ssfl-watchdog", daemon=True)
        watchdog.start()
        try:
            super().run()
        finally:
            self._stop.set()

    # -- protocol --
    def process_online_status(self, client_status, msg_params):
        if self.is_initialized or self.failing:
            return  # FedML would send the first round again on a repeated ONLINE
        sender = int(msg_params.get_sender_id())
        problem = self.admission(sender, msg_params)
        if problem:
            if self.refused.get(sender) != problem:
                log.error("rank %d refused: %s", sender, problem)
            self.refused[sender] = problem
            refusal = FedMessage(MyMessage.MSG_TYPE_S2C_FINISH, 0, sender)
            refusal.add_params(REFUSED, problem)
            if hasattr(self.com_manager, "renew_channel"):  # GRPC: it is up, skip any reconnect backoff
                self.com_manager.renew_channel(sender)
            try:
                self.send_message(refusal)
            except Exception as exc:  # it stops by itself at its connect timeout
                log.warning("could not tell rank %d it was refused: %s", sender, exc)
            return
        self.refused.pop(sender, None)
        try:
            super().process_online_status(client_status, msg_params)
        except Exception as exc:
            self.fail(exc)

    def admission(self, rank: int, msg_params) -> str:
        """Why rank ``rank``'s ONLINE handshake is refused ("" if it is admitted)."""
        theirs = msg_params.get(MEMBERSHIP)
        if msg_params.get(PROOF) != proof(self.job_key, self.args.ssfl_job, rank, theirs):
            return "its key proof does not match (another job key)"
        differ = membership_diff(self.args.ssfl_membership, theirs, rank)
        if differ:
            return f"its config differs from the server's in {'; '.join(differ)}: start it with the server's config"
        return ""

    def handle_message_receive_model_from_client(self, msg_params):
        if self.failing:
            return
        payload = msg_params.get(MyMessage.MSG_ARG_KEY_MODEL_PARAMS)
        sender = int(msg_params.get_sender_id())
        if isinstance(unwrap(payload), Failure):
            self.fail(self.runtime.client_error(unwrap(payload)))
            return
        self.runtime.received(sender)
        try:
            super().handle_message_receive_model_from_client(msg_params)
        except Exception as exc:
            self.fail(exc)

    def process_finished_status(self, client_status, msg_params):
        self.finished.add(int(msg_params.get_sender_id()))
        self._maybe_finish()

    def _maybe_finish(self):
        if set(self.client_real_ids) <= self.finished | self.dead:
            self.finish()

    def finish(self):
        # FedML calls MPI.Finalize here; leaving it to mpi4py at exit lets one process run
        # several jobs in turn (and a failing run still report before MPI goes away).
        if self.backend == "MPI" and self.failing and self.dead:
            # a rank that never answered (stalled: SIGSTOP, a hung update) would hold every
            # process in MPI_Finalize forever; the failed summary is written, so end the job
            self.force_stop()
        self.com_manager.stop_receive_message()

    # -- faults --
    def fail(self, error) -> None:
        if self.failing:
            return
        if isinstance(error, DeliveryError):  # name the silo whose payload could not go out
            silos = self.runtime.routing()
            silo = silos[error.receiver - 1] if 1 <= error.receiver <= len(silos) else "?"
            self.dead.add(error.receiver)
            error = (
                f"round {self.runtime.round + 1}: rank {error.receiver} (silo {silo}) is unreachable at "
                f"{error.address} ({error.code}); its process died or lost the network"
            )
        self.failing, self.fail_time = True, time.monotonic()
        failure = self.runtime.fail(error)
        log.error("%s", failure)
        for rank in self.client_real_ids:
            if rank in self.dead:
                continue
            try:
                self.send_message(FedMessage(MyMessage.MSG_TYPE_S2C_FINISH, 0, rank))
            except Exception:
                self.dead.add(rank)
        self._maybe_finish()

    def handle_watchdog(self, msg_params):
        action = msg_params.get("action")
        self.dead |= set(msg_params.get("dead") or ())
        if action == "fail":
            self.fail(msg_params.get("reason"))
            self._maybe_finish()
        elif action == "force":
            self.force_stop()

    def force_stop(self):
        """Workers did not acknowledge the stop in time: end without waiting for them."""
        failure = self.runtime.failure
        if self.backend == "MPI":
            sys.stderr.write(error_line(str(failure)) + "\n")
            sys.stderr.flush()
            from mpi4py import MPI

            MPI.COMM_WORLD.Abort(1)
        self.com_manager.stop_receive_message()

    def _inject(self, **params):
        msg = FedMessage(WATCHDOG, 0, 0)
        for k, v in params.items():
            msg.add_params(k, v)
        self.com_manager.inject(msg)

    def _probe(self, rank: int) -> bool:
        return grpc_reachable(self.com_manager, rank)

    def _watch(self):
        limits, rt = self.limits, self.runtime
        last_probe = time.monotonic()
        forced = reported = False
        while not self._stop.wait(0.5):
            now = time.monotonic()
            if self.failing:
                if not forced and now - self.fail_time > limits.grace:
                    forced = True
                    self._inject(action="force")
                continue
            if reported:
                continue
            if not self.is_initialized:
                if now - self.t_start > limits.connect:
                    missing = [r for r in self.client_real_ids if not self.client_online_mapping.get(str(r))]
                    refused = "".join(f"; rank {r} was refused: {why}" for r, why in sorted(self.refused.items()))
                    reported = True
                    self._inject(
                        action="fail",
                        reason=f"ranks {missing} did not come online within {limits.connect:.0f} s "
                        f"(FEDML_SSFL_CONNECT_TIMEOUT){refused}",
                        dead=missing,
                    )
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
            if self.backend == "GRPC" and waiting and now - last_probe >= limits.probe:
                last_probe = now
                for rank, silo in waiting.items():
                    if self._probe(rank):
                        self.probe_failures[rank] = 0
                        continue
                    self.probe_failures[rank] = self.probe_failures.get(rank, 0) + 1
                    if self.probe_failures[rank] >= 2:
                        m = self.com_manager.grpc_mappings[rank]
                        reported = True
                        self._inject(
                            action="fail",
                            reason=f"round {rt.round + 1}: rank {rank} (silo {silo}) is unreachable at "
                            f"{m.grpc_server_ip}:{m.grpc_server_port}; its process died or lost the network",
                            dead=[rank],
                        )
                        break

    def on_terminate(self, signum, frame):
        """mpirun (or a scheduler) is ending the job: record who the round was waiting for."""
        waiting = self.runtime.outstanding()
        if self.runtime.failure is None:
            who = self.runtime.describe(waiting) if waiting else "no worker"
            self.runtime.fail(
                f"the job was terminated (signal {signum}) in round {self.runtime.round + 1} while the server "
                f"waited for {who}; a worker process died (the launcher's message names its rank)"
            )
        sys.stderr.write(error_line(str(self.runtime.failure)) + "\n")
        sys.stderr.flush()
        os._exit(1)


class SSFLClientManager(ClientMasterManager):
    """FedML's cross-silo client manager; the server's ``finish`` payload ends the run."""

    def __init__(self, args, adapter, meter: WireMeter, limits, comm, rank, size, backend):
        self.meter, self.limits = meter, limits
        self.refusal = None
        self.last_heard = time.monotonic()
        self._stop = threading.Event()
        super().__init__(args, adapter, comm, rank, size, backend)
        self.num_rounds = 2**62  # the server decides when the run ends (resume-safe)

    def _init_manager(self):
        make_comm(self)

    def finish(self):
        self.com_manager.stop_receive_message()  # MPI.Finalize is left to mpi4py at exit

    def receive_message(self, msg_type, msg_params) -> None:
        self.last_heard = time.monotonic()
        super().receive_message(msg_type, msg_params)

    def send_client_status(self, receive_id, status=ClientMasterManager.ONLINE_STATUS_FLAG):
        if status != ClientMasterManager.ONLINE_STATUS_FLAG:
            super().send_client_status(receive_id, status)
            return
        # the handshake: this process's job config, rank and key proof
        message = FedMessage(MyMessage.MSG_TYPE_C2S_CLIENT_STATUS, self.client_real_id, receive_id)
        message.add_params(MyMessage.MSG_ARG_KEY_CLIENT_STATUS, status)
        message.add_params(MyMessage.MSG_ARG_KEY_CLIENT_OS, platform.system())
        security = getattr(self.args, "ssfl_security", None)
        key = security.key if security is not None else None
        mine = self.args.ssfl_membership
        message.add_params(MEMBERSHIP, mine)
        message.add_params(PROOF, proof(key, self.args.ssfl_job, self.rank, mine))
        self.send_message(message)

    def handle_message_finish(self, msg_params):
        self.refusal = msg_params.get(REFUSED)
        if self.refusal:  # not a member of this job: stop without reporting FINISHED
            self.finish()
            return
        super().handle_message_finish(msg_params)

    def handle_message_init(self, msg_params):
        if is_finish(msg_params.get(MyMessage.MSG_ARG_KEY_MODEL_PARAMS)):
            self.cleanup()
            return
        super().handle_message_init(msg_params)

    def handle_message_receive_model_from_server(self, msg_params):
        if is_finish(msg_params.get(MyMessage.MSG_ARG_KEY_MODEL_PARAMS)):
            self.cleanup()
            return
        super().handle_message_receive_model_from_server(msg_params)

    def run(self):
        if self.backend == "GRPC":
            threading.Thread(target=self._watch, name="ssfl-server-watchdog", daemon=True).start()
        try:
            super().run()
        finally:
            self._stop.set()

    def _watch(self):
        """GRPC only (under mpirun the launcher ends the job when the server dies): stop when the
        server's port stops answering, or after FEDML_SSFL_IDLE_TIMEOUT of silence."""
        failures, last_probe = 0, time.monotonic()
        while not self._stop.wait(1.0):
            now = time.monotonic()
            idle = now - self.last_heard
            reason = None
            if idle > self.limits.idle:
                reason = f"heard nothing from the server (rank 0) for {idle:.0f} s (FEDML_SSFL_IDLE_TIMEOUT)"
            # before the first round the server may wait for other ranks (up to the connect timeout)
            waited = self.limits.probe if self.is_inited else self.limits.connect
            probe_due = idle > waited and now - last_probe >= self.limits.probe
            if reason is None and probe_due:
                last_probe = now
                failures = 0 if grpc_reachable(self.com_manager, 0) else failures + 1
                if failures >= 2:
                    m = self.com_manager.grpc_mappings[0]
                    reason = f"the server (rank 0) at {m.grpc_server_ip}:{m.grpc_server_port} is unreachable"
            if reason:
                sys.stderr.write(error_line(f"rank {self.rank}: {reason}; stopping") + "\n")
                sys.stderr.flush()
                os._exit(1)
