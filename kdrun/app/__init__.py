"""App: one run from a composed config — preflight, data, teacher, student, stages, outputs — and
the self-check (kdrun-doctor)."""
