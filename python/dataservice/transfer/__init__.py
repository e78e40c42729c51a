"""Element transfer between workers and clients: a registry of protocols."""
