"""The worker's training side: LoRA fine-tuning of Gemma 4 with Tunix + Qwix (JAX).

Never imported by ``app/`` (the web process does not load JAX). Importing this package itself
loads nothing heavy; the modules are:

- ``engine``: ``TrainSpec``, ``Reporter``, ``TrainResult``, ``train(spec, reporter)`` (JAX, Tunix).
- ``data``: dataset file -> Gemma chat format -> tokens + loss masks -> static-shape batches.
- ``models``: HF ``config.json`` -> Tunix ``ModelConfig``, presets, LoRA targets, weight loading.
- ``tiny``: ``create_tiny_gemma4(dest)``, the locally made base model for CPU demos and tests
  (numpy + safetensors + tokenizers only).
- ``demo``: ``demo_dataset_jsonl()``, the one-click demo dataset (pure Python).
- ``corpus``: the tiny tokenizer's training text.
"""
