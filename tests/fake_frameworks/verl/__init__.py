"""Replica of volcengine/verl (b178a3cd56f5; verl 0.9.1): module paths and signatures only."""

__version__ = "0.9.1"
