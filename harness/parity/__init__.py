"""Parity workflows: observe the port and the references, check, served check, bisect, truncate."""
