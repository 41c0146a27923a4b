"""`tether bench`: load generator, fidelity audit, baselines and reports (see docs/PERFORMANCE.md)."""
