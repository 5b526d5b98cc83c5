# Copied as it is from FedML-AI/FedML (Apache-2.0), commit 03e11dfee, path:
#   python/examples/federate/cross_silo/mpi_fedavg_mnist_lr_example/cross_silo_with_mpi.py
# A test input: tests/test_fedml_examples.py applies the user's edit (docs/deploy_reference.md) to a copy.
import fedml
from fedml import FedMLRunner

if __name__ == "__main__":
    # init FedML framework
    args = fedml.init()

    # init device
    device = fedml.device.get_device(args)

    # load data
    dataset, output_dim = fedml.data.load(args)

    # load model
    model = fedml.model.create(args, output_dim)

    # start training
    fedml_runner = FedMLRunner(args, device, dataset, model)
    fedml_runner.run()
