"""Replica of OpenRLHF/OpenRLHF v0.11.0 (3c3be6234e0c; openrlhf 0.11.2): module paths and signatures only."""
