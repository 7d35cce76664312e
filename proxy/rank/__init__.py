"""The rank side: the API a rank process calls (Comm, requests, buffers, the object layer)."""
