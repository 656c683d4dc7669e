"""Failure prediction: fault taxonomy, rule baseline, simulated failures, features, training, evaluation."""
