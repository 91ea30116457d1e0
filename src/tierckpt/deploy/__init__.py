"""Deployment helpers: ``tierckpt k8s render`` (Kubernetes manifests from a HyperPodPyTorchJob).

The static manifests (the node agent's DaemonSet, a kustomize base) live in ``deploy/k8s`` and the
Slurm batch script in ``deploy/slurm`` of the source tree; docs/deploy.md shows both.
"""
