"""Thin absl binaries: train, eval, sweep, plot."""
