"""Tensor helpers the callbacks share."""

from __future__ import annotations

from typing import Any

from torch import Tensor


def _local(t: Tensor) -> Tensor:
    """This rank's shard of a DTensor (FSDP2, tensor parallelism): reductions on it stay local, no collective."""
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None else t


def _floating_tensors(value: Any, skip_sparse: bool = False) -> list[Tensor]:
    """The non-empty floating-point tensors in ``value`` (a tensor, or lists, tuples and dicts of them)."""
    if isinstance(value, Tensor):
        keep = value.is_floating_point() and value.numel() > 0 and not (skip_sparse and value.is_sparse)
        return [value] if keep else []
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _floating_tensors(v, skip_sparse)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _floating_tensors(v, skip_sparse)]
    return []
