"""Evaluation beyond the validation loss: multiple-choice scoring through the pipeline in any
layout (`choice`) and the HellaSwag examples it scores (`hellaswag`)."""
