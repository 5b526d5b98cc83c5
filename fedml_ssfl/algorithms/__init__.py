"""Algorithms: one module each, all on the contract of :mod:`.base`, found via :mod:`.registry`."""

from .base import (
    Algorithm,
    AlgorithmConfig,
    ClientContext,
    ClientData,
    DataInfo,
    Message,
    NonFiniteLossError,
    ServerData,
    TrainSettings,
    message_nbytes,
)
from .registry import algorithm_description, available_algorithms, create, get_algorithm, register_algorithm

__all__ = [
    "Algorithm",
    "AlgorithmConfig",
    "ClientContext",
    "ClientData",
    "DataInfo",
    "Message",
    "NonFiniteLossError",
    "ServerData",
    "TrainSettings",
    "algorithm_description",
    "available_algorithms",
    "create",
    "get_algorithm",
    "message_nbytes",
    "register_algorithm",
]
