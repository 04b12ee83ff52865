"""Replica of vLLM 0.34.0 (the wheel on PyPI): the module paths and signatures of its weight loading
(`model.load_weights(weights)`, `AutoWeightsLoader`, `default_weight_loader`, the layerwise reload's
`start_reload` / `finish_reload`), written for kvguard's tests, runnable on CPU with torch alone."""

__version__ = "0.34.0"
