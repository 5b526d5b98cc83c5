"""Runtimes drive algorithms: ``local`` (the in-process simulator) and ``fedml`` (FedML, over MPI or GRPC)."""
