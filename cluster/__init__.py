"""Wiring on Ray: launcher, CLI, Ray Serve app, simulator, load generator."""
