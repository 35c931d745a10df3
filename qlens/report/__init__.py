"""`qlens report`: one run of a model on a prompt, summarised as text and JSON."""

from qlens.report.build import Report, ReportContext, Section, build_report

__all__ = ["Report", "ReportContext", "Section", "build_report"]
