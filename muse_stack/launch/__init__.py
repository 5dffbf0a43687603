"""Launching recipes on clusters: Slurm batch scripts (pyxis containers, torchrun per node) and
Kubernetes manifests (a Kubeflow PyTorchJob with a headless rendezvous service)."""
