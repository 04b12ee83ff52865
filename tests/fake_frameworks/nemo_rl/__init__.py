"""Replica of NVIDIA-NeMo/RL (7ea279abfbeb): module paths and signatures only."""

__version__ = "0.7.0"
