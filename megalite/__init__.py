"""megalite: Megatron-style parallel pretraining of GPT-2 and Llama in plain PyTorch.

Importing the package tells the config where the built-in model families are: the first
question about a family (`megalite.config.families.registered_family`) imports
`megalite.model.families`, which registers GPT-2 and Llama. Until then nothing imports the
models (or torch): a command's `--help` or a refusal before the model stays light."""
from megalite.config.families import builtin_families_from


def _register_builtin_families() -> None:
    import megalite.model.families  # noqa: F401  (registers GPT-2 and Llama)


builtin_families_from(_register_builtin_families)
