"""Stand-alone micro-benchmarks (not installed; they import only specdec.*): run each as
`python -m benchmarks.<name>` from the repository root."""
