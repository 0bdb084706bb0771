"""Ground: what every layer may use (settings, errors, the network, private files, metrics)."""
