"""A fedml_ssfl deployment run by FedML's own FedMLRunner, as in FedML's cross-silo examples.

mpirun -np 4 python deploy/fedml_runner.py --cf DIR/deployment.yaml        # one cluster
python deploy/fedml_runner.py --cf deployment.yaml --rank 0 --role server   # GRPC: one per host
"""

import fedml
from fedml import FedMLRunner

from fedml_ssfl.runtime.fedml import hooks as ssfl

if __name__ == "__main__":
    args = ssfl.init()  # fedml.init() without its call to FedML's cloud; reads --cf, --rank, --role
    device = fedml.device.get_device(args)
    dataset, model = ssfl.load_data(args), ssfl.create_model(args)  # placeholders: each rank reads its own files
    trainer, aggregator = ssfl.SSFLTrainer(model, args), ssfl.SSFLAggregator(model, args)
    FedMLRunner(args, device, dataset, model, trainer, aggregator).run()
