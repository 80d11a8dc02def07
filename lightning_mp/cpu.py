"""The CPU's 16-bit capability: whether it multiplies bf16 (and fp16) matrices natively, read once a process, and the
measured cost of training in either where it does not. :mod:`lightning_mp.modes` decides on it (``auto``, the CPU
warnings); ``compare`` names it; the FP8 checks name the CPU's mode.

>>> from lightning_mp.cpu import CpuCapability, cpu_mode
>>> cpu_mode(CpuCapability("AVX2", bf16=False, how="no AVX512-BF16 or AMX"))
'fp32'
"""

from __future__ import annotations

import functools
import os
import platform
import time
from dataclasses import dataclass
from typing import Optional

import torch

#: What 16-bit training costs against fp32 on a CPU without native kernels for it, in the words every warning,
#: ``compare``'s notes and the docs use (a test checks the docs quote them). Measured with ``compare``'s built-in
#: GPT-mini (1,024 tokens a step; two runs of 8 paired rounds each) and a 1024³ matrix multiply (best of 3-30) on a
#: 2-core x86 CPU with AVX512 and AVX512-BF16 (torch 2.13, a quiet machine); the CPUs without AVX512-BF16 by holding
#: it back: ``ONEDNN_MAX_CPU_ISA=AVX512_CORE``, and ``ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2`` (docs/modes.md,
#: "On a CPU", has the table).
SLOW_BF16_ON_CPU = (
    "bf16 trains 1.3x slower than fp32 on a CPU with AVX512 but no AVX512-BF16 or AMX, and 10x slower with AVX2 alone"
    " (GPT-mini steps; a 1024³ matmul: 1.3x and 160x)"
)
SLOW_FP16_ON_CPU = (
    "fp16 trains 12-14x slower than fp32 on a CPU without AVX512-FP16 or AMX-FP16 (GPT-mini steps; a 1024³ matmul:"
    " 210x)"
)
#: what a CPU with native bf16 gains (the same measurement, natively), as ``auto``'s log line says it
FAST_BF16_ON_CPU = "bf16 trains 1.15x faster than fp32 there (GPT-mini steps; a 1024³ matmul: 4x)"

#: oneDNN's instruction-set caps (``ONEDNN_MAX_CPU_ISA``) below which it has no native bf16, or no native fp16
_ONEDNN_NO_BF16 = {"SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI"}
_ONEDNN_NO_FP16 = _ONEDNN_NO_BF16 | {"AVX512_CORE_BF16", "AVX10_1_512_AMX", "AVX512_CORE_AMX"}


@dataclass(frozen=True)
class CpuCapability:
    """What a CPU offers 16-bit matrix multiplies: what ``auto``, the CPU warnings and ``compare`` decide on.

    :func:`cpu_capability` reads this machine's; tests and callers build their own::

        CpuCapability("AVX2", bf16=False)                            # a laptop or cloud CPU of the common kind
        CpuCapability("AVX512", bf16=True, how="AVX512-BF16")        # bf16 in hardware
        modes.auto_choice("cpu", CpuCapability("AVX2", bf16=False))  # ('fp32', '...')
    """

    #: torch's kernel level, ``torch.backends.cpu.get_cpu_capability()``: ``"AVX2"``, ``"AVX512"``, ``"DEFAULT"``, ...
    isa: str
    #: bf16 matrix multiplies in hardware (x86: AVX512-BF16 or AMX; elsewhere: a probe found bf16 no slower than fp32)
    bf16: bool
    #: fp16 matrix multiplies in hardware (x86: AVX512-FP16 or AMX-FP16)
    fp16: bool = False
    #: what told: the flags that give native bf16 (``"AVX512-BF16"``, ``"AMX"``), or the probe's timings
    how: str = ""

    def describe(self) -> str:
        """The CPU in a few words, as the log line and the warnings name it: ``"AVX2, no AVX512-BF16 or AMX"``."""
        how = self.how or ("native bf16" if self.bf16 else "no native bf16")
        return f"{self.isa}, {how}"


@functools.lru_cache(maxsize=None)
def cpu_capability() -> CpuCapability:
    """This machine's :class:`CpuCapability`, found once a process: on x86 from the CPU's flags as torch reads them
    (``torch.cpu.get_capabilities()``; AVX512-BF16 or AMX for bf16, AVX512-FP16 or AMX-FP16 for fp16; a cap set
    through ``ONEDNN_MAX_CPU_ISA`` counts), elsewhere from a probe of a few milliseconds: a 256³ matrix multiply
    timed in fp32 and in bf16."""
    isa = str(torch.backends.cpu.get_cpu_capability())
    flags = _x86_flags()
    if flags is None:
        return _probe_bf16(isa)
    has = lambda *names: any(flags.get(n, False) for n in names)  # noqa: E731
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA", os.environ.get("DNNL_MAX_CPU_ISA", "")).strip().upper()
    bf16 = has("avx512_bf16", "amx_bf16") and cap not in _ONEDNN_NO_BF16
    fp16 = has("avx512_fp16", "amx_fp16") and cap not in _ONEDNN_NO_FP16
    if bf16:
        how = "AMX" if has("amx_bf16") else "AVX512-BF16"
    else:
        how = f"oneDNN held to {cap}" if cap in _ONEDNN_NO_BF16 else "no AVX512-BF16 or AMX"
    return CpuCapability(isa, bf16, fp16, how)


def _x86_flags() -> Optional[dict[str, bool]]:
    """The x86 CPU flags torch reads (``None`` on other CPUs, or where this torch cannot read them)."""
    if platform.machine().lower() not in ("x86_64", "amd64", "i386", "i686", "x86"):
        return None
    read = getattr(torch.cpu, "get_capabilities", None)  # torch 2.10+
    if read is not None:
        return {k: bool(v) for k, v in read().items() if isinstance(v, bool)}
    names = {"avx512_bf16": "_is_avx512_bf16_supported", "amx_bf16": "_is_amx_tile_supported",
             "amx_fp16": "_is_amx_fp16_supported"}  # (AMX tiles come with AMX-BF16 on every CPU that has them)
    readers = {flag: getattr(torch.cpu, name, None) for flag, name in names.items()}
    if readers["avx512_bf16"] is None:
        return None
    return {flag: bool(reader()) for flag, reader in readers.items() if reader is not None}


def _probe_bf16(isa: str) -> CpuCapability:
    """A CPU whose flags are not read here: bf16 counts as native when a 256³ matmul in bf16 takes no longer than in
    fp32 (best of three each, after one untimed run; a few milliseconds, or a fraction of a second where bf16 runs
    in software)."""
    timings = []
    for dtype in (torch.float32, torch.bfloat16):
        a = torch.randn(256, 256).to(dtype)
        b = torch.randn(256, 256).to(dtype)
        a @ b
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            a @ b
            best = min(best, time.perf_counter() - start)
        timings.append(best)
    ratio = timings[1] / max(timings[0], 1e-9)
    return CpuCapability(isa, ratio <= 1.0, False, f"a probe: bf16 matmul {ratio:.2g}x fp32's time")


def cpu_mode(cpu: Optional[CpuCapability] = None) -> str:
    """The mode ``auto`` runs on a CPU (this machine's unless ``cpu`` is given): bf16 where the CPU has native bf16,
    else fp32."""
    cpu = cpu if cpu is not None else cpu_capability()
    return "bf16" if cpu.bf16 else "fp32"
