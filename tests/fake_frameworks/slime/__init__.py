"""Replica of THUDM/slime v0.3.1 (a6272da0d4f3): module paths and signatures only."""
