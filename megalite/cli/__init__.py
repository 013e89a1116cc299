"""The commands, one module each with a `main()`: the console scripts of pyproject.toml and the
wrappers in scripts/ call them.

    megalite-pretrain   pretrain.py   train (Hydra overrides)          (scripts/pretrain.py)
    megalite-prepare    prepare.py    token shards for data.dir        (scripts/prepare_data.py)
    megalite-plan       plan.py       memory and traffic of a layout   (scripts/plan.py)
    megalite-export     export.py     checkpoint -> transformers dir   (scripts/export_hf.py)
    megalite-generate   generate.py   sample text from a checkpoint    (scripts/generate.py)
    megalite-verify-rank verify_rank.py  rank R of an N-rank layout, built (scripts/verify_rank.py)
    megalite-evaluate   evaluate.py   lm-eval harness on the export    (scripts/evaluate.py)
    megalite-plot       plot.py       runs' metrics.jsonl as a PNG     (scripts/plot.py)
    megalite-torchrun   torchrun.py   torchrun, short failures, 75/2   (scripts/torchrun.py)

`megalite-bench` (benchmarks against references, scripts/bench.py) is the benchmarks'
package's command: `megalite_bench/cli.py`, beside megalite/.

Under torchrun: `torchrun --nproc_per_node=8 --no-python megalite-pretrain <overrides>`.
"""

# Added to the command line of a process that must leave no Hydra run directory (no
# outputs/<date>/, no .hydra/, no log file): data preparation, and ranks other than 0 of a run.
NO_HYDRA_OUTPUT = ("hydra.output_subdir=null", "hydra.run.dir=.",
                   "hydra/job_logging=disabled", "hydra/hydra_logging=disabled")
