"""Rendered samples during training: `validation.samples` through diffusers' H3 pipeline with the live model."""
