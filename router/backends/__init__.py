"""Where requests go: Ray workers, HTTP servers, and engines the router did not start
(`external/`). Imports `routing`, never `api`."""
