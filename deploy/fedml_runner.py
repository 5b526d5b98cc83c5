"""A fedml_ssfl deployment on data files, run by FedML's own FedMLRunner as in FedML's cross-silo examples.

mpirun -np 4 python deploy/fedml_runner.py --cf DIR/deployment.yaml        # one cluster
python deploy/fedml_runner.py --cf deployment.yaml --rank 0 --role server   # GRPC: one per host

The config names each party's files (``fedml-ssfl partition --export`` writes them): every rank reads
its own, so the dataset and model FedMLRunner wants are placeholders. A script with its own data
and model passes them instead (docs/deploy_reference.md, "Coming from FedML").
"""

import fedml
from fedml import FedMLRunner

from fedml_ssfl.runtime.fedml import hooks as ssfl  # makes fedml.init a fedml_ssfl job's init (offline, K + 1)

if __name__ == "__main__":
    args = fedml.init()  # reads --cf, --rank, --role (mpirun: the MPI rank)
    device = fedml.device.get_device(args)
    dataset, model = ssfl.load_data(args), ssfl.create_model(args)  # placeholders: each rank reads its own files
    trainer, aggregator = ssfl.SSFLTrainer(model, args), ssfl.SSFLAggregator(model, args)
    FedMLRunner(args, device, dataset, model, trainer, aggregator).run()
