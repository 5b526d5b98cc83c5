"""Packaging for fedml_ssfl: semi-supervised federated learning on FedML."""

from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).parent

# One set that resolves and imports together on Python 3.11 (README.md, "Quick start", is the install line):
# fedml 0.9.6 pins numpy<2 and protobuf<4; protobuf<4 caps onnxruntime at 1.26;
# fedml and wandb import pkg_resources, removed from setuptools 81.
INSTALL_REQUIRES = [
    "fedml==0.9.6",
    "torch>=2.2",
    "torchvision>=0.17",
    "numpy>=1.24,<2",
    "protobuf>=3.20,<4",
    "setuptools<81",
    "mpi4py>=3.1",
    "openmpi>=4.1",
    "onnx>=1.16",
    "onnxruntime>=1.18,<1.27",
    "onnxscript>=0.2",
    "pyyaml>=6",
    "scipy>=1.10",
    "scikit-learn>=1.3",
    "mlxtend>=0.22",
    "matplotlib>=3.7",
    "tensorboard>=2.14",
    "tqdm>=4.60",
]

EXTRAS = {"dev": ["pytest>=7.4", "pytest-timeout>=2.2", "ruff>=0.5"]}

setup(
    name="fedml_ssfl",
    version="0.1.0",
    description="Semi-supervised federated learning (SSFL) algorithms on FedML",
    long_description=(HERE / "README.md").read_text(encoding="utf-8") if (HERE / "README.md").exists() else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.10,<3.12",
    packages=find_packages(include=["fedml_ssfl", "fedml_ssfl.*", "mobile_export", "mobile_export.*"]),
    include_package_data=True,
    package_data={"fedml_ssfl": ["configs/*.yaml"]},
    install_requires=INSTALL_REQUIRES,
    extras_require=EXTRAS,
    entry_points={"console_scripts": ["fedml-ssfl=fedml_ssfl.cli:main"]},
)
