"""The terminal dashboard, `localserve top`: a client of the server's HTTP API only."""
