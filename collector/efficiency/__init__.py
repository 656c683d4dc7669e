"""The efficiency engine: where every rank's GPU time went (spec: efficiency.md v1)."""
from gpuwatch.collector.efficiency.engine import analyze
from gpuwatch.collector.efficiency.load import load_paths
from gpuwatch.collector.efficiency.partition import CATEGORIES
from gpuwatch.collector.efficiency.timeline import RankTimeline

__all__ = ["CATEGORIES", "RankTimeline", "analyze", "load_paths"]
