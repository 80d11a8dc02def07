"""Monitoring callbacks that work with any precision plugin (Lightning's own or ``MPPlugin``)."""

from lightning_mp.callbacks.detector import NonFiniteDetector, NonFiniteReport, TensorFinding
from lightning_mp.callbacks.monitor import PrecisionMonitor
from lightning_mp.callbacks.schedule import PrecisionSchedule

__all__ = ["NonFiniteDetector", "NonFiniteReport", "PrecisionMonitor", "PrecisionSchedule", "TensorFinding"]
