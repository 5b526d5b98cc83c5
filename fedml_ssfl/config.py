"""Experiment configuration: one YAML in FedML's sectioned format, validated into dataclasses.

The same file drives the local simulator and FedML (which flattens the sections into ``args``
and silently ignores keys it does not know). Here every key is checked before anything runs:

* an unknown key is an error naming the key and the closest valid one;
* a wrong type or a value out of range names the key and what is allowed;
* impossible combinations (C_k > K, S > C_k, ...) name both keys and the fix.

``ssfl_args`` holds ``algorithm`` plus that algorithm's own hyper-parameters, validated
against the algorithm's config dataclass from the registry (see :func:`validate`).
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import logging
import math
import re
import shlex
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from . import envvars
from .atomic import atomic_write
from .data.partition_methods import METHODS, SCENARIOS, PartitionOptions
from .errors import ConfigError  # re-exported: raised by every layer, caught by the CLI
from .limits import MAX_CLASSES, text_position

log = logging.getLogger(__name__)


@dataclass
class CommonArgs:
    """``common_args``: what kind of run, its seed and where outputs go."""

    training_type: str = "simulation"  # simulation (local runtime) | cross_silo (FedML)
    random_seed: int = 0
    run_name: str = ""  # left out: <dataset>_<algorithm> (see derived_run_name)
    output_dir: str = "runs"
    compare_with: list[str] = field(default_factory=lambda: ["server_only"])
    scenario: str = "horizontal"  # FedML's key; only horizontal is supported
    config_version: str = "release"  # FedML's key
    run_id: str = ""  # FedML's run id (--run_id, train_args.run_id): for the runtime; not in the fingerprint


@dataclass
class DataArgs:
    """``data_args``: dataset, partition and label scenario (Zhang et al.'s R, N_s).

    Partition methods (details in :mod:`fedml_ssfl.data.partition`): ``iid``, ``r`` (Zhang et
    al.'s R), ``dirichlet``, ``shards``; FedMatch's tasks ``batch_iid`` (= iid), ``batch_noniid``
    (class-imbalanced clients: main class k mod d at 50%, its neighbours 15%, the others 3%, the
    opposite class 2%, mixed with uniform by ``imbalance_strength``) and ``streaming_noniid``
    (batch_noniid whose unlabeled data arrives in ``num_stages`` cumulative stages, one every
    ``rounds_per_stage`` rounds); FedSiam's labels-at-client settings ``noniid_1`` (labeled and
    unlabeled from ``classes_per_client`` distinct classes; also the labels-at-server non-IID
    setting), ``noniid_2`` (labeled from ``classes_per_client`` classes, unlabeled from all; client
    scenario only) and ``noniid_3`` (iid; ``rich_client_fraction`` of the clients label
    ``rich_label_ratio`` of their data, the rest ``poor_label_ratio``; client scenario only).
    FedSiam IID is ``iid`` with ``client_label_ratio``.
    """

    dataset: str = "mnist5k"
    data_cache_dir: str = "~/.cache/fedml_ssfl/data"
    download: bool = False
    label_scenario: str = "server"  # server (labels-at-server) | client (labels-at-client)
    num_server_labels: int = 50  # N_s
    num_server_val: int = 0
    partition_method: str = "iid"  # one of fedml_ssfl.data.partition_methods.METHODS
    non_iid_r: float = 0.4  # R (Zhang et al. Eq. 1) for partition_method r
    partition_alpha: float = 0.5  # Dirichlet concentration
    classes_per_client: int = 2  # shards: shards per client; noniid_1 / noniid_2: distinct classes per client
    labels_per_class_client: int = 5  # labels-at-client: labeled samples per class per client (FedMatch: 5)
    # labels-at-client: FedSiam's gamma, the labeled fraction of each client's data (0.1 / 0.15 / 0.2), stratified
    # by class; 0 = use labels_per_class_client. Not with batch_noniid / streaming_noniid / noniid_3.
    client_label_ratio: float = 0.0
    imbalance_strength: float = 1.0  # batch_noniid / streaming_noniid: 1 = FedMatch's profile (max/min 25), 0 = iid
    num_stages: int = 10  # streaming_noniid: T stages of each client's unlabeled data
    rounds_per_stage: int = 10  # streaming_noniid: stage s is released at round s * rounds_per_stage
    rich_client_fraction: float = 0.1  # noniid_3: fraction of label-rich clients (10 of 100)
    rich_label_ratio: float = 0.55  # noniid_3: labeled fraction of a rich client's data
    poor_label_ratio: float = 0.05  # noniid_3: labeled fraction of the other clients' data
    synthetic_num_samples: int = 2000
    synthetic_num_classes: int = 10
    synthetic_shape: list[int] = field(default_factory=lambda: [3, 32, 32])
    # FedML deployment mode (comm_args.mode: deployment): every process reads only its own files.
    local_data: str = ""  # a silo's own data (npz or image folder); {rank} / {silo} placeholders allowed
    server_data: str = ""  # the server's labeled set (npz or class folders)
    server_val_data: str = ""  # the server's validation set (optional)
    test_data: str = ""  # the test set the server evaluates on
    num_classes: int = 0  # deployment: the class count (0: from the server's labels / class folders)
    norm_mean: list[float] = field(default_factory=list)  # deployment: per-channel mean (empty: server data's)
    norm_std: list[float] = field(default_factory=list)  # deployment: per-channel std (empty: server data's)
    flip: bool = False  # deployment: random horizontal flips suit the data (the shipped datasets decide their own)


@dataclass
class ModelArgs:
    """``model_args``: a model from the registry and its normalisation layer."""

    model: str = "cnn28"
    norm: str = "gn"  # bn | gn | none (what the model supports)
    logits: int | str = ""  # a model returning a tuple / dict: the logits' position (0) or key ("logits")


@dataclass
class TrainArgs:
    """``train_args``: federation size and optimisation (Zhang et al.'s K, C_k, T, Eq. 9)."""

    federated_optimizer: str = "FedAvg"  # FedML's key; the algorithm is ssfl_args.algorithm
    client_num_in_total: int = 10  # K
    client_num_per_round: int = 10  # C_k
    comm_round: int = 30
    local_steps: int = 16  # T
    epochs: int = 0  # FedML's local epochs; > 0: each client's T = epochs x ceil(own samples / B) (client_train)
    batch_size: int = 64
    learning_rate: float = 0.03
    momentum: float = 0.9
    weight_decay: float = 1e-4
    lr_schedule: str = "cosine"  # cosine (Eq. 9) | cosine_annealing ((1 + cos(pi t / T)) / 2, to 0) | constant
    lr_cosine_c: float = 0.4375  # c in Eq. 9
    lr_warmup_rounds: int = 0  # e in Eq. 9, in rounds
    lr_floor: float = 1e-4  # epsilon in Eq. 9
    client_optimizer: str = "sgd"  # FedML's key; SGD with momentum is what the papers use
    # the local runtime trains a round's clients together, stacked along a client dimension (torch.func):
    # the same maths as one after another (docs/performance.md, "Stacked clients"); some algorithms only
    stack_clients: bool = False
    stack_size: int = 0  # stack_clients: at most this many clients in one stack (memory, CPU caches); 0: all
    # the idle-client control: every sampled client sends back the model it received (no local work, its state
    # untouched); the server's path, rounds, seeds and traffic accounting are the trained run's
    idle_clients: bool = False
    # participation (fedml_ssfl.participation; the simulator only): the probability each client is reachable in a
    # round (one for all, or one per client), or a trace file of the reachable clients per round; ask
    # ceil(C_k (1 + over_selection)) clients and keep the first C_k replies; a round with fewer than min_clients
    # replies to keep is skipped; replay_participation: follow a recorded participation.jsonl exactly
    availability: float | list[float] = 1.0
    availability_trace: str = ""
    over_selection: float = 0.0
    min_clients: int = 1
    replay_participation: str = ""


@dataclass
class ValidationArgs:
    """``validation_args``: how often to evaluate on the test set."""

    frequency_of_the_test: int = 1
    # metrics.EVAL_BATCH_SIZE (why 100: its docstring), written out so that the config does not import torch
    eval_batch_size: int = 100


@dataclass
class DeviceArgs:
    """``device_args``: where to train."""

    device: str = "cpu"  # cpu | cuda
    using_gpu: bool = False  # FedML's key; set from device
    gpu_id: int = 0
    gpu_mapping_file: str = ""
    gpu_mapping_key: str = ""
    num_threads: int = 0  # torch CPU threads; 0 keeps torch's default
    # FedML's worker processes of a simulation-mode FedML job (0: C_k, one silo each); fewer than C_k serve
    # several silos each a round, as FedML's MPI simulation (fedml_compat). Not in the fingerprint: same results
    worker_num: int = 0
    # MiB of per-client state kept in memory (0: no limit); the least recently used states beyond it are
    # written to disk and read back exactly (docs/performance.md, "Client state at scale"). FedMatch's
    # server records per client (views, client_psi) share it: a third each with the client states; a pooled
    # FedML worker's cache of the silos it served has the whole budget in its own process. Not in
    # the fingerprint: it changes no result, so a run may resume under another budget.
    state_memory_mb: float = 0.0
    state_spill_dir: str = ""  # where states spill ("": the run folder); each run makes a folder of its own in it
    # the layout models compute in (weights and inputs): auto (on CPU channels_last for a model without GroupNorm,
    # else contiguous: the faster one, docs/performance.md) | channels_last | contiguous |
    # unchanged (inputs keep the augmentation's strides, as before issue 15: reproduces earlier runs bit for
    # bit). The layouts differ only in float rounding (fedml_ssfl/models/layout.py)
    memory_format: str = "auto"
    # the precision of every forward pass: off (float32, as the papers train; bit for bit the results from
    # before the key) | bf16 (torch.autocast with bfloat16; weights, optimiser state and everything computed
    # from the logits stay float32; fedml_ssfl/models/precision.py, docs/performance.md "Mixed precision")
    autocast: str = "off"
    # keep the run's uint8 training and test images on the device (copied once when the experiment is built)
    # instead of copying each batch there; same results. Not in the fingerprint (fedml_ssfl/data/placement.py)
    data_on_device: bool = False


@dataclass
class CommArgs:
    """``comm_args``: which runtime and transport."""

    backend: str = "local"  # local | MPI | GRPC
    grpc_ipconfig_path: str = ""
    # FedML runtime: simulation (every process loads the whole dataset and the split; silos are routed to
    # workers) | deployment (silo k's data only on rank k + 1, the server's labels only on rank 0)
    mode: str = "simulation"
    # GRPC security (docs/deploy.md, "Security"): mutual TLS from PEM files ("{rank}" in a path is
    # replaced by the process's rank), the job's shared HMAC key (a file; or FEDML_SSFL_JOB_KEY), and
    # ``insecure: true`` to run in plaintext (warned). Ignored by MPI and the local runtime.
    tls_ca: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    tls_server_name: str = ""  # the name peers' certificates carry, where it is not their ipconfig address
    job_key_file: str = ""
    insecure: bool = False
    # a FedML script's FedMLRunner only: true runs it on FedML's own managers and transport (no outboxes,
    # heartbeats, outage budget or --resume; under GRPC pickles in plaintext, so also insecure: true)
    fedml_stock_transport: bool = False
    # GRPC only: true = clients connect out to the server and fetch their tasks on that connection (devices
    # behind NAT; the ipconfig CSV needs only rank 0's row). runtime/fedml/connect_out.py, docs/deploy.md
    connect_out: bool = False


@dataclass
class TrackingArgs:
    """``tracking_args``: logs, checkpoints, plots."""

    enable_tensorboard: bool = True
    checkpoint_every: int = 5
    progress_bar: bool = True
    enable_wandb: bool = False  # FedML's key; must stay false (offline)
    using_mlops: bool = False  # FedML's key; must stay false (offline)
    log_file_dir: str = ""


SECTIONS: dict[str, type] = {
    "common_args": CommonArgs,
    "data_args": DataArgs,
    "model_args": ModelArgs,
    "train_args": TrainArgs,
    "validation_args": ValidationArgs,
    "device_args": DeviceArgs,
    "comm_args": CommArgs,
    "tracking_args": TrackingArgs,
}

CHOICES: dict[str, tuple[str, ...]] = {
    "common_args.training_type": ("simulation", "cross_silo"),
    "common_args.scenario": ("horizontal",),
    "data_args.label_scenario": SCENARIOS,
    "data_args.partition_method": METHODS,
    "model_args.norm": ("bn", "gn", "none"),
    "train_args.lr_schedule": ("cosine", "cosine_annealing", "constant"),
    "train_args.client_optimizer": ("sgd",),
    "device_args.device": ("cpu", "cuda"),
    "device_args.memory_format": ("auto", "channels_last", "contiguous", "unchanged"),  # models/layout.py
    "device_args.autocast": ("off", "bf16"),  # models/precision.py
    "comm_args.backend": ("local", "MPI", "GRPC"),
    "comm_args.mode": ("simulation", "deployment"),
}

MAX_CLIENTS = 1_000_000
"""The most clients (``train_args.client_num_in_total``) a run may have: the split keeps a list per client."""

MAX_RUN_NAME_BYTES = 200
"""The longest ``common_args.run_name`` (UTF-8 bytes): a folder name (255 at most) with room for ``-2`` and the
``.partition.png`` and spill-folder names made from it."""

MAX_IMAGE_SIDE = 4096
"""The largest height or width of ``data_args.synthetic_shape``."""

MAX_SAMPLES = 10**9
"""The most samples a count of samples may name (``num_server_labels``, ``synthetic_num_samples``, ...)."""

MAX_ROUNDS = 10**6
"""The most rounds (``comm_round``) and the largest round count any other key names (warm-up, stages, test and
checkpoint intervals)."""

MAX_STEPS = 10**7
"""The most local steps (``local_steps``) or epochs a round may take."""

MAX_BATCH_SIZE = 10**5
"""The largest batch (``batch_size``, ``eval_batch_size``, an algorithm's ``*_batch_size``): a batch is
allocated whole on the device."""

MAX_THREADS = 1024
"""The most torch CPU threads (``device_args.num_threads``; 100,000 crashed the process creating them)."""

MAX_GPU_ID = 1023
"""The largest ``device_args.gpu_id``."""

MAX_STATE_MB = 2**30
"""The largest ``device_args.state_memory_mb`` (1 PiB)."""

MAX_FACTOR = 10**6
"""The largest learning rate, weight decay, Dirichlet concentration or other real-valued factor: beyond it a
value is a typo, not a setting (training diverges long before)."""

MAX_HYPERPARAMETER = 10**7
"""Any number in ``ssfl_args`` lies within +-MAX_HYPERPARAMETER (a backstop behind each algorithm's own checks;
``*_batch_size`` keys within :data:`MAX_BATCH_SIZE`)."""

# (key, lower bound, upper bound, inclusive lower); every numeric key of the sections has a row (a test checks)
RANGES: list[tuple[str, float, float | None, bool]] = [
    ("common_args.random_seed", 0, 2**63 - 1, True),
    ("data_args.num_server_labels", 0, MAX_SAMPLES, True),
    ("data_args.num_server_val", 0, MAX_SAMPLES, True),
    ("data_args.non_iid_r", 0.0, 1.0, True),
    ("data_args.partition_alpha", 0.0, MAX_FACTOR, False),
    ("data_args.classes_per_client", 1, MAX_CLASSES, True),
    ("data_args.labels_per_class_client", 0, MAX_SAMPLES, True),
    ("data_args.client_label_ratio", 0.0, 1.0, True),
    ("data_args.imbalance_strength", 0.0, 1.0, True),
    ("data_args.num_stages", 1, MAX_ROUNDS, True),
    ("data_args.rounds_per_stage", 1, MAX_ROUNDS, True),
    ("data_args.rich_client_fraction", 0.0, 1.0, True),
    ("data_args.rich_label_ratio", 0.0, 1.0, True),
    ("data_args.poor_label_ratio", 0.0, 1.0, True),
    ("data_args.synthetic_num_samples", 1, MAX_SAMPLES, True),
    ("data_args.synthetic_num_classes", 2, MAX_CLASSES, True),
    ("data_args.num_classes", 0, MAX_CLASSES, True),
    ("train_args.client_num_in_total", 1, MAX_CLIENTS, True),
    ("train_args.client_num_per_round", 1, MAX_CLIENTS, True),
    ("train_args.comm_round", 1, MAX_ROUNDS, True),
    ("train_args.local_steps", 1, MAX_STEPS, True),
    ("train_args.epochs", 0, MAX_STEPS, True),
    ("train_args.batch_size", 1, MAX_BATCH_SIZE, True),
    ("train_args.learning_rate", 0.0, MAX_FACTOR, False),
    ("train_args.momentum", 0.0, 1.0, True),
    ("train_args.weight_decay", 0.0, MAX_FACTOR, True),
    ("train_args.lr_cosine_c", 0.0, MAX_FACTOR, False),
    ("train_args.lr_warmup_rounds", 0, MAX_ROUNDS, True),
    ("train_args.lr_floor", 0.0, 1.0, True),
    ("train_args.stack_size", 0, MAX_CLIENTS, True),
    ("train_args.over_selection", 0.0, MAX_FACTOR, True),
    ("train_args.min_clients", 1, MAX_CLIENTS, True),
    ("validation_args.frequency_of_the_test", 1, MAX_ROUNDS, True),
    ("validation_args.eval_batch_size", 1, MAX_BATCH_SIZE, True),
    ("tracking_args.checkpoint_every", 1, MAX_ROUNDS, True),
    ("device_args.num_threads", 0, MAX_THREADS, True),
    ("device_args.gpu_id", 0, MAX_GPU_ID, True),
    ("device_args.worker_num", 0, MAX_CLIENTS, True),
    ("device_args.state_memory_mb", 0.0, MAX_STATE_MB, True),
]


SCRIPT_DATA = "FedMLRunner"
"""``data_args.local_data`` / ``server_data`` / ``test_data`` of a FedML script's run
(:mod:`fedml_ssfl.runtime.fedml.hooks`): the data is the dataset list the script passes to
``FedMLRunner`` in each process, not files."""

DEPLOYMENT_DATASETS = {"files": "silo_files", "script": "script_data"}
"""``data_args.dataset`` of a deployment config that names none: the run is named and labelled after
the data it actually reads (the silos' files, or a FedML script's list), never a shipped dataset."""

RESOURCE_KEYS = ("state_memory_mb", "state_spill_dir", "data_on_device", "worker_num")
"""``device_args`` keys that say how to use the machine's memory and disk (and the device's), not what is
computed: left out of :meth:`ExperimentConfig.fingerprint`, so a run resumes under another value."""


@dataclass
class ExperimentConfig:
    """A whole validated experiment: FedML's sections plus the algorithm's own config."""

    common_args: CommonArgs = field(default_factory=CommonArgs)
    data_args: DataArgs = field(default_factory=DataArgs)
    model_args: ModelArgs = field(default_factory=ModelArgs)
    train_args: TrainArgs = field(default_factory=TrainArgs)
    validation_args: ValidationArgs = field(default_factory=ValidationArgs)
    device_args: DeviceArgs = field(default_factory=DeviceArgs)
    comm_args: CommArgs = field(default_factory=CommArgs)
    tracking_args: TrackingArgs = field(default_factory=TrackingArgs)
    algorithm: str = "fedavg_ssl"
    ssfl_args: Any = None  # the algorithm's config dataclass instance

    def to_dict(self) -> dict[str, Any]:
        """The resolved config as plain YAML-able data, in FedML's sectioned layout."""
        out: dict[str, Any] = {name: dataclasses.asdict(getattr(self, name)) for name in SECTIONS}
        algo = dataclasses.asdict(self.ssfl_args) if dataclasses.is_dataclass(self.ssfl_args) else {}
        out["ssfl_args"] = {"algorithm": self.algorithm, **algo}
        return out

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def fingerprint(
        self, exclude: tuple[str, ...] = ("common_args.run_name", "common_args.output_dir", "common_args.run_id")
    ) -> str:
        """A hash of everything that changes the result (output locations excluded)."""
        data = self.to_dict()
        for dotted in exclude:
            section, key = dotted.split(".")
            data.get(section, {}).pop(key, None)
        data.get("tracking_args", {}).pop("progress_bar", None)
        for key in RESOURCE_KEYS:
            data.get("device_args", {}).pop(key, None)
        if data.get("model_args", {}).get("logits") == "":  # unset: the fingerprints of earlier runs hold
            data["model_args"].pop("logits")
        return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]

    def run_dir(self) -> Path:
        return Path(self.common_args.output_dir).expanduser() / self.common_args.run_name

    def with_algorithm(self, name: str, run_name: str | None = None) -> ExperimentConfig:
        """A copy running algorithm ``name`` with its defaults (same data, model, seed).

        Without ``run_name`` the copy's name is derived anew (:func:`derived_run_name`).
        """
        raw = self.to_dict()
        raw["ssfl_args"] = {"algorithm": name}
        raw["common_args"]["compare_with"] = []
        if run_name is not None:
            raw["common_args"]["run_name"] = run_name
        else:
            raw["common_args"].pop("run_name", None)
        return validate(raw)


def derived_run_name(dataset: str, algorithm: str) -> str:
    """The run name used where none is set: ``<dataset>_<algorithm>``, e.g. ``mnist5k_fedavg_ssl``.

    The rule (README, "Outputs"): a run without ``common_args.run_name`` is named after what it runs;
    a config file's own ``run_name`` is kept unless ``--set`` changes ``data_args.dataset`` or
    ``ssfl_args.algorithm`` (then the name is derived again); ``--set common_args.run_name=NAME``
    always wins.
    """
    return f"{dataset}_{algorithm}"


# ---------------------------------------------------------------------------------------------
# validation


def _closest(key: str, valid: list[str]) -> str:
    match = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    return f"; did you mean '{match[0]}'?" if match else f"; valid keys: {', '.join(sorted(valid))}"


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp))


def _short(value: Any, limit: int = 60) -> str:
    """``repr(value)`` cut to ``limit`` characters (a 5,000-digit number in a message stays one short line)."""
    big = isinstance(value, int) and value.bit_length() >= 4 * limit  # repr refuses 4,300 digits and more
    text = f"<a {value.bit_length()}-bit integer>" if big else repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def coerce_value(where: str, value: Any, tp: Any) -> Any:
    """Check ``value`` against the annotation ``tp``; return it (ints accepted for floats)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return coerce_value(where, value, arg)
            except ConfigError:
                continue
        raise ConfigError(f"{where}: {value!r} is not any of {' | '.join(_type_name(a) for a in args)}")
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        (item,) = typing.get_args(tp) or (Any,)
        return [coerce_value(f"{where}[{i}]", v, item) for i, v in enumerate(value)]
    if tp is Any:
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{where}: expected true or false, got {value!r}")
    if tp is int:
        number = int(value) if isinstance(value, float) and value.is_integer() else value  # 1e4 is a whole number
        if isinstance(number, int) and not isinstance(number, bool):
            if not -(2**63) <= number < 2**63:
                raise ConfigError(f"{where}: {_short(value)} is out of range; integers here lie within +-2**63")
            return number
        raise ConfigError(f"{where}: expected an integer, got {_short(value)}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if not math.isfinite(value):
                raise ConfigError(f"{where}: {_short(value)} is not a finite number; give a number like 0.03 or 1e-3")
            return float(value)
        raise ConfigError(f"{where}: expected a number, got {_short(value)}")
    if tp is str:
        if isinstance(value, str):
            return value
        if value is False and "off" in CHOICES.get(where, ()):
            return "off"  # YAML 1.1 reads a bare `off` as false
        raise ConfigError(f"{where}: expected a string, got {value!r}")
    return value


def build_dataclass(cls: type, raw: dict[str, Any], where: str, problems: list[str] | None = None) -> Any:
    """Build dataclass ``cls`` from ``raw``, refusing unknown keys and wrong types.

    With ``problems``, every bad key is added to it (one line each) and left at its default; else the first
    is raised.
    """
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        error = ConfigError(f"{where}: expected a mapping of keys, got {raw!r}")
        if problems is None:
            raise error
        problems.append(str(error))
        return cls()
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in raw.items():
        try:
            if key not in names:
                raise ConfigError(f"unknown key '{where}.{key}'{_closest(str(key), names)}")
            kwargs[key] = coerce_value(f"{where}.{key}", value, hints[key])
        except ConfigError as exc:
            if problems is None:
                raise
            problems.extend(exc.problems)
    return cls(**kwargs)


def _value_problems(cfg: ExperimentConfig) -> list[str]:
    """Every value outside its :data:`CHOICES` or :data:`RANGES`, one line each."""
    problems = []
    for dotted, allowed in CHOICES.items():
        section, key = dotted.split(".")
        value = getattr(getattr(cfg, section), key)
        if value not in allowed:
            problems.append(f"{dotted}: {value!r} is not allowed; choose one of {', '.join(allowed)}")
    for dotted, lo, hi, inclusive in RANGES:
        section, key = dotted.split(".")
        value = getattr(getattr(cfg, section), key)
        low_ok = value >= lo if inclusive else value > lo
        high_ok = hi is None or value <= hi
        if not (low_ok and high_ok):
            bound = f"{'>=' if inclusive else '>'} {lo}" + (f" and <= {hi}" if hi is not None else "")
            problems.append(f"{dotted}: {_short(value)} is out of range; it must be {bound}")
    return problems


def _check_ranges(cfg: ExperimentConfig) -> None:
    """Values in range, then the keys that go together: every problem, raised together."""
    problems = _value_problems(cfg)
    if problems:
        raise ConfigError(*problems)
    problems = _combination_problems(cfg)
    if problems:
        raise ConfigError(*problems)


def _combination_problems(cfg: ExperimentConfig) -> list[str]:
    """The keys that must go together, each pair checked on its own: one line per problem."""
    problems: list[str] = []
    t = cfg.train_args
    if t.client_num_per_round > t.client_num_in_total:
        problems.append(
            f"train_args.client_num_per_round (C_k={t.client_num_per_round}) is larger than "
            f"train_args.client_num_in_total (K={t.client_num_in_total}); set C_k <= K"
        )
    backend, kind = cfg.comm_args.backend, cfg.common_args.training_type
    if (backend == "local") != (kind == "simulation"):
        problems.append(
            f"comm_args.backend '{backend}' does not go with common_args.training_type '{kind}': use backend local "
            "with training_type simulation (the in-process simulator), or backend MPI / GRPC with cross_silo (FedML)"
        )
    if cfg.tracking_args.enable_wandb or cfg.tracking_args.using_mlops:
        problems.append(
            "tracking_args.enable_wandb / using_mlops must be false: fedml_ssfl runs offline and logs to "
            "TensorBoard and metrics.jsonl instead"
        )
    shape = cfg.data_args.synthetic_shape
    if len(shape) != 3 or shape[0] not in (1, 3) or not all(1 <= s <= MAX_IMAGE_SIDE for s in shape[1:]):
        problems.append(
            f"data_args.synthetic_shape: {_short(shape)} is not [channels, height, width] with 1 or 3 channels and "
            f"sides 1..{MAX_IMAGE_SIDE}; e.g. [3, 32, 32]"
        )
    name = cfg.common_args.run_name
    if not name or name in (".", "..") or any(c in name for c in "/\\\0"):
        problems.append(
            f"common_args.run_name: {_short(name)} must be one folder name inside common_args.output_dir (no '/', "
            "'\\', '..'); put the location into common_args.output_dir"
        )
    if len(name.encode("utf-8")) > MAX_RUN_NAME_BYTES:
        problems.append(
            f"common_args.run_name: {_short(name, 40)} is {len(name.encode('utf-8'))} bytes long; a folder name may "
            f"take {MAX_RUN_NAME_BYTES} here: shorten it"
        )
    for check, arg in (
        (_check_partition, cfg.data_args),
        (_check_normalisation, cfg.data_args),
        (_check_participation, cfg),
        (_check_deployment, cfg),
        (_check_connect_out, cfg),
    ):
        try:
            check(arg)
        except ConfigError as exc:
            problems.extend(exc.problems)
    if not problems:
        _warn_deployment_keys_ignored(cfg)
    return problems


def _check_participation(cfg: ExperimentConfig) -> None:
    """The participation keys (:mod:`fedml_ssfl.participation`): values in range, one source, the simulator only."""
    t = cfg.train_args
    probs = t.availability if isinstance(t.availability, list) else [t.availability]
    if not probs or len(probs) not in (1, t.client_num_in_total) or not all(0.0 <= p <= 1.0 for p in probs):
        raise ConfigError(
            f"train_args.availability: {_short(t.availability)} must be one probability in [0, 1], or a list of one "
            f"per client (K={t.client_num_in_total})"
        )
    if t.min_clients > t.client_num_per_round:
        raise ConfigError(
            f"train_args.min_clients ({t.min_clients}) is larger than train_args.client_num_per_round "
            f"(C_k={t.client_num_per_round}): no round could be held; set min_clients <= C_k"
        )
    model = any(p < 1.0 for p in probs) or t.availability_trace
    if t.availability_trace and any(p < 1.0 for p in probs):
        raise ConfigError(
            "train_args.availability and train_args.availability_trace both say who is reachable: keep one"
        )
    if t.replay_participation and (model or t.over_selection > 0):
        raise ConfigError(
            "train_args.replay_participation follows a recorded participation: remove train_args.availability, "
            "availability_trace and over_selection"
        )
    used = [
        key
        for key, on in (
            ("availability", any(p < 1.0 for p in probs)),
            ("availability_trace", bool(t.availability_trace)),
            ("over_selection", t.over_selection > 0),
            ("min_clients", t.min_clients > 1),
            ("replay_participation", bool(t.replay_participation)),
        )
        if on
    ]
    if used and cfg.comm_args.backend != "local":
        raise ConfigError(
            f"train_args.{used[0]}: only the local simulator draws or replays participation so far, not "
            f"comm_args.backend '{cfg.comm_args.backend}'; remove the key, or run with comm_args.backend local"
        )


def _check_connect_out(cfg: ExperimentConfig) -> None:
    """``comm_args.connect_out`` is a mode of the package's GRPC transport."""
    c = cfg.comm_args
    if not c.connect_out:
        return
    if c.backend != "GRPC":
        raise ConfigError(
            f"comm_args.connect_out: clients connect out only under comm_args.backend GRPC (got '{c.backend}'); "
            "set comm_args.backend GRPC, or remove comm_args.connect_out"
        )
    if c.fedml_stock_transport:
        raise ConfigError(
            "comm_args.connect_out: FedML's stock transport (comm_args.fedml_stock_transport) has no connect-out "
            "mode; remove one of the two keys"
        )


def _check_deployment(cfg: ExperimentConfig) -> None:
    """FedML's deployment mode: every process reads its own files, so they must be named."""
    if cfg.comm_args.mode != "deployment":
        return
    d = cfg.data_args
    if cfg.comm_args.backend not in ("MPI", "GRPC"):
        raise ConfigError(
            "comm_args.mode deployment is a mode of the FedML runtime: set comm_args.backend MPI or GRPC "
            "(and common_args.training_type cross_silo)"
        )
    keys = ("local_data", "server_data", "test_data")
    script = [k for k in keys if getattr(d, k) == SCRIPT_DATA]
    if script and len(script) != len(keys):
        raise ConfigError(
            f"data_args.{script[0]} is {SCRIPT_DATA} (a FedML script's dataset list) but data_args."
            f"{next(k for k in keys if k not in script)} names files: set all three to {SCRIPT_DATA}, or all to files"
        )
    for key, what in (
        ("local_data", "each silo's own data"),
        ("server_data", "the server's labeled set"),
        ("test_data", "the test set the server evaluates on"),
    ):
        if not getattr(d, key):
            raise ConfigError(
                f"data_args.{key} is empty: comm_args.mode deployment reads {what} from it (an npz file or an image "
                "folder; `fedml-ssfl partition CONFIG --export DIR` writes them from a simulation split)"
            )
    if d.partition_method == "streaming_noniid":
        raise ConfigError(
            "data_args.partition_method streaming_noniid: in deployment mode each silo's file is its data (no "
            "release stages); remove the key"
        )
    if (d.norm_mean or d.norm_std) and len(d.norm_mean) != len(d.norm_std):
        raise ConfigError("data_args.norm_mean and norm_std need one value per channel each (or both empty)")


def _check_normalisation(d: DataArgs) -> None:
    """``num_classes`` is 0 or >= 2; ``norm_mean`` / ``norm_std`` one value per channel (1 or 3), every std > 0."""
    if d.num_classes == 1:
        raise ConfigError(
            "data_args.num_classes: 1 class leaves nothing to classify; give the class count (>= 2), or 0 to take it "
            "from the server's labels"
        )
    for key, values in (("norm_mean", d.norm_mean), ("norm_std", d.norm_std)):
        if values and len(values) not in (1, 3):
            raise ConfigError(
                f"data_args.{key}: {_short(values)} has {len(values)} values; give one per channel of the images "
                "(1 for grey, 3 for RGB), or leave it out to measure it on the server's data"
            )
    bad = [v for v in d.norm_std if not v > 0]
    if bad:
        raise ConfigError(
            f"data_args.norm_std: {_short(d.norm_std)} holds {bad[0]:g}; every channel's std divides the pixels, so "
            "it must be > 0 (e.g. 0.3081), or leave norm_std out to measure it on the server's data"
        )


_ignored_warned: set[str] = set()


def _warn_deployment_keys_ignored(cfg: ExperimentConfig) -> None:
    """Warn (once per process) that ``num_classes`` / ``norm_mean`` / ``norm_std`` are read in deployment mode only."""
    if cfg.comm_args.mode == "deployment":
        return
    d = cfg.data_args
    given = [k for k in ("num_classes", "norm_mean", "norm_std") if getattr(d, k)]
    text = ", ".join(f"data_args.{k}" for k in given)
    if given and text not in _ignored_warned:
        _ignored_warned.add(text)
        log.warning(
            "%s: read only in comm_args.mode deployment; dataset %s brings its own classes and normalisation, so "
            "the value is ignored here (remove it)",
            text,
            d.dataset,
        )


def partition_options(d: DataArgs) -> PartitionOptions:
    """The split's options (:func:`fedml_ssfl.data.build_split`): the ``data_args`` keys of the same names."""
    return PartitionOptions(**{f.name: getattr(d, f.name) for f in dataclasses.fields(PartitionOptions)})


def _check_partition(d: DataArgs) -> None:
    """The partition method's keys go together (labels-at-client-only methods, label ratio gamma ...)."""
    try:
        partition_options(d).check()
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc


def validate(raw: dict[str, Any], check_names: bool = False) -> ExperimentConfig:
    """Validate a raw (YAML-loaded) mapping into an :class:`ExperimentConfig`.

    Every problem of the config is found before any is reported: FedML's conventions
    (:mod:`fedml_ssfl.fedml_compat`), the keys and their types, then the values' ranges and choices,
    then the keys that must go together (these last two only once the earlier ones pass, since they
    read the values). They are raised together, one line each.

    Parameters
    ----------
    raw : dict
        The YAML-loaded mapping of sections.
    check_names : bool
        Also check that ``model_args.model`` and ``data_args.dataset`` name a registered model and
        dataset (``fedml-ssfl run``; a FedML script brings its own model and data).

    Raises
    ------
    ConfigError
        Naming each offending key and the fix (``problems``: one line each).
    """
    from .algorithms import registry  # late: algorithms import torch-heavy modules

    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"a config must be a mapping of sections, got {type(raw).__name__}")
    from . import fedml_compat  # FedML's fedml_config.yaml conventions: aliases, ignored keys (warned)

    problems: list[str] = []
    known = {name: [f.name for f in dataclasses.fields(cls)] for name, cls in SECTIONS.items()}
    raw = fedml_compat.apply(raw, default_algorithm=ExperimentConfig.algorithm, known=known, problems=problems)
    valid_sections = [*SECTIONS, "ssfl_args"]
    kwargs: dict[str, Any] = {}
    for section, value in raw.items():
        if section not in valid_sections:
            problems.append(f"unknown section '{section}'{_closest(str(section), valid_sections)}")
        elif section in SECTIONS:
            kwargs[section] = build_dataclass(SECTIONS[section], value, section, problems)
    ssfl = raw.get("ssfl_args") or {}
    if not isinstance(ssfl, dict):
        problems.append("ssfl_args: expected a mapping with at least 'algorithm'")
        ssfl = {}
    ssfl = dict(ssfl)
    algorithm = ssfl.pop("algorithm", ExperimentConfig.algorithm)
    algo_cls = None
    if not isinstance(algorithm, str):
        problems.append(f"ssfl_args.algorithm: expected a string, got {algorithm!r}")
    else:
        try:
            algo_cls = registry.get_algorithm(algorithm)
        except ValueError as exc:
            problems.append(str(exc))
    algo_cfg = build_dataclass(algo_cls.config_class, ssfl, "ssfl_args", problems) if algo_cls else None
    if algo_cfg is not None:
        try:
            _check_hyperparameter_bounds(algo_cfg)
        except ConfigError as exc:
            problems.extend(exc.problems)
    if problems:
        raise ConfigError(*problems)
    cfg = ExperimentConfig(**kwargs, algorithm=algorithm, ssfl_args=algo_cfg)
    if cfg.comm_args.mode == "deployment" and "dataset" not in (raw.get("data_args") or {}):
        kind = "script" if cfg.data_args.local_data == SCRIPT_DATA else "files"
        cfg.data_args.dataset = DEPLOYMENT_DATASETS[kind]  # named after the data read, not the default mnist5k
    if "run_name" not in (raw.get("common_args") or {}):
        cfg.common_args.run_name = derived_run_name(cfg.data_args.dataset, algorithm)
    cfg.device_args.using_gpu = cfg.device_args.device == "cuda"
    problems = _value_problems(cfg)
    if check_names:
        problems += _name_problems(cfg)
    if problems:
        raise ConfigError(*problems)
    problems = _combination_problems(cfg)
    if cfg.data_args.label_scenario not in algo_cls.label_scenarios:
        problems.append(
            f"data_args.label_scenario: algorithm '{algorithm}' supports "
            f"{' | '.join(algo_cls.label_scenarios)}, not '{cfg.data_args.label_scenario}'"
            + (f" ({algo_cls.label_scenario_note})" if algo_cls.label_scenario_note else "")
        )
    for name in cfg.common_args.compare_with:
        try:
            registry.get_algorithm(name)
        except ValueError as exc:
            problems.append(f"common_args.compare_with: {str(exc).removeprefix('ssfl_args.algorithm: ')}")
    try:
        _check_stacking(cfg, algo_cls, registry)
    except ConfigError as exc:
        problems.extend(exc.problems)
    if cfg.train_args.idle_clients and algo_cls.idle_clients_note:
        problems.append(
            f"train_args.idle_clients: algorithm '{algorithm}' {algo_cls.idle_clients_note}; "
            "set train_args.idle_clients: false"
        )
    if problems:
        raise ConfigError(*problems)
    algo_cfg.check(cfg)
    return cfg


def _check_hyperparameter_bounds(algo_cfg: Any) -> None:
    """Every number in ``ssfl_args`` within :data:`MAX_HYPERPARAMETER` (``*_batch_size``: :data:`MAX_BATCH_SIZE`)."""
    for f in dataclasses.fields(algo_cfg):
        value = getattr(algo_cfg, f.name)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        limit = MAX_BATCH_SIZE if f.name.endswith("batch_size") else MAX_HYPERPARAMETER
        if abs(value) > limit:
            raise ConfigError(
                f"ssfl_args.{f.name}: {_short(value)} is out of range; it must lie within +-{limit:,} (its default is "
                f"{f.default!r})"
                if f.default is not dataclasses.MISSING
                else f"ssfl_args.{f.name}: {_short(value)} is out of range; it must lie within +-{limit:,}"
            )


def _name_problems(cfg: ExperimentConfig) -> list[str]:
    """``model_args.model`` and ``data_args.dataset`` not registered (deployment data is files: any name)."""
    from .data.datasets import available_datasets
    from .models import model_spec

    problems = []
    try:
        model_spec(cfg.model_args.model)
    except ValueError as exc:
        problems.append(f"model_args.model: {str(exc).replace(' (model_args.model)', '')}")
    if cfg.comm_args.mode != "deployment" and cfg.data_args.dataset not in available_datasets():
        names = available_datasets()
        close = difflib.get_close_matches(cfg.data_args.dataset, names, n=1, cutoff=0.5)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        problems.append(
            f"data_args.dataset: {cfg.data_args.dataset!r} is not a dataset here{hint} (available: {', '.join(names)})"
        )
    return problems


def _check_stacking(cfg: ExperimentConfig, algo_cls: Any, registry: Any) -> None:
    """``train_args.stack_clients`` needs an algorithm that trains stacked, and the local runtime."""
    if not cfg.train_args.stack_clients:
        return
    if not algo_cls.stackable:
        able = [n for n in registry.available_algorithms() if registry.get_algorithm(n).stackable]
        raise ConfigError(
            f"train_args.stack_clients: algorithm '{cfg.algorithm}' does not train clients stacked yet (supported: "
            f"{', '.join(able)}); set train_args.stack_clients: false"
        )
    if cfg.comm_args.backend != "local":
        raise ConfigError(
            f"train_args.stack_clients: only the local runtime stacks clients, not comm_args.backend "
            f"'{cfg.comm_args.backend}'; set train_args.stack_clients: false"
        )


# ---------------------------------------------------------------------------------------------
# files and overrides

MAX_CONFIG_BYTES = 2**20
"""The largest config file read (a config is a few KiB; a device or a huge file is refused unread)."""

MAX_NESTING = 16
"""The deepest YAML nesting a config may have (it has 3: sections, keys, lists)."""

MAX_DIGITS = 40
"""The most digits a YAML integer may have (no key takes a number beyond 2**63, 19 digits)."""

MAX_VALUES = 100_000
"""The most values (mappings, lists, scalars) a config may hold once its aliases (``*name``) are expanded: a
config holds a few hundred. Nested aliases ("billion laughs": 700 bytes that expand to 9**9 values) are
refused before anything walks the expansion."""

_NON_PRINTABLE = re.compile("[^\x09\x0a\x0d\x20-\x7e\x85\xa0-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")
"""The characters YAML refuses (PyYAML's ``Reader.NON_PRINTABLE``): control characters, NUL, lone surrogates."""


class _ConfigLoader(yaml.SafeLoader):
    """``yaml.safe_load`` for configs, with four differences, each refused in one line naming the line.

    * scientific notation without a dot is a number (YAML 1.2 reads ``1e-3`` so; YAML 1.1 a string);
    * a key given twice in one mapping is refused naming both lines (YAML's last-one-wins is silent);
    * nesting deeper than :data:`MAX_NESTING` is refused (the parser would recurse out of the stack);
    * an integer of more than :data:`MAX_DIGITS` digits is refused (Python refuses 4,300 with a traceback).
    """

    def __init__(self, stream: str, source: str) -> None:
        super().__init__(stream)
        self.name = source  # YAML's own messages name the file, not "<unicode string>"
        self.source = source
        self.depth = 0

    def _where(self, mark: Any) -> str:
        return f"{self.source}, line {mark.line + 1}"

    def compose_node(self, parent: Any, index: Any) -> Any:
        self.depth += 1
        try:
            if self.depth > MAX_NESTING:
                raise ConfigError(
                    f"{self._where(self.peek_event().start_mark)}: nested more than {MAX_NESTING} levels deep; a "
                    "config holds sections of keys whose values are numbers, strings or flat lists"
                )
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1

    def construct_document(self, node: Any) -> Any:
        self._check_expansion(node)
        self._check_duplicates(node, "")
        return super().construct_document(node)

    def _check_expansion(self, root: Any) -> None:
        """Refuse a document whose aliases expand past :data:`MAX_VALUES` values or :data:`MAX_NESTING` levels.

        Each node is measured once (an alias is the node it names, so a measured node's size is reused):
        linear in the file, however far its aliases would expand. A node that contains itself is refused too.
        """
        done: dict[int, tuple[int, int]] = {}  # id(node) -> (values once expanded, depth)
        open_: set[int] = set()  # nodes on the current path
        stack = [root]
        while stack:
            node = stack[-1]
            key = id(node)
            if key in done:
                stack.pop()
                continue
            kids = _children(node)
            if key not in open_:
                open_.add(key)
                for kid in kids:
                    if id(kid) in open_:
                        raise ConfigError(
                            f"{self._where(kid.start_mark)}: an alias refers to a value that contains it (it would "
                            "expand for ever); replace the alias with the values it stands for"
                        )
                    if id(kid) not in done:
                        stack.append(kid)
                continue
            size = 1 + sum(done[id(k)][0] for k in kids)
            depth = 1 + max((done[id(k)][1] for k in kids), default=0)
            if size > MAX_VALUES or depth > MAX_NESTING:
                raise ConfigError(
                    f"{self._where(node.start_mark)}: its aliases (*name) expand to more than "
                    + (f"{MAX_VALUES:,} values" if size > MAX_VALUES else f"{MAX_NESTING} levels of nesting")
                    + "; a config holds a few hundred values: write them out, without nested aliases"
                )
            done[key] = (size, depth)
            open_.discard(key)
            stack.pop()

    def _check_duplicates(self, node: Any, path: str) -> None:
        if isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                self._check_duplicates(item, f"{path}[{i}]")
        if not isinstance(node, yaml.MappingNode):
            return
        seen: dict[str, int] = {}
        for key_node, value_node in node.value:
            key = key_node.value if isinstance(key_node, yaml.ScalarNode) else None
            dotted = f"{path}.{key}" if path else str(key)
            if key is not None and key != "<<":
                line = key_node.start_mark.line + 1
                if key in seen:
                    raise ConfigError(
                        f"{self.source}: key '{dotted}' is given twice, on line {seen[key]} and line {line} (YAML "
                        "would keep the last one silently); delete one of them"
                    )
                seen[key] = line
            self._check_duplicates(value_node, dotted)

    def construct_yaml_int(self, node: Any) -> int:
        digits = sum(c.isdigit() for c in node.value)
        if digits > MAX_DIGITS:
            raise ConfigError(
                f"{self._where(node.start_mark)}: an integer of {digits} digits ({node.value[:12]}...); no key takes a "
                "number beyond 2**63 (19 digits)"
            )
        return super().construct_yaml_int(node)


def _children(node: Any) -> list[Any]:
    """The nodes directly inside a YAML node (a mapping's keys and values; none for a scalar)."""
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    return []


def _check_characters(text: str, source: str) -> None:
    """Refuse a character YAML does not allow (a control character, NUL), naming its line and column."""
    match = _NON_PRINTABLE.search(text)
    if match is None:
        return
    line = text.count("\n", 0, match.start()) + 1
    column = match.start() - (text.rfind("\n", 0, match.start()) + 1) + 1
    name = "a NUL byte" if match.group() == "\0" else f"the control character U+{ord(match.group()):04X}"
    raise ConfigError(
        f"{source}, line {line}, column {column}: {name}, which YAML does not allow; a config is text: remove it "
        "(or write it as an escape such as \\t inside double quotes)"
    )


_ConfigLoader.add_constructor("tag:yaml.org,2002:int", _ConfigLoader.construct_yaml_int)
_ConfigLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)


def load_yaml(text: str, source: str) -> Any:
    """YAML ``text`` as configs read it (:class:`_ConfigLoader`); ``source`` names it in an error.

    Raises
    ------
    ConfigError
        Malformed YAML, a character YAML refuses, a duplicate key, nesting too deep (aliases expanded), aliases
        expanding past :data:`MAX_VALUES` values or an integer too long, naming ``source`` and the line.
    """
    _check_characters(text, source)
    try:
        loader = _ConfigLoader(text, source)
    except yaml.YAMLError as exc:  # the reader's own check, should another character pass ours
        raise ConfigError(f"{source}: not valid YAML: {exc}") from None
    try:
        return loader.get_single_data()
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: not valid YAML: {exc}") from None
    finally:
        loader.dispose()


def parse_override(text: str) -> tuple[str, str, Any]:
    """Parse ``section.key=value`` (value read as YAML) into its three parts."""
    if "=" not in text or "." not in text.split("=", 1)[0]:
        raise ConfigError(f"--set {text!r}: expected section.key=value, e.g. --set train_args.comm_round=5")
    dotted, value = text.split("=", 1)
    section, key = dotted.split(".", 1)
    return section.strip(), key.strip(), load_yaml(value, f"--set {text!r}") if value.strip() else ""


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``--set section.key=value`` overrides to a raw config mapping (a copy).

    ``--set ssfl_args.algorithm=X`` naming another algorithm than the file's starts ``ssfl_args``
    afresh (X's paper defaults plus any other ``--set ssfl_args.*``): the file's hyper-parameters
    belong to its own algorithm. The dropped keys are logged.

    An override that changes ``data_args.dataset`` or ``ssfl_args.algorithm`` drops the file's
    ``common_args.run_name`` (unless ``--set common_args.run_name`` is given too), so the run is
    named after what it runs (:func:`derived_run_name`); the change is logged.
    """
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in (raw or {}).items()}
    parsed = [(text, *parse_override(text)) for text in overrides]
    before = _what_runs(out)
    new_algo = [v for _, section, key, v in parsed if (section, key) == ("ssfl_args", "algorithm")]
    old_ssfl = out.get("ssfl_args")
    if new_algo and isinstance(old_ssfl, dict) and old_ssfl.get("algorithm") not in (None, new_algo[-1]):
        dropped = sorted(k for k in old_ssfl if k != "algorithm")
        if dropped:
            log.warning(
                "ssfl_args.algorithm: %s -> %s on the command line; the file's ssfl_args keys (%s) belong to %s "
                "and were dropped",
                old_ssfl["algorithm"],
                new_algo[-1],
                ", ".join(dropped),
                old_ssfl["algorithm"],
            )
        out["ssfl_args"] = {}
    for text, section, key, value in parsed:
        _section_of(out, section, f"--set {text!r}")[key] = value
    named = any((section, key) == ("common_args", "run_name") for _, section, key, _ in parsed)
    common = out.get("common_args")
    after = _what_runs(out)
    if not named and after != before and isinstance(common, dict) and "run_name" in common:
        old = common.pop("run_name")
        if isinstance(after[0], str) and isinstance(after[1], str):
            log.info(
                "common_args.run_name: %s -> %s (--set changed the dataset or algorithm, so the run is named after "
                "them); --set common_args.run_name=NAME keeps a name of your own",
                old,
                derived_run_name(*after),
            )
    return out


def _section_of(raw: dict[str, Any], section: str, setter: str) -> dict[str, Any]:
    """``raw[section]`` to add a key to (made when missing or empty); refused naming the config when not a mapping."""
    if raw.get(section) is None:  # `train_args:` with nothing under it is an empty section
        raw[section] = {}
    if not isinstance(raw[section], dict):
        raise ConfigError(
            f"{section}: the config gives it the value {_short(raw[section])}, not a mapping of keys, so {setter} "
            f"cannot add a key to it; write `{section}:` followed by indented `key: value` lines (or remove it)"
        )
    return raw[section]


def _what_runs(raw: dict[str, Any]) -> tuple[Any, Any]:
    """(dataset, algorithm) of a raw config mapping, defaults filled in: the parts a derived run name names."""
    data, ssfl = raw.get("data_args"), raw.get("ssfl_args")
    dataset = data.get("dataset", DataArgs.dataset) if isinstance(data, dict) else DataArgs.dataset
    algorithm = (
        ssfl.get("algorithm", ExperimentConfig.algorithm) if isinstance(ssfl, dict) else ExperimentConfig.algorithm
    )
    return dataset, algorithm


def load_raw(path: str | Path) -> dict[str, Any]:
    """Read a YAML config file, with clear errors for a missing or malformed file."""
    p = Path(path).expanduser()
    if not p.exists():
        raise ConfigError(f"config file not found: {p} (pass an existing YAML with --cf, or no --cf for the default)")
    if p.is_dir():
        raise ConfigError(f"{p} is a folder, not a config file; pass the YAML file (e.g. {p / 'config.yaml'})")
    if not p.is_file():
        raise ConfigError(f"{p} is not a regular file (a device, pipe or socket); pass a YAML config file")
    try:
        with p.open("rb") as fh:
            data = fh.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"{p}: cannot read the config ({exc.strerror or exc}); make it readable") from None
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError(
            f"{p}: larger than {MAX_CONFIG_BYTES // 2**20} MiB, not a config (a config is a few KiB); pass the "
            "YAML config"
        )
    try:
        text = data.decode("utf-8-sig")  # a UTF-8 byte-order mark is no part of the YAML
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"{p}: not a text file ({text_position(data, exc.start)}: byte 0x{data[exc.start]:02x} is not UTF-8); "
            "pass a YAML config"
        ) from None
    data = load_yaml(text, str(p))
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: expected a mapping of sections at the top level")
    return data


SMOKE_ENV = "FEDML_SSFL_SET"
"""An environment variable of ``section.key=value`` settings applied to every loaded config (smoke runs)."""

_SMOKE_NAMING = ("data_args.dataset", "ssfl_args.algorithm", "common_args.run_name")
_smoke_warned: set[str] = set()


def apply_smoke_settings(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply :data:`SMOKE_ENV`'s settings to a raw config mapping (after its ``--set`` overrides).

    ``FEDML_SSFL_SET="train_args.comm_round=2 train_args.local_steps=2"`` (space-separated,
    shell-quoted where a value has spaces) shrinks every run a process loads, mpirun's ranks
    included, without changing the command: its values replace the file's and the defaults, a
    key given with ``--set`` keeps the command line's value, and an ``ssfl_args`` key applies only
    to an algorithm that has it. The keys that name a run (dataset, algorithm, run name) are
    refused. A warning naming the settings is logged (once per process), so a run is never
    shortened silently.
    """
    text = envvars.text(SMOKE_ENV)
    if not text:
        return raw
    try:
        items = [parse_override(item) for item in shlex.split(text)]
    except (ValueError, ConfigError) as exc:
        raise ConfigError(f"{SMOKE_ENV}={text!r}: {exc}; give space-separated section.key=value items") from None
    given = {parse_override(o)[:2] for o in overrides}
    algo_keys = _algorithm_keys(_what_runs(raw)[1])
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in raw.items()}
    applied = []
    for section, key, value in items:
        if f"{section}.{key}" in _SMOKE_NAMING:
            raise ConfigError(f"{SMOKE_ENV}: {section}.{key} names the run; set it with --set, not in {SMOKE_ENV}")
        if (section, key) in given or (section == "ssfl_args" and key not in algo_keys):
            continue
        _section_of(out, section, SMOKE_ENV)[key] = value
        applied.append(f"{section}.{key}={value}")
    if text not in _smoke_warned:
        _smoke_warned.add(text)
        log.warning(
            "%s is set: %s replace this config's values (smoke settings; a --set on the command line wins); "
            "unset it for a real run",
            SMOKE_ENV,
            " ".join(applied) or "nothing",
        )
    return out


def _algorithm_keys(algorithm: Any) -> set[str]:
    """The ``ssfl_args`` keys of ``algorithm`` (none for an unknown name: :func:`validate` names it)."""
    from .algorithms import registry

    try:
        return {f.name for f in dataclasses.fields(registry.get_algorithm(str(algorithm)).config_class)}
    except ValueError:
        return set()


def load_config(
    path: str | Path | None = None, overrides: list[str] | None = None, check_names: bool = False
) -> ExperimentConfig:
    """Load, override and validate a config; ``path=None`` gives the default main job.

    Order: the file (or the defaults), then ``overrides`` (``--set``), then :data:`SMOKE_ENV`'s
    settings where set (:func:`apply_smoke_settings`; they never replace a ``--set``).
    ``check_names``: as :func:`validate`.
    """
    raw = load_raw(path) if path is not None else {}
    raw = apply_overrides(raw, overrides or [])
    return validate(apply_smoke_settings(raw, overrides or []), check_names=check_names)


def save_config(cfg: ExperimentConfig, path: str | Path, note: str = "") -> Path:
    """Write the resolved config as YAML, atomically (a full disk leaves no half-written config); ``note``:
    comment lines opening the file."""
    head = "".join(f"# {line}\n" for line in note.splitlines())
    text = (head + cfg.to_yaml()).encode("utf-8")
    return atomic_write(path, lambda fh: fh.write(text))
