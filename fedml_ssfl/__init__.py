"""fedml_ssfl: semi-supervised federated learning (SSFL) algorithms on FedML.

``import fedml_ssfl`` never imports fedml or mpi4py; only
:mod:`fedml_ssfl.runtime.fedml` does, lazily.
"""

__version__ = "0.1.0"
