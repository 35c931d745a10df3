"""`qlens report`: a model and its quantized versions on one prompt, as text, JSON and HTML."""

from qlens.report.audit import WeightAudit, WeightRow, audit_weights
from qlens.report.build import Report, ReportContext, Section, build_report
from qlens.report.variants import Variant

__all__ = [
    "Report",
    "ReportContext",
    "Section",
    "Variant",
    "WeightAudit",
    "WeightRow",
    "audit_weights",
    "build_report",
]
