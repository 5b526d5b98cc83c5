"""The partition methods as a table, and the options that choose and tune one.

A bottom-layer module (standard library only, no package imports): :mod:`fedml_ssfl.config` takes
the allowed ``data_args.partition_method`` values and the data-independent checks from here, and
:mod:`fedml_ssfl.data.partition` binds each row to the function that builds the split. Neither
imports the other.

Adding a partition method is one row in :data:`METHOD_TABLE` (its name, options class, label
scenarios, streaming flag and a one-line description) plus one function in
:mod:`fedml_ssfl.data.partition` decorated with ``@implements(name)``; a method with a new
``data_args`` key also gets that key in :class:`~fedml_ssfl.config.DataArgs`, in
:class:`PartitionOptions` and in its options class.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

SCENARIOS = ("server", "client")
"""``data_args.label_scenario``: labels at the server or at the clients."""

_FEDSIAM_SERVER_HINT = (
    "For FedSiam's labels-at-server non-IID setting (2 classes of unlabeled data per client) use "
    "partition_method noniid_1 (exactly 2 distinct classes) or shards, with data_args.classes_per_client: 2"
)


@dataclass(frozen=True)
class PartitionOptions:
    """How to split a training set: the partition keys of ``data_args``, under the same names.

    Built from a config by :func:`fedml_ssfl.config.partition_options`; every field is the
    ``data_args`` key of that name (see :class:`~fedml_ssfl.config.DataArgs`), so error messages
    name the key as ``data_args.<field>``. A method reads only the fields of its options class
    (:attr:`MethodInfo.options`).
    """

    label_scenario: str = "server"
    num_server_labels: int = 50
    num_server_val: int = 0
    partition_method: str = "iid"
    non_iid_r: float = 0.4
    partition_alpha: float = 0.5
    classes_per_client: int = 2
    labels_per_class_client: int = 5
    client_label_ratio: float = 0.0
    imbalance_strength: float = 1.0
    num_stages: int = 10
    rounds_per_stage: int = 10
    rich_client_fraction: float = 0.1
    rich_label_ratio: float = 0.55
    poor_label_ratio: float = 0.05

    def check(self, num_classes: int | None = None) -> None:
        """Check the options on their own and against the method and label scenario.

        Data-independent (the config validation calls it too).

        Parameters
        ----------
        num_classes : int, optional
            d, to check ``classes_per_client`` against; None skips that check.

        Raises
        ------
        ValueError
            Naming the config key(s) and the fix.
        """
        for key in (
            "client_label_ratio",
            "imbalance_strength",
            "rich_client_fraction",
            "rich_label_ratio",
            "poor_label_ratio",
        ):
            _check_unit(key, getattr(self, key))
        for key in ("num_stages", "rounds_per_stage"):
            if getattr(self, key) < 1:
                raise ValueError(f"data_args.{key} must be >= 1, got {getattr(self, key)}")
        method = method_info(self.partition_method)
        if self.label_scenario not in method.scenarios:
            wanted = method.scenarios[0]
            raise ValueError(
                f"data_args.partition_method {method.name!r} is a labels-at-{wanted} setting ({method.description}); "
                f"set data_args.label_scenario: {wanted}. {method.scenario_note}".rstrip()
            )
        if self.client_label_ratio > 0:
            if self.label_scenario != "client":
                raise ValueError(
                    "data_args.client_label_ratio (gamma, the labeled fraction of each client's data) needs "
                    "data_args.label_scenario: client; with labels at the server set data_args.num_server_labels "
                    "(gamma * N) instead and data_args.client_label_ratio: 0"
                )
            if not method.reads("client_label_ratio"):
                keys = ", ".join(f"data_args.{f.name}" for f in fields(method.options))
                raise ValueError(
                    f"data_args.client_label_ratio is not used by {method.name!r} ({method.description}), "
                    f"which reads {keys}; "
                    "set data_args.client_label_ratio: 0"
                )
        method.options.of(self).check(method.name, num_classes)


def method_info(name: str) -> MethodInfo:
    """The row of method ``name``; ValueError naming ``data_args.partition_method`` if there is none."""
    if name not in METHOD_INFO:
        raise ValueError(f"data_args.partition_method: unknown method {name!r}; use one of {METHODS}")
    return METHOD_INFO[name]


def _check_unit(key: str, value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"data_args.{key} must be in [0, 1], got {value}")


# --------------------------------------------------------------------------------------------
# each method's options: the PartitionOptions fields it reads
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MethodOptions:
    """Base of the options classes: the :class:`PartitionOptions` fields a method reads, same names."""

    @classmethod
    def of(cls, options: PartitionOptions) -> MethodOptions:
        """This class's fields taken from ``options``."""
        return cls(**{f.name: getattr(options, f.name) for f in fields(cls)})

    def check(self, method: str, num_classes: int | None) -> None:
        """Raise ValueError naming the key for an impossible value (nothing to check here)."""


@dataclass(frozen=True)
class LabelOptions(MethodOptions):
    """Labels at the clients: ``labels_per_class_client`` per class, or the fraction ``client_label_ratio``."""

    labels_per_class_client: int
    client_label_ratio: float


@dataclass(frozen=True)
class ROptions(LabelOptions):
    """Zhang et al.'s non-iid level R."""

    non_iid_r: float

    def check(self, method: str, num_classes: int | None) -> None:
        _check_unit("non_iid_r", self.non_iid_r)


@dataclass(frozen=True)
class DirichletOptions(LabelOptions):
    """The Dirichlet concentration alpha."""

    partition_alpha: float

    def check(self, method: str, num_classes: int | None) -> None:
        if not self.partition_alpha > 0:
            raise ValueError(f"data_args.partition_alpha must be > 0, got {self.partition_alpha}")


@dataclass(frozen=True)
class ShardsOptions(LabelOptions):
    """Shards (``shards``) or distinct classes (``noniid_1``, ``noniid_2``) per client."""

    classes_per_client: int

    def check(self, method: str, num_classes: int | None) -> None:
        if self.classes_per_client < 1:
            raise ValueError(f"data_args.classes_per_client must be >= 1, got {self.classes_per_client}")


@dataclass(frozen=True)
class ClassSetOptions(ShardsOptions):
    """``classes_per_client`` distinct classes per client, so at most d of them."""

    def check(self, method: str, num_classes: int | None) -> None:
        super().check(method, num_classes)
        if num_classes is not None and self.classes_per_client > num_classes:
            raise ValueError(
                f"data_args.classes_per_client ({self.classes_per_client}) exceeds the {num_classes} classes; "
                f"{method!r} gives each client that many distinct classes, so use at most {num_classes}"
            )


@dataclass(frozen=True)
class ImbalancedOptions(MethodOptions):
    """FedMatch's class-imbalanced clients: the mixing strength s; labels per class at the clients."""

    labels_per_class_client: int
    imbalance_strength: float


@dataclass(frozen=True)
class StreamingOptions(ImbalancedOptions):
    """As :class:`ImbalancedOptions`, plus T stages released every ``rounds_per_stage`` rounds."""

    num_stages: int
    rounds_per_stage: int


@dataclass(frozen=True)
class RichPoorOptions(MethodOptions):
    """FedSiam's Non-IID-III: the fraction of label-rich clients and the two label ratios."""

    rich_client_fraction: float
    rich_label_ratio: float
    poor_label_ratio: float


# --------------------------------------------------------------------------------------------
# the table
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MethodInfo:
    """One row of :data:`METHOD_TABLE`.

    Attributes
    ----------
    name : str
        The ``data_args.partition_method`` value.
    options : type of MethodOptions
        The options the method reads (what its function receives).
    description : str
        One line, for error messages and listings; the details are in :mod:`fedml_ssfl.data.partition`.
    scenarios : tuple of str
        The ``data_args.label_scenario`` values it supports.
    streaming : bool
        Whether its clients' unlabeled data is released in ``num_stages`` stages.
    scenario_note : str
        Appended to the error for an unsupported label scenario.
    """

    name: str
    options: type[MethodOptions]
    description: str
    scenarios: tuple[str, ...] = SCENARIOS
    streaming: bool = False
    scenario_note: str = ""

    def reads(self, key: str) -> bool:
        """Whether the method reads ``data_args.<key>``."""
        return any(f.name == key for f in fields(self.options))


METHOD_TABLE: tuple[MethodInfo, ...] = (
    MethodInfo("iid", LabelOptions, "shuffle and deal evenly"),
    MethodInfo("r", ROptions, "Zhang et al.'s non-iid level R, Appendix A.2"),
    MethodInfo("dirichlet", DirichletOptions, "per class, client proportions ~ Dir(partition_alpha)"),
    MethodInfo("shards", ShardsOptions, "classes_per_client single-class shards per client"),
    MethodInfo("batch_iid", LabelOptions, "FedMatch's Batch-IID: iid under FedMatch's name"),
    MethodInfo("batch_noniid", ImbalancedOptions, "FedMatch's Batch-NonIID: class-imbalanced clients"),
    MethodInfo(
        "streaming_noniid",
        StreamingOptions,
        "FedMatch's Streaming-NonIID: batch_noniid released in num_stages stages",
        streaming=True,
    ),
    MethodInfo("noniid_1", ClassSetOptions, "FedSiam Non-IID-I: classes_per_client distinct classes per client"),
    MethodInfo(
        "noniid_2",
        ClassSetOptions,
        "FedSiam Non-IID-II: labeled from classes_per_client classes, unlabeled from all",
        scenarios=("client",),
        scenario_note=_FEDSIAM_SERVER_HINT,
    ),
    MethodInfo(
        "noniid_3",
        RichPoorOptions,
        "FedSiam Non-IID-III: iid, label-rich and label-poor clients",
        scenarios=("client",),
        scenario_note=_FEDSIAM_SERVER_HINT,
    ),
)
"""Every partition method, in the order config.py lists them."""

METHOD_INFO: dict[str, MethodInfo] = {m.name: m for m in METHOD_TABLE}
METHODS: tuple[str, ...] = tuple(METHOD_INFO)
"""The allowed ``data_args.partition_method`` values."""
