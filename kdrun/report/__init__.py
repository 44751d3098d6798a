"""Report: results of runs and sweeps (kdrun-report), significance tests and plots."""
