"""Padded-drafting formulas (imported as ``specdec.kernels``)."""
