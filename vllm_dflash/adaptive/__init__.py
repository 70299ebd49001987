"""The adaptive draft length (``controller.py``), without vLLM; ``serving/adaptive_draft_len.py``
puts it into vLLM's scheduler. Policy and measurements: ``docs/adaptive-draft-length.md``."""
