"""The control plane: bootstrap, the service socket (server, client, protocol) and its handlers."""
