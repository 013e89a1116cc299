"""Faults that do not crash the run (the `resilience` config section).

    replicas.py    replica consistency: ranks that must hold identical values compare exact
                   checksums every `resilience.check_every` steps and before every checkpoint
                   (silent data corruption stops the run before it is saved)
    stragglers.py  straggler reports: each rank's compute time per step phase, without its
                   waits in collectives, compared with its peers' every
                   `resilience.straggler_report_every` steps

The trainer (`megalite.train.trainer`) calls them after the optimizer step; they communicate
over the `Topology`'s groups and hold no module state.
"""
