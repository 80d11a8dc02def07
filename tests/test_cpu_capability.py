"""What lightning_mp reads of the CPU (the rest of the suite sees a pinned CPU with native bf16: conftest.py), and
the one wording of the 16-bit penalty on a CPU, quoted by the docs."""

from __future__ import annotations

import platform
from pathlib import Path

import pytest
import torch
from conftest import REAL_CPU_CAPABILITY

from lightning_mp import cpu as cpu_module
from lightning_mp.cpu import FAST_BF16_ON_CPU, SLOW_BF16_ON_CPU, SLOW_FP16_ON_CPU, CpuCapability

ROOT = Path(__file__).resolve().parents[1]
X86 = platform.machine().lower() in ("x86_64", "amd64")


def read_afresh() -> CpuCapability:
    return REAL_CPU_CAPABILITY.__wrapped__()  # (past the per-process cache)


def test_this_machines_cpu_is_read_once_and_named():
    cpu = REAL_CPU_CAPABILITY()
    assert isinstance(cpu, CpuCapability) and REAL_CPU_CAPABILITY() is cpu  # cached for the process
    assert cpu.isa == torch.backends.cpu.get_cpu_capability()
    assert cpu.describe().startswith(f"{cpu.isa}, ") and cpu.how


@pytest.mark.skipif(not X86 or not hasattr(torch.cpu, "get_capabilities"), reason="reads x86 flags through torch")
def test_on_x86_the_flags_decide(monkeypatch):
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    flags = torch.cpu.get_capabilities()
    cpu = read_afresh()
    assert cpu.bf16 == bool(flags.get("avx512_bf16") or flags.get("amx_bf16"))
    assert cpu.fp16 == bool(flags.get("avx512_fp16") or flags.get("amx_fp16"))
    assert cpu.how == ("AMX" if flags.get("amx_bf16") else "AVX512-BF16" if cpu.bf16 else "no AVX512-BF16 or AMX")
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "avx2")  # oneDNN held below bf16: it runs bf16 in software
    held = read_afresh()
    assert not held.bf16 and not held.fp16
    assert held.how == ("oneDNN held to AVX2" if cpu.bf16 else "no AVX512-BF16 or AMX")


def test_elsewhere_a_short_probe_decides(monkeypatch):
    monkeypatch.setattr(cpu_module, "_x86_flags", lambda: None)  # an Arm CPU, or a torch that cannot read the flags
    cpu = read_afresh()
    assert cpu.how.startswith("a probe: bf16 matmul ") and cpu.how.endswith("x fp32's time") and not cpu.fp16
    ratio = float(cpu.how.split()[-3].rstrip("x"))
    assert cpu.bf16 == (ratio <= 1.0)


def test_the_docs_quote_the_measured_penalty_word_for_word():
    page = " ".join(line.lstrip("> ").strip() for line in (ROOT / "docs" / "modes.md").read_text().splitlines())
    for words in (SLOW_BF16_ON_CPU, SLOW_FP16_ON_CPU, FAST_BF16_ON_CPU):
        assert words in page, words


def test_the_docs_show_autos_log_line_as_a_cpu_without_native_bf16_gets_it(monkeypatch):
    from lightning_mp import MPPlugin
    from lightning_mp.options import summary

    slow = CpuCapability("AVX2", bf16=False, how="no AVX512-BF16 or AMX")
    monkeypatch.setattr(cpu_module, "cpu_capability", lambda: slow)
    line = f"lightning_mp: using {summary(MPPlugin('auto'))}"
    assert line in (ROOT / "docs" / "modes.md").read_text()
