"""gpuwatch: where GPU time goes in training clusters, and which GPU is about to fail."""

__version__ = "0.1.0"
