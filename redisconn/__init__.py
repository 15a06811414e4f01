"""How fleetgate reaches Redis: one URL, one factory, the same options for every store."""
