"""Faults that do not crash the run (the `resilience` config section).

    replicas.py    replica consistency: ranks that must hold identical values compare exact
                   checksums every `resilience.check_every` steps and before every checkpoint
                   (silent data corruption stops the run before it is saved)
    stragglers.py  straggler reports: each rank's compute time per step phase, without its
                   waits in collectives, compared with its peers' every
                   `resilience.straggler_report_every` steps
    flight.py      the flight recorder: each rank's last collectives per process group, with
                   their sequence numbers, judged done by completion (Work.is_completed(),
                   CUDA events), not by a call's return (`megalite.parallel.calls` reports
                   every call)
    hang.py        hang dumps (`resilience.hang_dump`): on an operation not complete after
                   resilience.hang_after_s, a failed or timed-out collective, or on
                   `resilience.hang_signal`, every rank writes its thread stacks and last
                   collectives to <run dir>/hang/
    hang_report.py the summary of the dumps: the ranks that did not arrive, and the group

The trainer (`megalite.train.trainer`) calls the checks after the optimizer step and trains
inside the hang watch; they communicate over the `Topology`'s groups (the hang dumps over
the c10d store) and hold no module state.
    rerun.py       rerun attribution (`resilience.rerun`): a NaN or spike step re-executed
                   before its optimizer step and blamed on a transient fault, a persistent
                   fault or the data (spikes.py: the suspicion test; verdicts.py: who is to
                   blame; faults.py: fault.json, the exit code, the logs of skipped batches)
    inject.py      fault drills (`resilience.inject`, parsed by `megalite.config.inject`; the
                   rank's tensor checked before launch by inject_target.py): a bit flip in
                   one rank's parameter or gradient at one step

The trainer (`megalite.train.trainer`) calls them around the optimizer step; they communicate
over the `Topology`'s groups and hold no module state.
"""
