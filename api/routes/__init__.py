"""The API's routers: jobs (and their trials, best, build), job events (SSE), service endpoints."""
