"""Runtime: the plumbing every layer above may use — the content-addressed cache and its CLI, run
locks, run logs, threads, preemption signals, launchers, tracking (metrics.jsonl / wandb), the
host-sync counter and the precision policy. Imports nothing else from kdrun but kdrun.errors and
kdrun.config."""
