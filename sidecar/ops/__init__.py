"""Operating the daemon: config, metrics, systemd notify, socket files, doctor."""
