"""A FedML cross-silo script with its own model and data, trained by fedml_ssfl's semi-supervised algorithms.

    cd deploy/fedml_example && mpirun -np 3 --oversubscribe python torch_job.py --cf config/fedml_config.yaml

It is FedML's own example shape (fedml.init, a device, FedML's 8-entry dataset list, a model, a
trainer and an aggregator, FedMLRunner); the only fedml_ssfl lines are the import of the trainer and
aggregator and their construction. Rank 0 is the server, rank k + 1 silo k
(docs/deploy_reference.md, "Coming from FedML").
"""

import fedml
import torch
from fedml import FedMLRunner
from sklearn.datasets import load_digits
from torch import nn

from fedml_ssfl.runtime.fedml.hooks import SSFLAggregator, SSFLTrainer  # before fedml.init(): see its docs


class DigitNet(nn.Module):
    """Any nn.Module mapping images (N, C, H, W) to class logits will do; nothing depends on layer names."""

    def __init__(self, classes: int = 10):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(2),
            nn.Flatten(),
        )
        self.head = nn.Linear(128, classes)

    def forward(self, x):
        return self.head(self.features(x))


def fedml_dataset(silos: int):
    """FedML's list from scikit-learn's digits: images as floats in [0, 1], silo k = every silos-th image."""
    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(digits.target)
    test = torch.arange(len(y)) % 5 == 0
    x_train, y_train, x_test, y_test = x[~test], y[~test], x[test], y[test]

    def loader(idx):
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x_train[idx], y_train[idx]), batch_size=32)

    parts = {k: torch.arange(k, len(y_train), silos) for k in range(silos)}
    test_loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x_test, y_test), batch_size=64)
    return [
        len(y_train),  # train_data_num
        len(y_test),  # test_data_num
        loader(torch.arange(len(y_train))),  # train_data_global: the server draws its labeled samples here
        test_loader,  # test_data_global: the server evaluates on it
        {k: len(p) for k, p in parts.items()},  # train_data_local_num_dict
        {k: loader(p) for k, p in parts.items()},  # train_data_local_dict: silo k trains entry k
        None,  # test_data_local_dict
        10,  # class_num
    ]


if __name__ == "__main__":
    args = fedml.init()
    device = fedml.device.get_device(args)
    dataset = fedml_dataset(silos=args.client_num_in_total)
    model = DigitNet()
    trainer, aggregator = SSFLTrainer(model, args), SSFLAggregator(model, args)
    FedMLRunner(args, device, dataset, model, trainer, aggregator).run()
