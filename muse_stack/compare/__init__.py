"""Comparisons: fingerprint diffs, audits against recorded stacks, run convergence."""

from muse_stack.compare.audit import audit
from muse_stack.compare.convergence import Thresholds, check_convergence
from muse_stack.compare.diff import diff_documents
from muse_stack.compare.runcompare import Gates, compare_runs

__all__ = ["Gates", "Thresholds", "audit", "check_convergence", "compare_runs", "diff_documents"]
