"""Runs the model on one flattened varlen batch per step: inputs, load-time linear transforms, sampling."""
