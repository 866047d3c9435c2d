"""The device graphs' HLO: read into a small IR, checked against the port's contracts, measured per graph."""
