"""Routing decisions with no transport in them (no aiohttp, ZMQ, FastAPI or Ray): the simulator
runs this room as the live router does."""
