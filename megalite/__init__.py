"""megalite: Megatron-style parallel pretraining of GPT-2 and Llama in plain PyTorch.

Importing the package registers the built-in model families (`megalite.model.families`), so
that a config's `model.arch` is known wherever a config is checked."""
import megalite.model.families  # noqa: F401  (registers GPT-2 and Llama)
