"""Runtimes drive algorithms: ``local`` (in-process simulator) and ``fedml_backend`` (FedML)."""
