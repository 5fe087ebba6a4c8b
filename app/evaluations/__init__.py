"""Evaluations: scoring fine-tuned models' answers against references and comparing models."""
