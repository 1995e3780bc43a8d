"""Runs the model over sequences: state allocation, prefill/decode steps, sampling."""
