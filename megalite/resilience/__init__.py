"""Faults that do not crash the run (the `resilience` config section).

    replicas.py    replica consistency: ranks that must hold identical values compare exact
                   checksums every `resilience.check_every` steps and before every checkpoint
                   (silent data corruption stops the run before it is saved)
    stragglers.py  straggler reports: each rank's compute time per step phase, without its
                   waits in collectives, compared with its peers' every
                   `resilience.straggler_report_every` steps
    rerun.py       rerun attribution (`resilience.rerun`): a NaN or spike step re-executed
                   before its optimizer step and blamed on a transient fault, a persistent
                   fault or the data (spikes.py: the suspicion test; verdicts.py: who is to
                   blame; faults.py: fault.json, the exit code, the logs of skipped batches)
    inject.py      fault drills (`resilience.inject`, parsed by inject_spec.py): a bit flip in
                   one rank's parameter or gradient at one step

The trainer (`megalite.train.trainer`) calls them around the optimizer step; they communicate
over the `Topology`'s groups and hold no module state.
"""
