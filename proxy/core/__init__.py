"""The low layer every process and package imports: errors, parameters, logging, the op-record vocabulary."""
