"""Workloads: the shipped model configs (``configs/``, built by ``models``) and the RoundPipe
paper's models as analytic unit profiles (``paper``)."""
