"""The efficiency engine: where every rank's GPU time went (spec: efficiency.md v1)."""
from gpuwatch.efficiency.engine import analyze
from gpuwatch.efficiency.load import load_paths
from gpuwatch.efficiency.partition import CATEGORIES
from gpuwatch.efficiency.result import Analysis
from gpuwatch.efficiency.timeline import RankTimeline

__all__ = ["CATEGORIES", "Analysis", "RankTimeline", "analyze", "load_paths"]
