"""Runnable examples: ``python -m examples.gpt_mini`` and ``python -m examples.vlm_mini`` (Lightning CLI).

Run them from the repository root, e.g.::

    python -m examples.gpt_mini fit --config examples/configs/gpt_mini_bf16.yaml
    python -m examples.vlm_mini fit --config examples/configs/vlm_mini_fp16.yaml
"""
