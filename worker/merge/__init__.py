"""LoRA checkpoints out of training: merged into the base's Hugging Face safetensors (streamed, in
constant memory), exported as a PEFT adapter, and verified against the model training ran.

Used by the worker; imports nothing from ``app/``. ``verify_merged`` needs JAX and Tunix (the
``train`` extra), like the rest of ``worker.merge``; torch is never needed.
"""

from worker.merge.lora import LoraWeights, load_lora
from worker.merge.merge import MergeResult, export_peft, merge_lora
from worker.merge.output import FileEntry
from worker.merge.verify import verify_merged

__all__ = ["FileEntry", "LoraWeights", "MergeResult", "export_peft", "load_lora", "merge_lora", "verify_merged"]
