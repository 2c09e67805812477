"""Offline tools behind the ``cnr`` command: inspect, verify, export, compact."""
