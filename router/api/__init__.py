"""The HTTP API: handlers, request building, rendering, admission, admin verbs."""
