"""``prepare_fp8(self)`` in ``configure_model`` under ModelParallelStrategy (FSDP2), from the user's side: the same
LightningModule in every mode the Trainer flag picks. Outside fp8 it must change nothing: the run trains exactly
as the one without the call, to the bit. (fp8 itself needs a GPU: tests/gpu/test_fp8_sharded_gpu.py; the true-half
modes are refused under ModelParallelStrategy with the FSDP2 way, tests/test_model_parallel.py.)"""

from __future__ import annotations

import pytest
import torch
from test_model_parallel import Sharded, trainer_for

from lightning_mp import MPPlugin, prepare_fp8

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed")


class Prepared(Sharded):
    def configure_model(self):
        prepare_fp8(self)
        super().configure_model()


def _run(tmp_path, model_cls, mode):
    tmp_path.mkdir()
    torch.manual_seed(0)
    scale = {"init_scale": 2.0**8} if mode == "fp16" else {}  # no overflow of its own on the clean steps
    trainer_for(MPPlugin(mode, **scale), str(tmp_path)).fit(model_cls(poison_grad=(2,)))
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in (0, 1)]


@pytest.mark.parametrize("mode", ["fp32", "bf16", "fp16"])
def test_prepare_fp8_outside_fp8_trains_exactly_as_without_it(tmp_path, mode):
    with_call = _run(tmp_path / "with", Prepared, mode)
    without = _run(tmp_path / "without", Sharded, mode)
    for ours, theirs in zip(with_call, without):
        assert ours["stats"] == theirs["stats"] and ours["stats"]["skipped_steps"] == 1  # the poisoned step
        assert set(ours["params"]) == set(theirs["params"])
        for name, value in ours["params"].items():
            assert torch.equal(value, theirs["params"][name]), name
