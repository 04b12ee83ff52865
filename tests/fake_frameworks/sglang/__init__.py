"""Replica of sglang 0.5.23 (the wheel on PyPI): the module paths and signatures of its weight updates
(`WeightUpdater.update_weights_from_tensor`, `receive_weights_from_distributed`,
`load_weights_from_distributed`, `_model_load_weights_direct`, `FlattenedTensorBucket`), written
for kvguard's tests, runnable on CPU with torch alone."""

__version__ = "0.5.23"
