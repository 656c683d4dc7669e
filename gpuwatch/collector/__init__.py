"""The collector: ingest, store, efficiency breakdowns, failure scoring, alerts, queries, metrics."""
