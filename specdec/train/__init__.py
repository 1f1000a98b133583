"""Reproducible CPU training of the embedded default target + draft heads (specdec/assets/default)."""
