"""Tools around the trainer, not on its training path: the bench and its GPU checks, the memory
rehearsal and measurements, host-sync counting, metric plots and the config report."""
