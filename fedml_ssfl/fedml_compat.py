"""Read a config written in FedML's own ``fedml_config.yaml`` conventions.

A FedML user's cross-silo ``fedml_config.yaml`` has keys that mean something here under another
name or value, keys that only matter to FedML's cloud platform, and backends that need it. Before
validation (:func:`fedml_ssfl.config.validate`) the raw YAML mapping is translated:

* **sections do not matter**: FedML's ``fedml/arguments.py`` flattens every section into one
  namespace, so FedML reads a key wherever it is written. Here a key of this package's, or one of
  FedML's below, found in another section than its own is read in its own (``tracking_args.mlops_api_key``
  is ``common_args.mlops_api_key``, logged at INFO); the same key given in two sections with two values
  is an error naming both;
* **aliases** become this package's keys (the rules in :func:`translate`):
  ``train_args.client_id_list`` (FedML's edge ids of the silos) gives K, ``device_args.worker_num``
  (FedML's count of worker processes) is C_k when C_k is not given, fewer workers than C_k serve
  several silos each (FedML's MPI simulation: the FedML runtime's simulation mode), and in
  ``comm_args.mode: deployment`` it is K (one process per silo); ``train_args.lr`` / ``wd`` (FedML's
  names in some trainers) are ``learning_rate`` / ``weight_decay`` where those are not given (else
  ignored with a warning), ``train_args.run_id`` is ``common_args.run_id``, ``partition_method: hetero`` /
  ``homo`` are ``dirichlet`` / ``iid``, ``comm_args.backend: sp`` is ``local``, FedML's MPI
  simulation (``training_type: simulation`` with ``backend: MPI``) is the FedML runtime's simulation
  mode (``training_type: cross_silo``, ``comm_args.mode: simulation``), a ``cross_silo`` run with no
  backend runs on MPI, ``device_args.using_gpu: true`` with no ``device`` is ``device: cuda``, and
  a ``model_args.model`` that has one normalisation only (FedML's ``lr``: ``none``) takes it when
  ``model_args.norm`` is not given; an alias that disagrees with the key it stands for is an error
  naming both;
* **FedML's keys with no meaning here** (:data:`IGNORED_KEYS`, :data:`IGNORED_SECTIONS`) are
  dropped, with one warning each naming the key and what this package uses instead;
  ``tracking_args.using_mlops`` / ``enable_wandb: true`` are kept false with a warning, and
  ``train_args.federated_optimizer`` other than FedML's default ``FedAvg`` (``FedOpt``,
  ``FedProx``, ...) is dropped with a warning that ``ssfl_args.algorithm`` runs instead;
  FedML's ``attack_args`` / ``defense_args`` sections are dropped with a warning while their
  ``enable_*`` switches are off, and refused when one is on;
* **backends that need FedML's cloud** (MQTT, S3, ...: :data:`ONLINE_BACKENDS`) are refused;
* every problem is collected: :func:`translate` reports all of a config's problems together (one
  line each), and :func:`fedml_ssfl.config.validate` adds its own before anything runs;
* ``train_args.epochs`` (FedML's local epochs) is this package's key (``0`` = off): ``epochs > 0``
  makes each client's T, its local steps per round, ``epochs`` passes over its own data
  (:meth:`fedml_ssfl.algorithms.base.Algorithm.client_train`), in every mode, deployment included.

Every other key is left alone, so a key that is neither this package's nor FedML's is still
refused by validation with the closest valid name.

Where the list of FedML's keys comes from (FedML 0.9.6, the installed ``fedml`` package):

* the cross-silo template ``computing/scheduler/build-package/mlops-core/fedml-client/client-package/
  fedml/config/fedml_config.yaml`` (the server package's copy is identical), and the simulation
  templates ``config/simulation_sp/fedml_config.yaml`` and ``config/simulaton_mpi/fedml_config.yaml``;
* the keys FedML's platform writes into that file before a run:
  ``computing/scheduler/scheduler_core/scheduler_base_job_runner.py`` (``build_dynamic_args``: the
  ``train_args.run_id`` / ``client_id`` / ``server_id``, ``tracking_args.log_server_url``, the
  ``dynamic_args`` section) with the package's ``conf/fedml.yaml``, and the ``common_args`` the
  scheduler reads (``master/base_master_job_runner.py``, ``scheduler_core/ota_upgrade.py``,
  ``scheduler_core/status_manager_protocols.py``);
* ``arguments.py``: the command-line flags (taken by ``fedml-ssfl run``, see :mod:`fedml_ssfl.cli`)
  and the keys it reads off the flattened sections (``worker_num``, ``data_file_path``,
  ``partition_file_path``, ``part_file``, ``server_config_path``, ``client_silo_config_paths``);
* the backend names: ``core/distributed/fedml_comm_manager.py`` and ``constants.py``;
* the keys of FedML's example configs (its repository's ``python/examples/federate/``): the MPI
  simulation examples (``simulation/mpi_torch_fedavg_mnist_lr_example``: ``attack_args``,
  ``defense_args``; the FedOpt / FedProx configs: ``server_optimizer``, ``server_lr``,
  ``server_momentum``) and the GRPC cross-silo step-by-step example
  (``cross_silo/grpc_fedavg_mnist_lr_example/step_by_step``: ``tracking_args.local_log_output_path``),
  which FedML 0.9.6's own package does not read.

This module does not import FedML.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import yaml

from .errors import ConfigError

log = logging.getLogger(__name__)

OFFLINE = "fedml_ssfl runs offline; it logs to TensorBoard and metrics.jsonl"
_PLATFORM = "FedML's platform (MLOps) setting; fedml_ssfl does not talk to the platform"
_RUN_NAME = "FedML's experiment-tracking run name; the run's name here is common_args.run_name"
_DATA = "FedML's platform data setting; the data is data_args.dataset / data_cache_dir (local_data in deployment mode)"
_HIERARCHICAL = "FedML's hierarchical scenario; only common_args.scenario: horizontal is supported"
_MODEL_FILES = "the server keeps its model in memory and checkpoints under <run dir>/checkpoints"
_COMM_FILES = "MPI needs no such file; GRPC reads its peers from comm_args.grpc_ipconfig_path"
_MOBILE = "FedML's mobile clients are not supported; for edge devices see `fedml-ssfl export` (docs/edge.md)"
_IDENTITY = "a process's identity here is `fedml-ssfl run --rank N` (0 = the server)"
_SERVER_OPT = (
    "FedML's FedOpt server optimiser; the server's update here is the algorithm's own (ssfl_args.algorithm, "
    "e.g. FedAvg-SSL's average with the server model)"
)
_LOG_DIR = (
    "FedML's log folder (FedML 0.9.6 itself does not read it); fedml_ssfl logs to stderr and writes metrics.jsonl, "
    "summary.json and TensorBoard events into the run folder under common_args.output_dir"
)

_OTHER_ALGORITHM = (
    "a hyper-parameter of one of FedML's own algorithms (FedProx, FedNova, FedOpt, FedNAS, FedGKT, FedGAN, async "
    "or hierarchical FL, FedSGD ...), which do not run here: ssfl_args.algorithm trains and aggregates"
)
_HARDWARE = "FedML's process, GPU or scheduling setting; fedml_ssfl runs one process per rank on device_args.device"
_MODEL_SHAPE = "the model's shape here comes from model_args.model and the data (its classes, channels, image size)"
_OTHER_DATA = "a setting of one of FedML's data loaders; the data is data_args.dataset (and its partition keys)"
_LR_SCHEDULE = "FedML's learning-rate schedule; the schedule here is train_args.lr_schedule (Eq. 9 by default)"
_TRAINER = "a setting of FedML's trainers; local training here is the algorithm's (SGD with momentum, as the papers)"
_BATCHES = "FedML's batch size of one of its trainers; the batch size here is train_args.batch_size"

IGNORED_SECTIONS: dict[str, str] = {
    "environment_args": "FedML's platform bootstrap; install fedml_ssfl on each machine yourself (docs/deploy.md)",
    "dynamic_args": "written by FedML's platform for its own launcher; the values that matter here are flags",
    "private_config_paths": _HIERARCHICAL,
    "fedprox_args": _OTHER_ALGORITHM,
    "fednova_args": _OTHER_ALGORITHM,
    "feddyn_args": _OTHER_ALGORITHM,
}
"""Whole sections of FedML's that are dropped with one warning each."""

IGNORED_KEYS: dict[str, dict[str, str]] = {
    "common_args": {
        "using_mlops": OFFLINE,
        "mlops_api_key": _PLATFORM,
        "mlops_project_name": _PLATFORM,
        "mlops_run_name": _RUN_NAME,
        "enable_async_cluster": _PLATFORM,
        "async_check_timeout": _PLATFORM,
        "enable_fault_tolerance": _PLATFORM,
        "fault_tolerance_rate": _PLATFORM,
        "force_ota": _PLATFORM,
        "ota_version": _PLATFORM,
        "server_config_path": _HIERARCHICAL,
        "client_silo_config_paths": _HIERARCHICAL,
    },
    "data_args": {
        "is_using_local_data": _DATA,
        "synthetic_data_url": _DATA,
        "client_objects": _DATA,
        "data_file_path": _DATA,
        "partition_file_path": "FedML's fixed partition file; the split is data_args.partition_method (seeded)",
        "part_file": "FedML's fixed partition file; the split is data_args.partition_method (seeded)",
    },
    "model_args": {
        "model_file_cache_folder": _MODEL_FILES,
        "global_model_file_path": _MODEL_FILES,
    },
    "train_args": {
        "client_id": _IDENTITY,
        "server_id": _IDENTITY,
        "server_optimizer": _SERVER_OPT,
        "server_lr": _SERVER_OPT,
        "server_momentum": _SERVER_OPT,
    },
    "device_args": {
        "is_mobile": _MOBILE,
    },
    "comm_args": {
        "mqtt_config_path": _COMM_FILES,
        "s3_config_path": _COMM_FILES,
        "is_mobile": _MOBILE,
    },
    "tracking_args": {
        "enable_tracking": OFFLINE,
        "wandb_key": OFFLINE,
        "wandb_entity": OFFLINE,
        "wandb_project": OFFLINE,
        "wandb_name": _RUN_NAME,
        "run_name": _RUN_NAME,
        "log_server_url": OFFLINE,
        "local_log_output_path": _LOG_DIR,
    },
}
"""FedML's keys with no meaning here, per section, with what this package uses instead."""

ANYWHERE_IGNORED: dict[str, str] = {
    # FedML's other algorithms (their configs in python/examples/federate/simulation)
    **dict.fromkeys(
        (
            "mu",
            "fedprox_mu",
            "gmf",
            "dampening",
            "alpha",
            "feddyn_alpha",
            "tau_min",
            "tau_max",
            "sleep_time_max",
            "cache_client_status",
            "initialize_all_clients",
            "group_method",
            "group_num",
            "group_comm_round",
            "compression",
            "compress_ratio",
            "epochs_client",
            "epochs_server",
            "temperature",
            "whether_distill_on_the_server",
            "whether_training_on_client",
            "arch_learning_rate",
            "arch_weight_decay",
            "auxiliary",
            "init_channels",
            "layers",
            "lambda_train_regularizer",
            "lambda_valid_regularizer",
            "learning_rate_min",
            "stage",
            "report_freq",
            "sweep",
            "ci",
        ),
        _OTHER_ALGORITHM,
    ),
    **dict.fromkeys(("lr_decay_rate", "lr_milestones", "lr_step_size", "lr_scheduler"), _LR_SCHEDULE),
    **dict.fromkeys(("optimizer", "nesterov", "no_bn_wd", "grad_clip"), _TRAINER),
    **dict.fromkeys(("train_batch_size", "test_batch_size"), _BATCHES),
    # processes, GPUs, FedML's simulated schedules
    **dict.fromkeys(
        (
            "device_type",
            "process_id",
            "gpu_util_parse",
            "multi_gpu_server",
            "gpi_id",
            "simulation_gpu_hetero",
            "gpu_hetero_ratio",
            "simulation_schedule",
            "runtime_est_mode",
            "ml_engine",
            "deeplearning_backend",
            "enable_cuda_rpc",
            "cuda_rpc_gpu_mapping",
            "trpc_master_config_path",
            "customized_training_thetastore_config",
            "customized_training_web3_config",
        ),
        _HARDWARE,
    ),
    "wandb_only_server": OFFLINE,
    **dict.fromkeys(("group_norm_channels", "class_num", "num_class", "input_size", "image_size"), _MODEL_SHAPE),
    **dict.fromkeys(
        (
            "train_size",
            "test_size",
            "num_loaders",
            "data_map_file",
            "filter_less",
            "task",
            "block_size",
            "mlm_probability",
            "overwrite_cache",
        ),
        _OTHER_DATA,
    ),
}
"""FedML's keys (of its example configs) with no meaning here, in whichever section they are written (FedML flattens
the sections), with what this package uses instead: dropped with one warning each, like :data:`IGNORED_KEYS`."""

EMPTY_IS_DEFAULT = ("gpu_mapping_file", "gpu_mapping_key", "grpc_ipconfig_path", "data_cache_dir", "log_file_dir")
"""Keys of FedML's templates that FedML leaves empty (``gpu_mapping_file:`` with nothing after it, YAML's null):
empty is the default here too."""

FEDML_ALIASES: dict[str, tuple[str, str]] = {
    "lr": ("train_args", "learning_rate"),
    "wd": ("train_args", "weight_decay"),
}
"""FedML's other names of this package's keys (some of FedML's trainers read ``args.lr`` / ``args.wd``): the value
is taken where the key itself is not given; next to it (FedML's FedProx example gives both) it is ignored with a
warning, since FedML's FedAvg trainer reads ``learning_rate`` / ``weight_decay`` too."""

PARTITION_METHODS: dict[str, str] = {"hetero": "dirichlet", "homo": "iid"}
"""FedML's ``data_args.partition_method`` values and this package's names for them."""

ONLINE_BACKENDS: dict[str, str] = {
    "MQTT": "FedML's MQTT broker",
    "MQTT_S3": "FedML's MQTT broker and S3 storage",
    "MQTT_S3_MNN": "FedML's MQTT broker and S3 storage (MNN mobile clients)",
    "MQTT_WEB3": "FedML's MQTT broker and Web3 storage",
    "MQTT_THETASTORE": "FedML's MQTT broker and Theta storage",
    "TRPC": "torch RPC",
    "NCCL": "FedML's NCCL simulation",
}
"""FedML's ``comm_args.backend`` values that are refused, and what they need."""

OFF_SWITCHES = ("using_mlops", "enable_wandb")
"""``tracking_args`` keys this package has but keeps false."""

SWITCHED_SECTIONS: dict[str, str] = {
    "attack_args": "FedML's attack simulation",
    "defense_args": "FedML's robust-aggregation defenses",
    "dp_args": "FedML's differential privacy",
    "fhe_args": "FedML's homomorphic encryption",
    "secure_aggregation_args": "FedML's secure aggregation",
}
"""FedML's sections that are dropped (with a warning) while every ``enable_*`` key in them is false,
and refused when one is true: this package has none of them."""

FEDML_OPTIMIZER = "FedAvg"
"""FedML's default ``train_args.federated_optimizer``, accepted without a word: every algorithm here
averages the clients' models in its own way (``ssfl_args.algorithm``)."""


@dataclass
class Translation:
    """What :func:`translate` made of a raw config.

    Attributes
    ----------
    raw : dict
        The mapping in this package's keys, ready for validation.
    warnings : list of str
        One message per FedML key that was ignored (or switched off).
    notes : list of str
        One message per alias that was resolved (logged at INFO).
    errors : list of str
        One line per problem found (each names the key and the fix), all of them.
    edge_ids : list
        ``train_args.client_id_list`` as given (FedML's edge ids), possibly empty.
    """

    raw: dict[str, Any]
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    edge_ids: list[Any] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def _ignored(key: str, reason: str) -> str:
    return f"{key} is FedML's and is ignored: {reason}"


def parse_id_list(value: Any) -> list[Any]:
    """FedML's ``client_id_list``: a list, its string form (``"[1, 2]"``, ``"[]"``) or empty.

    Parameters
    ----------
    value : list, str, int or None
        The raw value.

    Returns
    -------
    list
        The edge ids, possibly empty.

    Raises
    ------
    ConfigError
        When the value is not a list of ids.
    """
    if value is None:
        return []
    if isinstance(value, str):
        text = value.strip()
        if not text:
            return []
        try:
            value = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ConfigError(f"train_args.client_id_list: cannot read {text!r}; expected a list like [1, 2]") from exc
        if value is None:
            return []
        if isinstance(value, str) and "," in value:
            value = [v.strip() for v in value.split(",") if v.strip()]
    if isinstance(value, (int, str)) and not isinstance(value, bool):
        return [value]
    if isinstance(value, (list, tuple)) and all(isinstance(v, (int, str)) and not isinstance(v, bool) for v in value):
        return list(value)
    raise ConfigError(f"train_args.client_id_list: expected a list of edge ids like [1, 2], got {value!r}")


def _positive_int(where: str, value: Any, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{where}: expected an integer >= {minimum}, got {value!r}")
    return value


def translate(
    raw: Mapping[str, Any],
    default_algorithm: str = "",
    known: Mapping[str, Any] | None = None,
    problems: list[str] | None = None,
) -> Translation:
    """Translate a raw config in FedML's conventions into this package's raw config.

    A pure function: ``raw`` is not changed, and nothing is logged (:func:`apply` logs).
    A mapping already in this package's keys comes back equal.

    Parameters
    ----------
    raw : Mapping
        The YAML-loaded mapping of sections (after ``--set`` overrides).
    default_algorithm : str
        ``ssfl_args.algorithm`` where the mapping names none (for the messages).
    known : Mapping, optional
        This package's keys per section (``{section: names}``): a key of one section found in another
        is moved to its own, as FedML, which flattens the sections, would read it. None: only FedML's
        keys move.
    problems : list, optional
        Where to add the problems found (one line each), all of them; None: they are raised together.

    Returns
    -------
    Translation
        The translated mapping, the warnings (one per ignored FedML key), the notes and the problems.

    Raises
    ------
    ConfigError
        Without ``problems``: every problem found, one line each (an alias that disagrees with the key it
        stands for, naming both; a backend that needs FedML's cloud; a FedML feature switched on; a
        malformed alias value; ...).
    """
    out: dict[str, Any] = {k: dict(v) if isinstance(v, Mapping) else v for k, v in raw.items()}
    result = Translation(raw=out)
    errors = result.errors

    def fail(text: str) -> None:
        errors.append(text)

    for section, what in SWITCHED_SECTIONS.items():
        if section not in out:
            continue
        body = out.pop(section)
        on = sorted(k for k, v in (body.items() if isinstance(body, Mapping) else []) if k.startswith("enable_") and v)
        if on:
            fail(
                f"{section}.{on[0]}: true asks for {what}, which fedml_ssfl does not have; set it to false or remove "
                f"the {section} section"
            )
            continue
        result.warnings.append(f"section {section} is FedML's and is ignored: {what} (every enable_* key is off)")
    for section, reason in IGNORED_SECTIONS.items():
        if section in out:
            del out[section]
            result.warnings.append(f"section {section} is FedML's and is ignored: {reason}")
    for section, keys in IGNORED_KEYS.items():
        body = out.get(section)
        if not isinstance(body, dict):
            continue
        for key, reason in keys.items():
            if key in body:
                del body[key]
                result.warnings.append(_ignored(f"{section}.{key}", reason))
    _flatten(out, result, known)

    def body(section: str) -> dict[str, Any]:
        value = out.setdefault(section, {})
        if value is None:
            value = out[section] = {}
        return value if isinstance(value, dict) else {}  # a non-mapping is refused by validation

    common, data, train, device, comm, tracking = (
        body(s) for s in ("common_args", "data_args", "train_args", "device_args", "comm_args", "tracking_args")
    )

    for key in OFF_SWITCHES:
        if tracking.get(key) is True:
            tracking[key] = False
            result.warnings.append(f"tracking_args.{key}: true is ignored: {OFFLINE}")

    for section in (common, data, train, device, comm, tracking):
        for key in EMPTY_IS_DEFAULT:
            if key in section and section[key] is None:
                del section[key]
    schedule = train.get("lr_schedule", "")
    if schedule is None or schedule == "None":  # FedML's custom-schedule examples: no schedule, a fixed rate
        train["lr_schedule"] = "constant"
        result.notes.append("train_args.lr_schedule: FedML's None (no schedule) is 'constant'")

    # FedML's other names of this package's keys
    for alias, (section, key) in FEDML_ALIASES.items():
        if alias not in train:
            continue
        value, home = train.pop(alias), body(section)
        if key in home:
            result.warnings.append(
                f"train_args.{alias} is FedML's and is ignored: {section}.{key} ({home[key]!r}) is given, and it is "
                f"what trains here (FedML's FedAvg trainer reads {key} too)"
            )
        else:
            home[key] = value
            result.notes.append(f"train_args.{alias}: FedML's name of {section}.{key} = {value!r}")

    # K from FedML's edge ids
    if "client_id_list" in train:
        try:
            ids = parse_id_list(train.pop("client_id_list"))
        except ConfigError as exc:
            fail(str(exc))
            ids = []
        result.edge_ids = ids
        if len(ids) > 1:
            k = train.get("client_num_in_total")
            if k is None:
                train["client_num_in_total"] = len(ids)
                result.notes.append(
                    f"train_args.client_id_list: {len(ids)} edge ids -> client_num_in_total K = {len(ids)}"
                )
            elif k != len(ids):
                fail(
                    f"train_args.client_id_list has {len(ids)} edge ids {ids} but train_args.client_num_in_total "
                    f"is {k!r}: K is the number of silos, so they must agree; fix one of them or drop client_id_list"
                )
        elif len(ids) == 1:
            result.notes.append(
                f"train_args.client_id_list: one edge id {ids[0]!r} (FedML's platform gives each client its own); "
                "recorded, K stays train_args.client_num_in_total"
            )

    # FedML's algorithm name: FedAvg (its default) is what the algorithms here do; others do not run
    optimizer = train.get("federated_optimizer")
    if optimizer is not None and optimizer != FEDML_OPTIMIZER:
        del train["federated_optimizer"]
        algorithm = (out.get("ssfl_args") or {}).get("algorithm") if isinstance(out.get("ssfl_args"), dict) else None
        algorithm = algorithm or (f"{default_algorithm}, the default" if default_algorithm else "its default")
        result.warnings.append(
            f"train_args.federated_optimizer: FedML's {optimizer!r} does not run here: ssfl_args.algorithm "
            f"({algorithm}) trains and aggregates instead; remove the key, or set it to FedAvg"
        )

    # FedML's MPI simulation is the FedML runtime's simulation mode
    if common.get("training_type") == "simulation" and comm.get("backend") == "MPI":
        if comm.get("mode", "simulation") != "simulation":
            fail(
                f"common_args.training_type simulation (FedML's MPI simulation) does not go with comm_args.mode "
                f"{comm['mode']!r}: set training_type: cross_silo for a deployment, or drop comm_args.mode"
            )
        else:
            common["training_type"] = "cross_silo"
            result.notes.append(
                "common_args.training_type: FedML's MPI simulation (simulation + backend MPI) is training_type "
                "cross_silo with comm_args.mode simulation: every process loads the data, worker_num + 1 processes"
            )

    _worker_num(device, train, comm, result)

    # FedML's run id
    if "run_id" in train:
        run_id = train.pop("run_id")
        run_id = "" if run_id is None else str(run_id)
        if "run_id" not in common:
            common["run_id"] = run_id
            result.notes.append(f"train_args.run_id -> common_args.run_id = {run_id!r}")
        elif str(common["run_id"]) != run_id:
            fail(f"train_args.run_id ({run_id!r}) and common_args.run_id ({common['run_id']!r}) disagree; keep one")

    # local epochs
    epochs = train.get("epochs")
    if isinstance(epochs, int) and not isinstance(epochs, bool):
        if epochs < 0:
            fail(f"train_args.epochs: {epochs} is out of range; it must be >= 0 (0: use local_steps)")

    # partition names
    method = data.get("partition_method")
    if isinstance(method, str) and method in PARTITION_METHODS:
        data["partition_method"] = PARTITION_METHODS[method]
        alpha = " (alpha = data_args.partition_alpha)" if method == "hetero" else ""
        result.notes.append(f"data_args.partition_method: FedML's {method!r} is {PARTITION_METHODS[method]!r}{alpha}")

    # backend
    backend = comm.get("backend")
    if isinstance(backend, str):
        needs = ONLINE_BACKENDS.get(backend.upper())
        if needs:
            fail(
                f"comm_args.backend: FedML's {backend!r} is not supported: it needs {needs}, and fedml_ssfl runs "
                "offline; use MPI (mpirun) or GRPC (one process per host) with "
                "common_args.training_type: cross_silo, or local with simulation"
            )
            del comm["backend"]  # refused once: validation does not name it again
            if common.get("training_type") == "cross_silo":
                comm["backend"] = "MPI"
        elif backend == "sp":
            comm["backend"] = "local"
            result.notes.append("comm_args.backend: FedML's 'sp' (single-process simulation) is 'local'")
    elif backend is None and common.get("training_type") == "cross_silo":
        comm["backend"] = "MPI"
        result.notes.append("comm_args.backend: not given for a cross_silo run -> MPI")

    # FedML's GPU switch
    if device.get("using_gpu") is True and "device" not in device:
        device["device"] = "cuda"
        result.notes.append("device_args.using_gpu: true with no device_args.device -> device: cuda")

    # a model with one normalisation only (FedML's lr: none) takes it when model_args.norm is not given
    model = out.get("model_args")
    if isinstance(model, dict) and isinstance(model.get("model"), str) and "norm" not in model:
        norms = _model_norms(model["model"])
        if norms is not None and len(norms) == 1:
            model["norm"] = norms[0]
            result.notes.append(
                f"model_args.model {model['model']!r} has one normalisation: model_args.norm = {norms[0]!r}"
            )

    for section in ("common_args", "data_args", "train_args", "device_args", "comm_args", "tracking_args"):
        if section not in raw and out.get(section) == {}:
            del out[section]
    if problems is not None:
        problems.extend(errors)
    elif errors:
        raise ConfigError(*errors)
    return result


ALIAS_SPOTS = {
    ("train_args", "run_id"),
    ("train_args", "client_id_list"),
    ("device_args", "worker_num"),
    *(("train_args", alias) for alias in FEDML_ALIASES),
}
"""Where FedML's aliases are read (:func:`translate`): not moved as keys of another section."""


def _flatten(out: dict[str, Any], result: Translation, known: Mapping[str, Any] | None) -> None:
    """Keys in another section than their own, read where they belong (FedML flattens the sections).

    FedML's ignored keys (:data:`IGNORED_KEYS` of another section, :data:`ANYWHERE_IGNORED`) are dropped with
    one warning naming the section they were found in; this package's keys (``known``) and FedML's aliases
    move to their own section (a note), unless that section gives the key another value (an error naming
    both). A key that is nobody's stays, for validation to refuse with the closest valid name.
    """
    known = {s: set(names) for s, names in (known or {}).items()}
    homes: dict[str, str] = {}
    for section, names in known.items():
        for name in names:
            homes.setdefault(name, section)
    ignored_anywhere = dict(ANYWHERE_IGNORED)
    for keys in IGNORED_KEYS.values():
        for key, reason in keys.items():
            if known and key not in homes:  # a FedML key of one section found in another (not one of ours)
                ignored_anywhere.setdefault(key, reason)
    for alias, (section, _) in FEDML_ALIASES.items():
        homes.setdefault(alias, section)
    homes.setdefault("worker_num", "device_args")
    homes.setdefault("client_id_list", "train_args")
    moves: list[tuple[str, str, str]] = []
    for section, body in list(out.items()):
        if not isinstance(body, dict) or section == "ssfl_args":
            continue
        valid = known.get(section, set())
        for key in list(body):
            if key in valid or not isinstance(key, str) or (section, key) in ALIAS_SPOTS:
                continue
            home = homes.get(key)
            if home is not None and home != section:
                moves.append((section, key, home))
            elif home is None and key in ignored_anywhere:
                del body[key]
                result.warnings.append(_ignored(f"{section}.{key}", ignored_anywhere[key]))
    for section, key, home in moves:
        value = out[section].pop(key)
        target = out.get(home)
        if target is None:
            target = out[home] = {}
        if not isinstance(target, dict):
            continue  # validation refuses the section
        if key in target and target[key] != value:
            result.errors.append(
                f"{section}.{key} ({value!r}) and {home}.{key} ({target[key]!r}) disagree: FedML reads one key of "
                f"that name, whatever its section; keep one (in {home})"
            )
            continue
        target[key] = value
        result.notes.append(f"{section}.{key} is read as {home}.{key} (FedML reads a key in any section)")


def _worker_num(device: dict[str, Any], train: dict[str, Any], comm: dict[str, Any], result: Translation) -> None:
    """FedML's ``device_args.worker_num``, the worker processes: K in deployment mode (one per silo); in
    simulation mode C_k when C_k is not given, else at most C_k (fewer: each worker serves several silos
    a round, as in FedML's MPI simulation; kept as ``device_args.worker_num``)."""
    if "worker_num" not in device:
        return
    value = device.pop("worker_num")
    if value == 0 and isinstance(value, int) and not isinstance(value, bool):
        device["worker_num"] = 0  # this package's own default (a resolved config as saved): one worker per silo
        return
    try:
        workers = _positive_int("device_args.worker_num", value)
    except ConfigError as exc:
        result.errors.append(str(exc))
        return
    if comm.get("mode") == "deployment":
        given = train.get("client_num_in_total")
        if given is None:
            train["client_num_in_total"] = workers
            result.notes.append(f"device_args.worker_num: {workers} -> train_args.client_num_in_total K = {workers}")
        elif given != workers:
            result.errors.append(
                f"device_args.worker_num ({workers}) and train_args.client_num_in_total ({given!r}) disagree: FedML's "
                "worker_num counts the worker processes, here K (one process per silo in comm_args.mode "
                "deployment); drop worker_num or make them equal"
            )
        return
    given = train.get("client_num_per_round")
    if given is None:
        train["client_num_per_round"] = workers
        result.notes.append(f"device_args.worker_num: {workers} -> train_args.client_num_per_round C_k = {workers}")
    elif isinstance(given, int) and not isinstance(given, bool) and workers < given:
        device["worker_num"] = workers
        result.notes.append(
            f"device_args.worker_num: {workers} worker processes serve the C_k = {given} silos of a round, several "
            "each (as FedML's MPI simulation)"
        )
    elif given != workers:
        result.errors.append(
            f"device_args.worker_num: {workers} is more than train_args.client_num_per_round ({given!r}): FedML's "
            "worker_num counts the worker processes, and each serves at least one of the round's C_k silos; set "
            "worker_num <= client_num_per_round"
        )


def _model_norms(name: str) -> tuple[str, ...] | None:
    """The normalisations registered model ``name`` supports (None for an unknown name: validation names it)."""
    from .models import model_spec

    try:
        return model_spec(name).norms
    except ValueError:
        return None


def apply(
    raw: Mapping[str, Any],
    default_algorithm: str = "",
    known: Mapping[str, Any] | None = None,
    problems: list[str] | None = None,
) -> dict[str, Any]:
    """:func:`translate` ``raw`` and log what was done: a warning per ignored key, notes at INFO.

    Parameters
    ----------
    raw : Mapping
        The YAML-loaded mapping of sections.
    default_algorithm : str
        ``ssfl_args.algorithm`` where the mapping names none (for the messages).
    known, problems
        As :func:`translate`.

    Returns
    -------
    dict
        The mapping in this package's keys.
    """
    result = translate(raw, default_algorithm, known, problems)
    for message in result.warnings:
        log.warning("%s", message)
    for message in result.notes:
        log.info("%s", message)
    return result.raw
