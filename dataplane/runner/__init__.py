"""Runs the model on one flattened varlen batch per step: inputs, paged attention hook, sampling."""
